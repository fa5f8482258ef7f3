#!/usr/bin/env bash
# Every study's runs as one queue over all visible GPUs: one run per GPU at a time
# (CUDA_VISIBLE_DEVICES), the most important runs first (ORDER), each writing its own log. A run
# whose log is complete is not made again, so a start cut off by a time limit goes on where it stopped
# at the next start; EXP_BUDGET (seconds) starts no run that would not end in time and stops the
# trainer at the limit. At the end: the copies (same), the plots, the results page and a short table.
# Settings: common.sh and README.md. More:
#   EXP_WORKERS    runs at once (default: the GPUs nvidia-smi lists, else 1); worker k gets GPU k
#   EXP_BUDGET     seconds from now in which every run must end (default: none)
#   EXP_STUDIES    the studies to queue (default: study1_recipes study3_seeds study2_ablations study4_scale
#                  study5_lean)
#   EXP_RESUME     a folder with logs/ from earlier starts (e.g. dev/results/studies when EXP_OUT is
#                  elsewhere): its complete logs are copied into EXP_OUT first and not rerun
#   EXP_BUILD      1 (default): make the trainer first when nvcc is there (incremental)
#   EXP_DRY        1: print the queue in its order (and the copies), when each run would start on which
#                  worker by the estimates (EXP_RUN_EST, EXP_RUN_EST_D24) and EXP_BUDGET, and stop
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
T0=$(date +%s)
: "${EXP_STUDIES:=study1_recipes study3_seeds study2_ablations study4_scale study5_lean}" "${EXP_RESUME:=}" "${EXP_BUILD:=1}"
: "${EXP_DRY:=0}"
[ "$EXP_DRY" = 0 ] || EXP_BUILD=0
if [ -z "${EXP_WORKERS:-}" ]; then
    EXP_WORKERS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    [ "$EXP_WORKERS" -ge 1 ] || EXP_WORKERS=1
fi
if [ "$EXP_BUILD" = 1 ] && [ -z "${TRAINER:-}" ] && command -v nvidia-smi > /dev/null &&
   { command -v nvcc > /dev/null || [ -x /usr/local/cuda/bin/nvcc ]; }; then
    make -j "$(nproc)" build/train_gpt2_8bit_cuda > /tmp/run_all_make.log 2>&1 ||
        { tail -n 30 /tmp/run_all_make.log; echo "run_all: make build/train_gpt2_8bit_cuda failed"; exit 1; }
    echo "run_all: trainer built ($(($(date +%s) - T0)) s)"
fi
if [ -n "${EXP_BUDGET:-}" ]; then export EXP_END_AT=$((T0 + EXP_BUDGET)); fi
# The threads of each run's CPU side (the data loader; the whole model on the CPU).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(($(nproc) / EXP_WORKERS > 0 ? $(nproc) / EXP_WORKERS : 1))}
source dev/experiments/common.sh

# The order: the first pattern (study/name, glob) that a run matches; ties keep the scripts' order.
ORDER=(study1_recipes/adamw_fp32 study1_recipes/adamw_8bit study1_recipes/adamw_flash
       study1_recipes/adamw_8bit-int8 'study3_seeds/*' study1_recipes/adamw_flash_release
       study1_recipes/adamw_flash_g0 study1_recipes/adamw_8bit_b2048 'study1_recipes/lion_*'
       'study1_recipes/sgd_*' "study2_ablations/lr${EXP_LR_HIGH%% *}_*" 'study1_recipes/*'
       'study2_ablations/*' '*')

if [ -n "$EXP_RESUME" ] && [ "$EXP_RESUME" != "$EXP_OUT" ]; then
    for f in "$EXP_RESUME"/logs/*/*.log; do
        [ -e "$f" ] || continue
        to=$EXP_OUT/logs/$(basename "$(dirname "$f")")/$(basename "$f")
        if grep -q '^speed ' "$f" && ! grep -q '^speed ' "$to" 2>/dev/null; then
            mkdir -p "$(dirname "$to")" && cp "$f" "$to"
        fi
    done
fi

QUEUE=$(mktemp) CLAIMS=$(mktemp -d)
trap 'rm -rf "$QUEUE" "$CLAIMS"' EXIT
for s in $EXP_STUDIES; do EXP_QUEUE=$QUEUE bash "dev/experiments/$s.sh" > /dev/null; done
RUNS=() SAMES=()
while read -r kind rest; do
    if [ "$kind" = run ]; then RUNS+=("$rest"); else SAMES+=("$rest"); fi
done < "$QUEUE"
ORDERED=() TAKEN=()
for pat in "${ORDER[@]}"; do
    for i in "${!RUNS[@]}"; do
        read -r study name _ <<< "${RUNS[i]}"
        # shellcheck disable=SC2053   # pat is a glob on purpose
        if [ -z "${TAKEN[i]:-}" ] && [[ $study/$name == $pat ]]; then ORDERED+=("${RUNS[i]}"); TAKEN[i]=1; fi
    done
done
echo "run_all: ${#ORDERED[@]} runs, ${#SAMES[@]} copies, $EXP_WORKERS at once, OMP_NUM_THREADS=$OMP_NUM_THREADS${EXP_END_AT:+, every run to end within ${EXP_BUDGET} s}"

if [ "$EXP_DRY" = 1 ]; then
    # The workers' plan by the estimates: each run goes to the worker free first, as the claims do,
    # unless it would end after the budget (then no worker starts it).
    free=() est=0
    for ((k = 0; k < EXP_WORKERS; k++)); do free[k]=0; done
    for i in "${!ORDERED[@]}"; do
        k=0
        for ((j = 1; j < EXP_WORKERS; j++)); do [ "${free[j]}" -ge "${free[k]}" ] || k=$j; done
        # shellcheck disable=SC2086   # the line is study, name, flags
        case $(get -e ${ORDERED[i]#* * }) in d24*) est=$EXP_RUN_EST_D24 ;; *) est=$EXP_RUN_EST ;; esac
        if [ -n "${EXP_BUDGET:-}" ] && [ $((free[k] + est)) -gt "$EXP_BUDGET" ]; then
            echo "$((i + 1)). ${ORDERED[i]}  [not started: ~$est s would pass EXP_BUDGET]"
        else
            echo "$((i + 1)). ${ORDERED[i]}  [worker $k, ~${free[k]}..$((free[k] + est)) s]"
            free[k]=$((free[k] + est))
        fi
    done
    for line in "${SAMES[@]}"; do echo "copy: $line"; done
    exit 0
fi

worker() {   # worker K: claims the next unclaimed run (mkdir is atomic) and makes it on GPU K
    local k=$1 i
    for i in "${!ORDERED[@]}"; do
        mkdir "$CLAIMS/$i" 2> /dev/null || continue
        # shellcheck disable=SC2086   # the line is study, name, flags: split into words on purpose
        CUDA_VISIBLE_DEVICES=$k run ${ORDERED[i]} | sed "s/^/[gpu $k] /"
    done
}
for ((k = 0; k < EXP_WORKERS; k++)); do worker $k & done
wait
for line in "${SAMES[@]}"; do
    # shellcheck disable=SC2086
    same $line
done
for s in $EXP_STUDIES; do EXP_PLOT_ONLY=1 bash "dev/experiments/$s.sh" > /dev/null; done
python3 dev/experiments/results.py "$EXP_OUT" --summary
echo "run_all: $(($(date +%s) - T0)) s"
