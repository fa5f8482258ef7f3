#!/usr/bin/env bash
# clip_release.sh TRAIN.bin [VAL.bin]: how well each rule for the global gradient norm clips under
# gradient release. Four rules x SEEDS on flash AdamW (d12, B=8, T=128, 1,500 steps, lr 6e-4, warm-up
# 100, cosine to 10%, StableEmbedding on): exact clipping (-N exact -g 1, no release), release clipped
# with the previous step's norm (-R 1 -N prev -g 1), release unclipped (-R 1 -g 0) and release clipped
# with this step's norm estimated layer by layer (-R 1 -N est -g 1).
# One queue of runs shared by the workers in GPUS (a GPU index per worker: "0 0 0" runs three at a time on
# GPU 0; these runs are small, B=8 x T=128, and leave one GPU mostly idle), each taking the next run nobody
# took. A run whose log is complete is kept, so a start cut off goes on where it stopped. BUDGET=S: every
# run ends within S seconds of the start (a run that would not, RUN_EST seconds, is not started; the
# trainer is stopped at the limit and its incomplete log is made again next time). Logs:
# CLIP_OUT/logs/clip_release/<rule>_<model>_lr<lr>_s<seed>.log. At the end clip_results.py prints the
# tables and writes CLIP_OUT.md and the plots (gnuplot) from every log.
# On the CPU (DEVICE=cpu, a small MODEL) the prev and est runs have no release (-R 0), which trains the
# same bits (test/test_train_gpu.c's clip test).
# Settings: TRAINER STEPS LR SEEDS GPUS DEVICE MODEL B T CLIP_OUT BUDGET RUN_EST EXP_COMMIT (defaults below).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
[ $# -ge 1 ] || { echo "usage: $0 TRAIN.bin [VAL.bin]" >&2; exit 2; }
train=$1; val=${2:-${1/train/val}}
: "${TRAINER:=build/train_gpt2_8bit_cuda}" "${STEPS:=1500}" "${LR:=6e-4}" "${SEEDS:=1337 1 2}" "${GPUS:=0 1}"
: "${DEVICE:=gpu}" "${MODEL:=d12}" "${B:=8}" "${T:=128}" "${CLIP_OUT:=dev/results/clipping}" "${BUDGET:=}"
# seconds a run takes with 3-4 at a time on one H100 (d12 at B=8, T=128: 18 s exact, 35-46 s with release)
case $MODEL in d12) : "${RUN_EST:=50}" ;; *) : "${RUN_EST:=150}" ;; esac
T0=$(date +%s)
CLIP_LOGS=$CLIP_OUT/logs/clip_release
mkdir -p "$CLIP_LOGS"
rel="-R 1"; [ "$DEVICE" = gpu ] || rel="-R 0"
runs=()
for s in $SEEDS; do
    runs+=("exact|-R 0 -N exact -g 1 -d $s|$s" "prev_release|$rel -N prev -g 1 -d $s|$s" "noclip_release|$rel -N prev -g 0 -d $s|$s"
           "est_release|$rel -N est -g 1 -d $s|$s")
done
common="-D $DEVICE -e $MODEL -r flash -p adamw -b $B -t $T -n $STEPS -l $LR -u 100 -q 0.1 -v 250 -m 20 -G 0 -s 0"
run_one() {   # name flags seed gpu
    local log="$CLIP_LOGS/${1}_${MODEL}_lr${LR}_s$3.log" limit=()
    if grep -q '^speed' "$log" 2>/dev/null; then return 0; fi
    if [ -n "$BUDGET" ]; then
        local left=$((T0 + BUDGET - $(date +%s)))
        if [ "$left" -lt "$RUN_EST" ]; then echo "not started (${left} s left of BUDGET): $log" >&2; return 0; fi
        limit=(timeout "$left")
    fi
    { echo "# cmd $TRAINER -i $train -j $val $common $2"; echo "# date $(date -u +%FT%TZ) gpu $(nvidia-smi --query-gpu=name --format=csv,noheader -i "$4" 2>/dev/null | head -1)"; echo "# commit ${EXP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}";
      CUDA_VISIBLE_DEVICES=$4 "${limit[@]}" "$TRAINER" -i "$train" -j "$val" $common $2; } > "$log" 2>&1 || echo "failed or stopped: $log" >&2
    echo "$(basename "$log" .log): $(grep -h '^loss' "$log" || tail -n 1 "$log")"
}
claims=$(mktemp -d)
trap 'rm -rf "$claims"' EXIT
gpus=($GPUS)
for g in "${!gpus[@]}"; do
    ( for k in "${!runs[@]}"; do   # the next run nobody took (mkdir is atomic)
          mkdir "$claims/$k" 2> /dev/null || continue
          IFS='|' read -r name flags seed <<< "${runs[k]}"
          run_one "$name" "$flags" "$seed" "${gpus[$g]}"
      done ) &
done
wait
python3 dev/experiments/clip_results.py "$CLIP_OUT" --print
