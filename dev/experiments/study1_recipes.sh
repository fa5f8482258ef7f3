#!/usr/bin/env bash
# Study 1, recipes: the same model, seed, data order and schedule trained with 32-bit states (fp32),
# 8-bit block-wise states (blocks of 256, the default, and 2048), flash (bf16 weights + int8
# correction) with and without gradient release; AdamW, and fp32 vs 8-bit for Lion and SGD.
# Settings: environment variables, see common.sh and README.md.
source "$(dirname "$0")/common.sh"
S=study1_recipes

run $S adamw_fp32          -p adamw -r fp32
run $S adamw_8bit          -p adamw -r 8bit
run $S adamw_8bit_b2048    -p adamw -r 8bit -K 2048
run $S adamw_flash         -p adamw -r flash
# Release steps each layer inside backward, before a global norm exists, so it cannot clip (-g 0);
# adamw_flash_g0 is the same run without release, its exact counterpart.
run $S adamw_flash_g0      -p adamw -r flash -g 0
run $S adamw_flash_release -p adamw -r flash -g 0 -R 1
for p in lion sgd; do
    run $S ${p}_fp32 -p $p -r fp32
    run $S ${p}_8bit -p $p -r 8bit
done

plot $S adamw "Study 1: AdamW, fp32 vs 8-bit vs flash" \
    adamw_fp32 adamw_8bit adamw_8bit_b2048 adamw_flash adamw_flash_g0 adamw_flash_release
plot $S lion "Study 1: Lion, fp32 vs 8-bit" lion_fp32 lion_8bit
plot $S sgd "Study 1: SGD with momentum, fp32 vs 8-bit" sgd_fp32 sgd_8bit
