#!/usr/bin/env bash
# Profiles one launch of a bnb8 kernel with Nsight Compute: speed of light, occupancy, the executed
# instruction mix by opcode and per-SASS-instruction counts (CSV), into the folder $2.
#   [BENCH=build/x/bench_gpu] dev/bench/ncu_kernel.sh KERNEL_REGEX OUT_DIR [BENCH_FILTER]
set -u
kernel=$1; out=$2; filter=${3:-}; bench=${BENCH:-./build/bench_gpu}
mkdir -p "$out"
ncu --clock-control none --kernel-name "regex:$kernel" --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section InstructionStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis \
    --metrics sass__inst_executed_per_opcode,smsp__inst_executed.sum,smsp__thread_inst_executed.sum \
    --print-details all --print-metric-instances values "$bench" ${filter:+"$filter"} > "$out/details.txt" 2>&1
ncu --clock-control none --kernel-name "regex:$kernel" --launch-skip 3 --launch-count 1 \
    --section SourceCounters --page source --print-source sass --csv "$bench" ${filter:+"$filter"} > "$out/source.csv" 2>&1
cuobjdump --dump-sass "$bench" > "$out/bench.sass" 2>&1
tail -5 "$out/details.txt"
