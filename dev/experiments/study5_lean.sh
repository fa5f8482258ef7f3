#!/usr/bin/env bash
# Study 5, lean recipes: 4-bit states with an int8 correction (4bit-int8), and the recipes without a
# master, whose weights are rounded stochastically (4bit-sr, 8bit-sr), each with and without gradient
# release on EXP_MODEL (d12) and on EXP_SCALE_MODEL (d24), and 4bit-sr with the other seeds on
# EXP_MODEL; the paper's ablations on EXP_MODEL: v's map with zero, rank-1 normalization (the recipes
# go without), nearest rounding without a master. The same data, batch, schedule and seed as studies 1 and 4, whose fp32
# seeds (study 3 at d12, study 4 at d24) are the reference: results.py reads them there.
# The runs are listed in the order of their importance, which run_all.sh keeps (its budget drops the
# last ones first). Settings: environment variables, see common.sh and README.md.
source "$(dirname "$0")/common.sh"
S=study5_lean
: "${EXP_SCALE_MODEL:=d24}"
: "${EXP_SCALE_SEEDS:=1 2}"
: "${EXP_LEAN_RECIPES:=4bit-int8 4bit-sr 8bit-sr}"   # with and without release on EXP_MODEL, without on EXP_SCALE_MODEL
: "${EXP_LEAN_SCALE_RELEASE:=4bit-sr 4bit-int8 8bit-sr}"   # these also with release on EXP_SCALE_MODEL
: "${EXP_LEAN_SEED_RECIPES:=4bit-sr}"                # these also with the other seeds of EXP_SEEDS on EXP_MODEL
# The ablations: the flags that make each, and the recipe each changes (run NAME_<ablation> is run
# NAME with these flags; results.py compares the two).
: "${ZERO_MAP_FLAGS:=-M linear}"       # v's 4-bit map with zero in it
: "${RANK1_FLAG:=-V rank1}"            # rank-1 normalization of v on the matrices (the recipes have none: blocks of 128)
: "${NEAREST_RECIPE:=4bit-rn}"      # nearest rounding without a master: 4bit-sr's states, weights rounded to nearest
: "${ABLATION_RECIPE:=4bit-int8}"      # the recipe of the map and rank-1 ablations
: "${NEAREST_OF:=4bit-sr}"             # the stochastically rounded recipe that NEAREST_RECIPE replaces
M=$EXP_MODEL L=$EXP_SCALE_MODEL

# Release steps each layer inside backward: clipped with the trainer's rule for release (-N), as in study 1.
release=(-g "$EXP_RELEASE_CLIP" -R 1)
for r in $EXP_LEAN_RECIPES; do run $S "${M}_adamw_$r" -p adamw -r "$r"; done
for r in $EXP_LEAN_RECIPES; do run $S "${M}_adamw_${r}_release" -p adamw -r "$r" "${release[@]}"; done
for r in $EXP_LEAN_RECIPES; do run $S "${L}_adamw_$r" -e "$L" -p adamw -r "$r"; done
# shellcheck disable=SC2086   # the ablations' flags are split into words on purpose
{
    run $S "${M}_adamw_${ABLATION_RECIPE}_zeromap" -p adamw -r "$ABLATION_RECIPE" $ZERO_MAP_FLAGS
    run $S "${M}_adamw_${ABLATION_RECIPE}_rank1" -p adamw -r "$ABLATION_RECIPE" $RANK1_FLAG
    run $S "${M}_adamw_${NEAREST_OF}_nearest" -p adamw -r "$NEAREST_RECIPE"
}
# A control: fp32 at this commit, against the reference runs made at earlier commits.
run $S "${M}_adamw_fp32" -p adamw -r fp32
for r in $EXP_LEAN_SCALE_RELEASE; do run $S "${L}_adamw_${r}_release" -e "$L" -p adamw -r "$r" "${release[@]}"; done
# Seed noise of a lean recipe: whether it ends below fp32 (as the 4-bit runs of seed 1337 do) over seeds.
for r in $EXP_LEAN_SEED_RECIPES; do
    for d in $EXP_SEEDS; do [ "$d" = 1337 ] || run $S "${M}_adamw_${r}_seed$d" -p adamw -r "$r" -d "$d"; done
done

# The references are the fp32 runs of studies 1, 3 and 4 (STUDY/RUN): the first run is the one the
# plots' difference panel subtracts.
fp32=() fp32_scale=(study4_scale/"${L}_adamw_fp32") runs=() rel=() scale=()
for d in $EXP_SEEDS; do fp32+=(study3_seeds/adamw_fp32_seed"$d"); done
for d in $EXP_SCALE_SEEDS; do fp32_scale+=(study4_scale/"${L}_adamw_fp32_seed$d"); done
for r in $EXP_LEAN_RECIPES; do
    runs+=("${M}_adamw_$r") rel+=("${M}_adamw_${r}_release") scale+=("${L}_adamw_$r")
done
for r in $EXP_LEAN_SCALE_RELEASE; do scale+=("${L}_adamw_${r}_release"); done
for r in $EXP_LEAN_SEED_RECIPES; do
    for d in $EXP_SEEDS; do [ "$d" = 1337 ] || runs+=("${M}_adamw_${r}_seed$d"); done
done
plot $S "$M" "Study 5: $M, lean recipes vs fp32 (seeds $EXP_SEEDS)" "${fp32[@]}" "${runs[@]}"
plot $S "$M-release" "Study 5: $M with gradient release (-g $EXP_RELEASE_CLIP)" "${fp32[0]}" \
    study1_recipes/adamw_fp32_release "${rel[@]}"
plot $S "$M-ablations" "Study 5: $M, the ablations beside their recipes" "${fp32[0]}" \
    "${M}_adamw_$ABLATION_RECIPE" "${M}_adamw_${ABLATION_RECIPE}_zeromap" "${M}_adamw_${ABLATION_RECIPE}_rank1" \
    "${M}_adamw_$NEAREST_OF" "${M}_adamw_${NEAREST_OF}_nearest"
plot $S "$L" "Study 5: $L, lean recipes vs fp32 (seeds 1337 $EXP_SCALE_SEEDS)" "${fp32_scale[@]}" "${scale[@]}"
