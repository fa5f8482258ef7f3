#!/usr/bin/env bash
# Study 1, recipes: the same model, seed, data order and schedule trained with 32-bit states (fp32),
# 8-bit block-wise states (blocks of 256, the default, and 2048), 8-bit with an int8 correction of the
# bf16 weights (8bit-int8) and flash (bf16 weights + int8 correction, companded states), each also with
# gradient release; AdamW, and fp32 vs 8-bit for Lion and SGD. Every recipe on the GPU's bf16 model.
# Settings: environment variables, see common.sh and README.md.
source "$(dirname "$0")/common.sh"
S=study1_recipes
RECIPES="fp32 8bit 8bit-int8 flash"

for r in $RECIPES; do
    run $S "adamw_$r" -p adamw -r "$r"
done
run $S adamw_8bit_b2048 -p adamw -r 8bit -K 2048
# Release steps each layer inside backward, before this step's global norm exists: the trainer clips
# these runs with its rule for release (-N, named on the log's optim line). EXP_RELEASE_CLIP is their
# -g (default 1); at 0 the recipes in EXP_TWINS also get a run with -g 0 and no release: the exact
# counterpart of the unclipped release run.
for r in $RECIPES; do
    run $S "adamw_${r}_release" -p adamw -r "$r" -g "$EXP_RELEASE_CLIP" -R 1
    if [ "$EXP_RELEASE_CLIP" = 0 ] && [[ " $EXP_TWINS " == *" $r "* ]]; then
        run $S "adamw_${r}_g0" -p adamw -r "$r" -g 0
    fi
done
for p in lion sgd; do
    run $S "${p}_fp32" -p $p -r fp32
    run $S "${p}_8bit" -p $p -r 8bit
done

runs=()
for r in $RECIPES; do runs+=("adamw_$r"); done
plot $S adamw "Study 1: AdamW, fp32 vs 8-bit vs flash" "${runs[@]}" adamw_8bit_b2048
runs=()
for r in $RECIPES; do runs+=("adamw_${r}_release"); done
for r in $EXP_TWINS; do runs+=("adamw_${r}_g0"); done
plot $S release "Study 1: AdamW with gradient release (-g $EXP_RELEASE_CLIP)" "${runs[@]}"
plot $S lion "Study 1: Lion, fp32 vs 8-bit" lion_fp32 lion_8bit
plot $S sgd "Study 1: SGD with momentum, fp32 vs 8-bit" sgd_fp32 sgd_8bit
