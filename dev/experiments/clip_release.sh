#!/usr/bin/env bash
# clip_release.sh TRAIN.bin [VAL.bin] — issue P14: global-norm clipping under gradient release.
# Four rules x SEEDS on flash AdamW (the issue's setting: d12, B=8, T=128, 1,500 steps, lr 6e-4,
# warm-up 100, cosine to 10%, StableEmbedding on): exact clipping (-N exact -g 1, no release),
# release clipped with the previous step's norm (-R 1 -N prev -g 1), release unclipped (-R 1 -g 0)
# and release clipped with this step's norm estimated layer by layer (-R 1 -N est -g 1).
# One queue of runs per GPU in GPUS; prints the table of final val losses (mean, spread over seeds,
# steps clipped). A run whose log is complete is kept. On the CPU (DEVICE=cpu, a small MODEL) the prev
# and est runs have no release (-R 0), which trains the same bits (test/test_train_gpu.c's clip test).
# Settings: TRAINER STEPS LR SEEDS GPUS DEVICE MODEL B T OUT (defaults below).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
[ $# -ge 1 ] || { echo "usage: $0 TRAIN.bin [VAL.bin]" >&2; exit 2; }
train=$1; val=${2:-${1/train/val}}
: "${TRAINER:=build/train_gpt2_8bit_cuda}" "${STEPS:=1500}" "${LR:=6e-4}" "${SEEDS:=1337 1 2}" "${GPUS:=0 1}"
: "${DEVICE:=gpu}" "${MODEL:=d12}" "${B:=8}" "${T:=128}" "${OUT:=dev/experiments/clip_release_logs}"
mkdir -p "$OUT"
rel="-R 1"; [ "$DEVICE" = gpu ] || rel="-R 0"
runs=()
for s in $SEEDS; do
    runs+=("exact|-R 0 -N exact -g 1 -d $s|$s" "prev_release|$rel -N prev -g 1 -d $s|$s" "noclip_release|$rel -N prev -g 0 -d $s|$s"
           "est_release|$rel -N est -g 1 -d $s|$s")
done
common="-D $DEVICE -e $MODEL -r flash -p adamw -b $B -t $T -n $STEPS -l $LR -u 100 -q 0.1 -v 250 -m 20 -G 0 -s 0"
run_one() {   # name flags seed gpu
    local log="$OUT/${1}_${MODEL}_lr${LR}_s$3.log"
    if grep -q '^speed' "$log" 2>/dev/null; then return 0; fi
    { echo "# cmd $TRAINER -i $train -j $val $common $2"; echo "# date $(date -u +%FT%TZ) gpu $(nvidia-smi --query-gpu=name --format=csv,noheader -i "$4" 2>/dev/null | head -1)"; echo "# commit ${EXP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}";
      CUDA_VISIBLE_DEVICES=$4 "$TRAINER" -i "$train" -j "$val" $common $2; } > "$log" 2>&1 || echo "failed: $log" >&2
}
gpus=($GPUS)
for g in "${!gpus[@]}"; do
    ( k=0; for r in "${runs[@]}"; do
          IFS='|' read -r name flags seed <<< "$r"
          if (( k % ${#gpus[@]} == g )); then run_one "$name" "$flags" "$seed" "${gpus[$g]}"; fi
          k=$((k + 1))
      done ) &
done
wait
python3 - "$OUT" "$MODEL" "$LR" <<'PY'
import glob, os, re, statistics, sys
out, model, lr = sys.argv[1:4]
rows = {}
for path in sorted(glob.glob(os.path.join(out, f"*_{model}_lr{lr}_s*.log"))):
    name, seed = re.match(rf"(.*)_{re.escape(model)}_lr.*_s(\d+)\.log", os.path.basename(path)).groups()
    text = open(path).read()
    vals = re.findall(r"\| val loss ([0-9.]+)", text)
    clip = re.search(r"clip +at \S+ with .*: (\d+) of (\d+) steps clipped", text)
    if vals: rows.setdefault(name, []).append((int(seed), float(vals[-1]), clip.group(1) if clip else "-"))
print(f"| run ({model}, lr {lr}) | final val loss per seed | mean | spread (max-min) | steps clipped |")
print("|---|---|---|---|---|")
for name in ("exact", "prev_release", "noclip_release", "est_release"):
    r = sorted(rows.get(name, []))
    if not r: continue
    v = [x[1] for x in r]
    print(f"| {name} | " + " / ".join(f"{x:.4f} (s{s})" for s, x, _ in r) +
          f" | {statistics.mean(v):.4f} | {max(v) - min(v):.4f} | " + " / ".join(c for _, _, c in r) + " |")
PY
