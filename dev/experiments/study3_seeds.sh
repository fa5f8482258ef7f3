#!/usr/bin/env bash
# Study 3, seed noise: fp32 AdamW with the seeds in EXP_SEEDS (-d: initialization; the data order is
# sequential and does not depend on it), so that "within noise" in study 1 has a number.
source "$(dirname "$0")/common.sh"
S=study3_seeds

runs=()
for d in $EXP_SEEDS; do
    run $S "adamw_fp32_seed$d" -p adamw -r fp32 -d "$d"
    runs+=("adamw_fp32_seed$d")
done
plot $S seeds "Study 3: fp32 AdamW, seeds $EXP_SEEDS" "${runs[@]}"
