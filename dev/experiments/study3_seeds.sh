#!/usr/bin/env bash
# Study 3, seed noise: fp32 AdamW with the seeds in EXP_SEEDS (-d: initialization; the data order is
# sequential and does not depend on it), so that "within noise" in study 1 has a number. Seed 1337 is
# every other run's seed: that run is study 1's adamw_fp32, copied.
source "$(dirname "$0")/common.sh"
S=study3_seeds

runs=()
for d in $EXP_SEEDS; do
    if [ "$d" = 1337 ]; then
        same $S "adamw_fp32_seed$d" study1_recipes adamw_fp32
    else
        run $S "adamw_fp32_seed$d" -p adamw -r fp32 -d "$d"
    fi
    runs+=("adamw_fp32_seed$d")
done
plot $S seeds "Study 3: fp32 AdamW, seeds $EXP_SEEDS" "${runs[@]}"
