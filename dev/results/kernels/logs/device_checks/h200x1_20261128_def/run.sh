#!/usr/bin/env bash
# One nvidia-h100-x1 call (carry [".c6"]), nothing built there. test_gpu and test_train_gpu: the full
# library of p16-def's first commit ac19536 (the 4-bit DEF instance), built on the 2-core machine for
# sm_90 (/work/b90d, xz'd here): test_gpu's 4-bit and rounding parity, test_train_gpu. Then bench_gpu
# "bf16" (AdamW-only builds) of main's four_run (3482552), def (ac19536) and def8 (8ecb5ba, + the 8-bit
# DEF instance; its parity needs a full build of 8ecb5ba), two rounds.
S=$SECONDS; el() { echo "[c6 $((SECONDS - S)) s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
mkdir -p build
for b in test_gpu test_train_gpu; do xz -dc .c6/$b.xz > build/$b; chmod +x build/$b; done
for t in "4-bit states" "stochastic rounding"; do
  TEST_ONLY="$t" timeout 200 ./build/test_gpu 2>&1 | grep -E "^ok|^FAIL|passed" | cut -c1-150
done | tee $OUT/parity_def.txt
el "parity done"
timeout 150 ./build/test_train_gpu > $OUT/test_train_gpu.txt 2>&1
el "test_train_gpu rc $?"; grep -E "^ok|^FAIL|^skip|passed|FAIL" $OUT/test_train_gpu.txt | cut -c1-150
for round in 1 2; do for b in .c6/four_run .c6/def .c6/def8; do
  echo "=== round $round: $b"; timeout 60 $b/bench_gpu "bf16" 2>&1 | grep -E "copy bandwidth|\| AdamW|error|not run"
done; done > $OUT/bench_def.txt
grep -E "===|copy|4bit|8bit-sr|int8 ECC" $OUT/bench_def.txt | cut -c1-120
el done
# Nsight Compute of the DEF kernels: one launch each of 4bit-int8 (def) and 8bit-int8 (def8).
for pair in "def 4bit-int8" "def8 8bit-int8"; do set -- $pair
  mkdir -p $OUT/ncu_$1
  timeout 120 ncu --clock-control none --kernel-name-base demangled --kernel-name "regex:bnb8_update_kernel" --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
    --print-details all .c6/$1/bench_gpu "$2" > $OUT/ncu_$1/details.txt 2>&1
  el "ncu $1 rc $?"; grep -E "bnb8_update_kernel|Registers Per|Achieved Occ|DRAM Throughput|Memory Throughput|Duration|Local" $OUT/ncu_$1/details.txt | head -12 | cut -c1-160
done
