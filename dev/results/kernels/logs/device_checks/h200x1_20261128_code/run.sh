#!/usr/bin/env bash
# One device call (carry [".c10"]), nothing built there (sm_90 builds of the 2-core machine): branch
# p16-code (main's bnb8_cuda.cu + 4-bit codes by a lookup of the thresholds + the default instances'
# masters through the fast forms of the correction), the full library. bench_gpu "bf16" against
# main's kernels (main_bench: the AdamW-only build of 8ecb5ba, main's bnb8_cuda.cu), two rounds;
# test_gpu, every test; the trainer at d72 with 8bit-int8 + release.
S=$SECONDS; el() { echo "[c10 $((SECONDS - S)) s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for b in test_gpu bench_gpu train; do xz -T0 -dc .c10/$b.xz > .c10/$b; chmod +x .c10/$b; done
for round in 1 2; do for b in main_bench bench_gpu; do
  echo "=== round $round: $b"; timeout 60 .c10/$b "bf16" 2>&1 | grep -E "copy bandwidth|\| AdamW|error|not run"
done; done > $OUT/bench_code.txt
el "bench done"; grep -E "===|copy|4bit|8bit-sr|int8 ECC|fp32 master" $OUT/bench_code.txt | cut -c1-100
timeout 330 .c10/test_gpu > $OUT/test_gpu.txt 2>&1; el "test_gpu rc $?"
grep -E "^ok|^FAIL|passed" $OUT/test_gpu.txt | cut -c1-110
timeout 80 .c10/train -D gpu -e d72 -b 1 -t 1024 -n 14 -l 3e-4 -w 0 -C 1 -R 1 -r 8bit-int8 -v 0 -G 0 > $OUT/d72_8bit-int8_code.txt 2>&1
el "d72 rc $?"; grep -E "^step +1[0-4]/" $OUT/d72_8bit-int8_code.txt | tail -3 | cut -c1-130
