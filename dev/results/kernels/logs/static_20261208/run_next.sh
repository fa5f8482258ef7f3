#!/bin/bash
# device call: bench main vs sr4 (AdamW-only sm_90 builds carried) while the full build runs; then
# every test_gpu group, the changed paths first, within LIMIT seconds. The two builds, made here first
# (about 5 minutes each on 2 cores; main = b31972e's kernels, sr4 = main with p16-next.diff applied), carried:
#   R=$PWD; git worktree add /tmp/wmain b31972e     # R: this checkout's root
#   (cd /tmp/wmain && make ONLY_ADAMW=1 BUILD=$R/.cbuild/main NVCC_ARCH=-arch=sm_90 $R/.cbuild/main/bench_gpu)
#   make ONLY_ADAMW=1 BUILD=.cbuild/sr4 NVCC_ARCH=-arch=sm_90 .cbuild/sr4/bench_gpu
#   device: LIMIT=570 bash dev/results/kernels/logs/static_20261208/run_next.sh, carry [".cbuild/main/bench_gpu", ".cbuild/sr4/bench_gpu"]
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
LIMIT=${LIMIT:-500}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
(make -j15 NVCC_ARCH=-arch=sm_90 build/test_gpu > $OUT/build.log 2>&1; echo "rc=$?" >> $OUT/build.log) &
B=$!
for v in main sr4; do
  .cbuild/$v/bench_gpu bf16 2>&1 | grep -E '^\| AdamW|copy' >> $OUT/bench_$v.txt
  t "bench $v"
done
for v in main sr4; do echo "== $v"; grep -v copy $OUT/bench_$v.txt | awk -F'|' '{printf "%-58.58s %-13s %s %s\n",$2,$3,$4,$6}'; grep copy $OUT/bench_$v.txt | awk '{printf "%s ", $3}'; echo; done
wait $B; t "build: $(tail -1 $OUT/build.log)"
for s in "4-bit states" stochastic master optimizers "flash:" "one absmax" shards gnorm quantize; do  # the changed paths first
  [ $(left) -gt 15 ] || break
  n=$(echo "$s" | tr -dc 'a-z0-9')
  TEST_ONLY="$s" timeout $(left) ./build/test_gpu > $OUT/test_$n.log 2>&1; echo "rc=$?" >> $OUT/test_$n.log
  t "test $s: $(grep -c DIFFERENT $OUT/test_$n.log) different; $(tail -2 $OUT/test_$n.log | tr "\n" " ")"
done
