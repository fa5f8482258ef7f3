#!/usr/bin/env bash
# Nsight Compute source counters of the DEF kernels (AdamW-only bench_gpu of ac19536 and 8ecb5ba).
S=$SECONDS; el() { echo "[c7 $((SECONDS - S)) s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
mkdir -p build
prof() {  # bench binary, row filter, out name
  cp $1 build/bench_gpu
  timeout 200 bash dev/bench/ncu_kernel.sh "bnb8_update_kernel" $OUT/$3 "$2" > /dev/null 2>&1
  el "ncu $3 rc $?"; grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Local Memory Spilling Req|Issued Warp|Executed Ipc A|Stall (Wait|Short|Long|Not Sel)" $OUT/$3/details.txt | head -14 | cut -c1-120
  rm -f $OUT/$3/bench.sass; xz -T0 $OUT/$3/source.csv
}
prof .c7/def8_bench "8-bit, bf16 + int8" ncu_def8_8bit-int8
prof .c7/def_bench "4bit-int8" ncu_def_4bit-int8
prof .c7/def_bench "AdamW flash, bf16" ncu_flash
