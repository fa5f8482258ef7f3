#!/usr/bin/env bash
# One device call (carry [".c8"]), nothing built there (sm_90 builds of the 2-core machine):
# 1. test_gpu of 8ecb5ba (main 174f49a + the 8-bit DEF instance), every test: parity before it lands.
# 2. The trainer at d72 (7.3e9), B=1, T=1024, -C 1, release: flash and 8bit-int8 with the library of
#    8ecb5ba (train_def8), 8bit-int8 with that of 174f49a (train_def4, before the 8-bit instance).
# 3. Nsight Compute of the 8bit-int8 kernel (mode 2) of the AdamW-only 8ecb5ba bench.
S=$SECONDS; el() { echo "[c8 $((SECONDS - S)) s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for b in test_gpu train_def8 train_def4; do xz -T0 -dc .c8/$b.xz > .c8/$b; chmod +x .c8/$b; done
timeout 330 .c8/test_gpu > $OUT/test_gpu.txt 2>&1; el "test_gpu rc $?"
grep -E "^ok|^FAIL|passed" $OUT/test_gpu.txt | cut -c1-110
d72() {  # label, trainer, recipe
  timeout 80 .c8/$2 -D gpu -e d72 -b 1 -t 1024 -n 14 -l 3e-4 -w 0 -C 1 -R 1 -r $3 -v 0 -G 0 > $OUT/d72_$1.txt 2>&1
  el "d72 $1 rc $?"; grep -E "^step +1[0-4]/|memory|tok/s" $OUT/d72_$1.txt | tail -4 | cut -c1-130
}
d72 flash train_def8 flash
d72 8bit-int8_def8 train_def8 8bit-int8
d72 8bit-int8_def4 train_def4 8bit-int8
[ $((SECONDS - S)) -lt 480 ] && {
  mkdir -p $OUT/ncu_def8
  timeout 100 ncu --clock-control none --kernel-name-base demangled --kernel-name "regex:bnb8_update_kernel<2, 0, 2, 0>" \
    --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section SourceCounters \
    --page source --print-source sass --csv .c8/def8_bench "8-bit, bf16 + int8" > $OUT/ncu_def8/source.csv 2>&1
  el "ncu rc $?"; xz -T0 $OUT/ncu_def8/source.csv
}
el done
