#!/usr/bin/env bash
# Study 4, one more size: the main AdamW recipes on EXP_SCALE_MODEL (d24, GPT-2 350M; about three
# times a d12 run), the same data, batch and schedule as the other studies; fp32 and 8bit again with
# the seeds of EXP_SCALE_SEEDS, so that "within noise" has a number at this size too.
source "$(dirname "$0")/common.sh"
S=study4_scale
: "${EXP_SCALE_MODEL:=d24}"
: "${EXP_SCALE_SEEDS:=1 2}"

runs=()
for r in fp32 8bit flash; do
    run $S "${EXP_SCALE_MODEL}_adamw_$r" -e "$EXP_SCALE_MODEL" -p adamw -r "$r"
    runs+=("${EXP_SCALE_MODEL}_adamw_$r")
done
for d in $EXP_SCALE_SEEDS; do
    for r in fp32 8bit; do
        run $S "${EXP_SCALE_MODEL}_adamw_${r}_seed$d" -e "$EXP_SCALE_MODEL" -p adamw -r "$r" -d "$d"
        runs+=("${EXP_SCALE_MODEL}_adamw_${r}_seed$d")
    done
done
plot $S "$EXP_SCALE_MODEL" "Study 4: $EXP_SCALE_MODEL, AdamW fp32 vs 8-bit vs flash" "${runs[@]}"
