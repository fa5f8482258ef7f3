#!/usr/bin/env bash
# release_cost.sh TRAIN.bin [VAL.bin]: what gradient release and its clipping rules cost in speed and
# memory. On one GPU, one run at a time, flash AdamW d12 in each shape of SHAPES (BxTxSTEPS: the
# trainer's GPU shape, and clip_release.sh's small one, where launches weigh most), without
# evaluation: exact clipping without release (-R 0 -N exact -g 1), release
# unclipped (-R 1 -g 0), release clipped with the previous step's norm (-R 1 -N prev -g 1) and with
# this step's norm estimated layer by layer (-R 1 -N est -g 1). ROUNDS rounds, the four in turn in
# each, so that a drift of the GPU's clock touches every rule alike. Logs:
# CLIP_OUT/logs/release_cost/<rule>_b<B>t<T>_r<round>.log (a complete one is kept); clip_results.py's
# cost table (CLIP_OUT.md) takes the median of the rounds.
# Settings: TRAINER SHAPES ROUNDS GPU CLIP_OUT EXP_COMMIT, FLAGS (more trainer flags, last: they win).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
[ $# -ge 1 ] || { echo "usage: $0 TRAIN.bin [VAL.bin]" >&2; exit 2; }
train=$1; val=${2:-${1/train/val}}
: "${TRAINER:=build/train_gpt2_8bit_cuda}" "${SHAPES:=16x1024x150 8x128x600}" "${ROUNDS:=3}" "${GPU:=0}" "${CLIP_OUT:=dev/results/clipping}" "${FLAGS:=}"
COST_LOGS=$CLIP_OUT/logs/release_cost
mkdir -p "$COST_LOGS"
rules=("exact|-R 0 -N exact -g 1" "noclip_release|-R 1 -g 0" "prev_release|-R 1 -N prev -g 1" "est_release|-R 1 -N est -g 1")
for ((r = 1; r <= ROUNDS; r++)); do
  for shape in $SHAPES; do
    IFS=x read -r b t n <<< "$shape"
    common="-D gpu -e d12 -r flash -p adamw -b $b -t $t -n $n -l 6e-4 -u 20 -q 0.1 -v 0 -G 0 -s 0 -d 1337"
    for x in "${rules[@]}"; do
        IFS='|' read -r name flags <<< "$x"
        log=$COST_LOGS/${name}_b${b}t${t}_r$r.log
        if grep -q '^speed' "$log" 2>/dev/null; then continue; fi
        # shellcheck disable=SC2086   # common and flags are split into words on purpose
        { echo "# cmd $TRAINER -i $train -j $val $common $flags $FLAGS"
          echo "# date $(date -u +%FT%TZ) gpu $(nvidia-smi --query-gpu=name --format=csv,noheader -i "$GPU" 2>/dev/null | head -1)"
          echo "# commit ${EXP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
          CUDA_VISIBLE_DEVICES=$GPU "$TRAINER" -i "$train" -j "$val" $common $flags $FLAGS; } > "$log" 2>&1 || echo "failed: $log" >&2
        echo "$name ${b}x$t round $r: $(grep -h '^speed' "$log" || tail -n 1 "$log")"
    done
  done
done
python3 dev/experiments/clip_results.py "$CLIP_OUT" --print
