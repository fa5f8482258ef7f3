#!/bin/bash
# device call 1: bench base vs v3 (AdamW-only builds carried), full build, parity master + stochastic
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
(make -j15 build/test_gpu build/train_gpt2_8bit_cuda > $OUT/build.log 2>&1; echo "rc=$?" >> $OUT/build.log) &
B=$!
for round in 1 2; do
  for v in base v3; do
    for r in "flash, bf16" "8-bit, bf16 + int8" "8-bit, bf16 + fp32" "32-bit, bf16" "8bit-sr" "4bit-int8"; do
      .cbuild/$v/bench_gpu "$r" 2>&1 | grep -E '^\||copy' >> $OUT/bench_$v.txt
    done
    t "round $round $v"
  done
done
wait $B; t "build: $(tail -1 $OUT/build.log)"
for s in master stochastic; do
  TEST_ONLY=$s timeout $(( 560 - ($(date +%s) - T0) )) ./build/test_gpu > $OUT/test_$s.log 2>&1; echo "rc=$?" >> $OUT/test_$s.log
  t "test $s: $(tail -2 $OUT/test_$s.log | tr "\n" " ")"
done
for v in base v3; do echo "== $v"; cat $OUT/bench_$v.txt; done
