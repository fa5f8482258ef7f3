#!/usr/bin/env bash
# Study 2, the paper's ablations (AdamW): 8-bit states with a linear instead of the dynamic
# quantization map (-M linear), without blocks (-K 0: one absmax per tensor), without
# StableEmbedding (-w 0; fp32 without it too, to tell the 8-bit effect from the layer's), each at
# the base learning rate and at the higher one(s) in EXP_LR_HIGH, where instability shows.
# At the base rate, fp32 and 8bit are study 1's adamw_fp32 and adamw_8bit (the same commands): copied.
source "$(dirname "$0")/common.sh"
S=study2_ablations

for lr in $EXP_LR_ADAMW $EXP_LR_HIGH; do
    n=lr$lr
    if [ "$lr" = "$EXP_LR_ADAMW" ]; then
        same $S "${n}_fp32" study1_recipes adamw_fp32
        same $S "${n}_8bit" study1_recipes adamw_8bit
    else
        run $S "${n}_fp32"      -p adamw -l "$lr" -r fp32
        run $S "${n}_8bit"      -p adamw -l "$lr" -r 8bit
    fi
    run $S "${n}_8bit_linear"   -p adamw -l "$lr" -r 8bit -M linear
    run $S "${n}_8bit_noblock"  -p adamw -l "$lr" -r 8bit -K 0
    run $S "${n}_8bit_nostable" -p adamw -l "$lr" -r 8bit -w 0
    run $S "${n}_fp32_nostable" -p adamw -l "$lr" -r fp32 -w 0
done

for lr in $EXP_LR_ADAMW $EXP_LR_HIGH; do
    n=lr$lr
    plot $S "$n" "Study 2: 8-bit AdamW ablations, peak lr $lr" "${n}_fp32" "${n}_8bit" \
        "${n}_8bit_linear" "${n}_8bit_noblock" "${n}_8bit_nostable" "${n}_fp32_nostable"
done
