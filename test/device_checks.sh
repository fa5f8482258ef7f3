#!/usr/bin/env bash
# Everything a GPU session checks, in one call, most important first (a device session is short and
# may end early): the GPU trainer against the CPU trainer, the model's own test, a 7B model for 10
# steps with flash + gradient release, the kernels' parity, their speed with the peers; `recipes`
# (not in the default list) trains d12 12 steps with each recipe and keeps the loss lines, to compare
# two commits' trainers on one GPU kind (recipes.txt, without the timings); `scale` (not in the default
# list either) measures how close the flash group scales end to fp32 AdamW, against FlashOptim on the
# same GPU tensors; `nccl` (2 GPUs) trains d12 over NCCL on 2 ranks against one GPU with the same
# global batch.
#
#   bash test/device_checks.sh                 # builds with make (the GPU's own architecture), runs all
#   BIN=build/run bash test/device_checks.sh   # runs binaries built elsewhere (e.g. here with
#                                              # make BUILD=build/run NVCC_ARCH=-arch=sm_90 ..., carried)
#   CHECKS="trainer d72" bash test/device_checks.sh   # some of them
#
# Logs go to $OUT (the device tool's output folder) or build/device_checks; a table of exit codes
# and times at the end. Logs worth keeping go to dev/results/<series>/logs/device_checks/
# <gpu>x<count>_<yyyymmdd>_<commit>/ (dev/results/README.md).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/device_checks}
CHECKS=${CHECKS:-"trainer model d72 d72c kernels bench"}
mkdir -p "$OUT"
if [ -z "${BIN:-}" ]; then
    BIN=build
    make -j"$(nproc)" build/test_train_gpu build/test_gpt2_cuda build/train_gpt2_8bit_cuda build/test_gpu build/bench_gpu \
        > "$OUT/make.log" 2>&1 || { tail -n 30 "$OUT/make.log"; exit 1; }
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true

summary=""
check() {   # check NAME COMMAND...: runs it, keeps its log, prints its tail
    local name=$1 t0=$SECONDS rc
    shift
    echo "=== $name: $*"
    "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    tail -n 25 "$OUT/$name.log"
    summary+=$(printf '%-8s exit %3d  %5d s  %s' "$name" "$rc" $((SECONDS - t0)) "$OUT/$name.log")$'\n'
}
for c in $CHECKS; do
    case $c in
    trainer) check trainer "$BIN/test_train_gpu" ;;
    model)   check model "$BIN/test_gpt2_cuda" ;;
    # GPT-2 7B (d72, 7.3e9 parameters): flash + release, B=1, T=1024; the report gives the peak memory
    d72)     check d72 "$BIN/train_gpt2_8bit_cuda" -e d72 -b 1 -t 1024 -n 10 -v 0 -G 0 -u 2 -l 3e-4 -w 0 ;;
    # the same with activation recomputation (-C 1): the same losses, far fewer activations
    d72c)    check d72c "$BIN/train_gpt2_8bit_cuda" -e d72 -b 1 -t 1024 -n 10 -v 0 -G 0 -u 2 -l 3e-4 -w 0 -C 1 ;;
    kernels) check kernels "$BIN/test_gpu" ;;
    recipes) i=0
             rm -f "$OUT/recipes.txt"
             while read -r flags; do
                 i=$((i + 1))
                 check "recipe$i" "$BIN/train_gpt2_8bit_cuda" $flags -n 12 -v 6 -s 6 -G 16
                 { echo "== $flags"; grep -a -E '^step|^loss|^---- sample' -A1 "$OUT/recipe$i.log" | grep -a -v '^--$' |
                   sed -E 's/ \| +[0-9.]+ ms \| +[0-9]+ tok\/s//'; } >> "$OUT/recipes.txt"
             done <<'LIST'
-r fp32
-r 8bit
-r flash -R 0 -g 1
-r flash
-r 8bit -p lion -C 1
-r fp32 -p sgd -A 2
-r 8bit-int8 -R 1 -g 0
-r 8bit -P fp32
LIST
             ;;
    bench)   check bench "$BIN/bench_gpu"
             if python3 -c "import torch" 2>/dev/null; then
                 check peers env PYTHONPATH="$PWD/.whl/site" python3 dev/bench/peers/bench_peers.py
             fi ;;
    # the scale-accuracy run on the GPU: torch fp32 AdamW, FlashOptim and bnb8 on the same tensors
    scale)   make -j"$(nproc)" build/libbnb8_shim.so > "$OUT/make_shim.log" 2>&1 || { tail -n 30 "$OUT/make_shim.log"; exit 1; }
             check scale env PYTHONPATH="$PWD/.whl/site" PYTHONUNBUFFERED=1 python3 dev/bench/peers/scale_accuracy_peers.py ;;
    # several GPUs (not in the default list; a machine with 2 GPUs): d12 flash over NCCL, 2 ranks x
    # B=8 against one GPU x B=8 x A=2 (the same global batch, the same batches per step); the losses
    # side by side in nccl.txt (the reduction order differs: close, not equal). NCCL_RANKS=4 for 4 GPUs.
    nccl)    R=${NCCL_RANKS:-2}
             F="-R 0 -N prev -b 8 -n 30 -v 0 -G 0 -u 5"
             check nccl1 "$BIN/train_gpt2_8bit_cuda" $F -A "$R"
             rm -f /tmp/bnb8_nccl_check.id
             check nccl env NCCL_NVLS_ENABLE=0 bash -c 'pids=""; for r in $(seq 0 $(($1 - 1))); do
                 BNB8_RANKS=$1 BNB8_RANK=$r BNB8_NCCL_ID=/tmp/bnb8_nccl_check.id "$2" ${@:3} & pids="$pids $!"; done
                 rc=0; for p in $pids; do wait $p || rc=1; done; exit $rc' nccl "$R" "$BIN/train_gpt2_8bit_cuda" $F
             paste <(grep -a '^step ' "$OUT/nccl1.log" | cut -c1-40) <(grep -a '^step ' "$OUT/nccl.log" | cut -c1-40) > "$OUT/nccl.txt"
             grep -a -E 'per GPU|weights [0-9.]+ \+ gradients|device memory' "$OUT/nccl.log" >> "$OUT/nccl.txt"
             cat "$OUT/nccl.txt" ;;
    *)       echo "unknown check '$c' (trainer model d72 d72c kernels bench recipes scale nccl)"; exit 2 ;;
    esac
done
echo "=== summary"
printf '%s' "$summary"
