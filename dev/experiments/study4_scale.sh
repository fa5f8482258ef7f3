#!/usr/bin/env bash
# Study 4, one more size: the main AdamW recipes on EXP_SCALE_MODEL (d24, GPT-2 350M; about three
# times a d12 run), the same data, batch and schedule as the other studies.
source "$(dirname "$0")/common.sh"
S=study4_scale
: "${EXP_SCALE_MODEL:=d24}"

runs=()
for r in fp32 8bit flash; do
    run $S "${EXP_SCALE_MODEL}_adamw_$r" -e "$EXP_SCALE_MODEL" -p adamw -r "$r"
    runs+=("${EXP_SCALE_MODEL}_adamw_$r")
done
plot $S "$EXP_SCALE_MODEL" "Study 4: $EXP_SCALE_MODEL, AdamW fp32 vs 8-bit vs flash" "${runs[@]}"
