# shellcheck shell=bash
# Sourced by the study scripts: the settings (environment variables; the defaults are meant for one
# GPU) and the functions run and plot. See README.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

: "${EXP_MODEL:=d12}" "${EXP_B:=16}" "${EXP_T:=1024}" "${EXP_STEPS:=1500}" "${EXP_EVAL:=250}" "${EXP_VAL_BATCHES:=20}"
: "${EXP_DEVICE:=auto}"                        # auto | cpu | gpu (the trainer's -D)
: "${EXP_WARMUP:=150}" "${EXP_FINAL_LR:=0.1}"  # -u, -q
# The data (-i, -j): the study corpus that `make corpus` builds (dev/data/README.md).
: "${EXP_TRAIN:=dev/data/corpus/corpus_train.bin}" "${EXP_VAL:=dev/data/corpus/corpus_val.bin}"
: "${EXP_CLIP:=1}"                             # -g for every run except those that set it
: "${EXP_RELEASE_CLIP:=1}"                     # -g of the gradient-release runs (clipped by the trainer's rule under release, -N)
: "${EXP_TWINS:=flash}"                        # recipes whose release run gets a -g 0 twin without release
                                               # (only while EXP_RELEASE_CLIP is 0)
: "${EXP_RUN_EST:=110}"                        # seconds a d12 run takes (EXP_END_AT: whether it still fits)
: "${EXP_RUN_EST_D24:=$((EXP_RUN_EST * 3))}"   # seconds a d24 run takes
: "${EXP_END_AT:=}"                            # epoch seconds: start no run that would end later, and
                                               # stop the trainer there (run_all.sh sets it)
: "${EXP_QUEUE:=}"                             # a file: run and same only add their line to it (run_all.sh)
# Peak learning rates and weight decay per optimizer: the trainer's GPU defaults (lr = CPU default / 5),
# given explicitly so that the CPU and the GPU train with the same schedule.
: "${EXP_LR_ADAMW:=6e-4}" "${EXP_LR_LION:=6e-5}" "${EXP_LR_SGD:=0.06}"
: "${EXP_WD_ADAMW:=0.1}" "${EXP_WD_LION:=1}" "${EXP_WD_SGD:=0}"
: "${EXP_LR_HIGH:=3e-3}"                       # study 2: the higher AdamW learning rate(s), a list
: "${EXP_SEEDS:=1337 1 2}"                     # study 3
: "${EXP_FLAGS:=}"                             # extra trainer flags for every run (last, so they win)
: "${EXP_OUT:=dev/results/studies}"            # logs/ and plots/ go here, the page beside it ($EXP_OUT.md)
: "${EXP_ONLY:=}"                              # run only these run names (space-separated)
: "${EXP_FORCE:=0}"                            # 1: rerun runs whose log is already complete
: "${EXP_PLOT_ONLY:=0}"                        # 1: no training, only the plots from the logs there
: "${EXP_SHARD:=}"                             # K/N: make only runs K, K+N, K+2N, ... (0-based) of the study,
                                               # so that N processes share one GPU (tokens/s then is not a speed)
RUN_INDEX=0
if [ -z "${TRAINER:-}" ]; then
    TRAINER=build/train_gpt2_8bit
    if [ -x build/train_gpt2_8bit_cuda ]; then TRAINER=build/train_gpt2_8bit_cuda; fi
fi
# No .git on a machine that got a copy of the tree: EXP_COMMIT says which commit it is.
if [ -z "${EXP_COMMIT:-}" ]; then
    EXP_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
    # new records and changed study scripts do not change what the trainer computes
    if [ -n "$(git status --porcelain -- . ':!dev/results' ':!dev/experiments' 2>/dev/null)" ]; then EXP_COMMIT+="+dirty"; fi
fi
# What decides a run's numbers: a complete log made with other settings is kept, with a warning.
SETTINGS="TRAINER=$TRAINER EXP_MODEL=$EXP_MODEL EXP_B=$EXP_B EXP_T=$EXP_T EXP_STEPS=$EXP_STEPS EXP_EVAL=$EXP_EVAL"
SETTINGS+=" EXP_TRAIN=$EXP_TRAIN EXP_VAL=$EXP_VAL EXP_RELEASE_CLIP=$EXP_RELEASE_CLIP"
SETTINGS+=" EXP_VAL_BATCHES=$EXP_VAL_BATCHES EXP_DEVICE=$EXP_DEVICE EXP_WARMUP=$EXP_WARMUP EXP_FINAL_LR=$EXP_FINAL_LR"
SETTINGS+=" EXP_CLIP=$EXP_CLIP EXP_LR_ADAMW=$EXP_LR_ADAMW EXP_LR_LION=$EXP_LR_LION EXP_LR_SGD=$EXP_LR_SGD"
SETTINGS+=" EXP_WD_ADAMW=$EXP_WD_ADAMW EXP_WD_LION=$EXP_WD_LION EXP_WD_SGD=$EXP_WD_SGD"
SETTINGS+=" EXP_LR_HIGH='$EXP_LR_HIGH' EXP_SEEDS='$EXP_SEEDS' EXP_FLAGS='$EXP_FLAGS'"

get() {   # get FLAG ARGS...: the value of FLAG in the flag-value pairs ARGS (the last one, as the trainer)
    local f=$1 v=
    shift
    while [ $# -ge 2 ]; do [ "$1" = "$f" ] && v=$2; shift 2; done
    echo "$v"
}

skip() {   # skip LOG WHY: a log that says why the run was not made (it is made when the study runs again)
    echo "# skipped: $2" > "$1"
    echo "$(basename "$(dirname "$1")")/$(basename "$1" .log): skipped: $2"
}

# run STUDY NAME FLAGS...: one training run, its output in $EXP_OUT/logs/STUDY/NAME.log. Every
# schedule flag is given: the GPU's defaults differ from the CPU's (lr / 5, no clipping, release for
# flash, B, T, steps), and a run must not change its schedule with the device it lands on.
run() {
    local study=$1 name=$2
    shift 2
    local log=$EXP_OUT/logs/$study/$name.log
    if [ "$EXP_PLOT_ONLY" = 1 ]; then return 0; fi
    if [ -n "$EXP_QUEUE" ]; then echo "run $study $name $*" >> "$EXP_QUEUE"; return 0; fi
    RUN_INDEX=$((RUN_INDEX + 1))
    if [ -n "$EXP_SHARD" ] && [ $(((RUN_INDEX - 1) % ${EXP_SHARD#*/})) != "${EXP_SHARD%/*}" ]; then return 0; fi
    [ -z "$EXP_ONLY" ] || [[ " $EXP_ONLY " == *" $name "* ]] || return 0
    if [ "$EXP_FORCE" != 1 ] && grep -q '^speed ' "$log" 2>/dev/null; then
        grep -qxF "# settings $SETTINGS" "$log" || echo "$study/$name: WARNING: kept log was made with other settings"
        echo "$study/$name: complete log kept (EXP_FORCE=1 reruns it)"
        return 0
    fi
    [ -x "$TRAINER" ] || { echo "no trainer $TRAINER: make build/train_gpt2_8bit_cuda (or build/train_gpt2_8bit)"; exit 1; }
    mkdir -p "$(dirname "$log")"
    local p lrv wdv i f
    p=$(get -p "$@")
    p=${p:-adamw}
    lrv=EXP_LR_${p^^} wdv=EXP_WD_${p^^}
    if [ ! -f "$EXP_TRAIN" ] || [ ! -f "$EXP_VAL" ]; then echo "no data $EXP_TRAIN / $EXP_VAL: make corpus"; exit 1; fi
    local cmd=("$TRAINER" -D "$EXP_DEVICE" -i "$EXP_TRAIN" -j "$EXP_VAL" -b "$EXP_B" -t "$EXP_T" -n "$EXP_STEPS"
               -u "$EXP_WARMUP" -q "$EXP_FINAL_LR" -v "$EXP_EVAL" -m "$EXP_VAL_BATCHES" -G 0)
    local defaults=(-e "$EXP_MODEL" -p "$p" -l "${!lrv}" -c "${!wdv}" -g "$EXP_CLIP" -R 0 -w 1 -d 1337)
    for ((i = 0; i < ${#defaults[@]}; i += 2)); do
        [ -n "$(get "${defaults[i]}" "$@")" ] || cmd+=("${defaults[i]}" "${defaults[i + 1]}")
    done
    # shellcheck disable=SC2206   # EXP_FLAGS is split into words on purpose
    cmd+=("$@" $EXP_FLAGS)

    # A flag this binary does not know skips the run instead of failing it (an older trainer, or
    # a study written ahead of the trainer).
    local usage missing=()
    usage=$("$TRAINER" -h 2>&1 || true)
    for f in "${cmd[@]:1}"; do
        if [[ $f == -? ]] && ! grep -q -- "^  $f <" <<< "$usage"; then missing+=("$f"); fi
    done
    if [ ${#missing[@]} -gt 0 ]; then skip "$log" "this trainer does not accept ${missing[*]} ($TRAINER -h)"; return 0; fi
    # A recipe it does not know, likewise: the trainer prints its help only if every flag before -h parses.
    f=$(get -r "${cmd[@]:1}")
    if [ -n "$f" ] && ! "$TRAINER" -r "$f" -h > /dev/null 2>&1; then
        skip "$log" "this trainer has no recipe $f ($TRAINER -h)"; return 0
    fi
    if [ "$(get -R "${cmd[@]:1}")" = 1 ] && [ "$EXP_DEVICE" = cpu ]; then
        skip "$log" "gradient release (-R 1) is GPU-only; the trainer refuses it on the CPU"; return 0
    fi

    # EXP_END_AT: a run that would not finish in time is left for the next start (its old log stays).
    local est=$EXP_RUN_EST limit=()
    case $(get -e "${cmd[@]:1}") in d24*) est=$EXP_RUN_EST_D24 ;; esac
    if [ -n "$EXP_END_AT" ]; then
        if [ $(($(date +%s) + est)) -gt "$EXP_END_AT" ]; then
            echo "$study/$name: not started, ~${est} s would pass EXP_END_AT (the next start makes it)"; return 0
        fi
        limit=(timeout $((EXP_END_AT - $(date +%s))))
    fi
    local gpu=
    if [ "$EXP_DEVICE" != cpu ] && command -v nvidia-smi > /dev/null; then
        gpu=$(nvidia-smi --query-gpu=index,name --format=csv,noheader ${CUDA_VISIBLE_DEVICES:+-i "${CUDA_VISIBLE_DEVICES%%,*}"} 2>/dev/null | head -n 1)
    fi
    {
        echo "# run $study/$name"
        echo "# commit $EXP_COMMIT"
        echo "# date $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
        echo "# host $(hostname) ${gpu:+gpu $gpu, }CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset}"
        echo "# settings $SETTINGS"
        echo "# cmd ${OMP_NUM_THREADS:+OMP_NUM_THREADS=$OMP_NUM_THREADS }${cmd[*]}"
        if [ -n "$EXP_SHARD" ]; then echo "# shared the device with other runs at the same time (EXP_SHARD=$EXP_SHARD)"; fi
    } > "$log"
    local t0=$SECONDS rc=0
    "${limit[@]}" "${cmd[@]}" >> "$log" 2>&1 || rc=$?
    if [ $rc = 0 ]; then
        echo "$study/$name: $(grep '^loss ' "$log" | tail -n 1) ($((SECONDS - t0)) s)"
    elif [ $rc = 124 ] && [ -n "$EXP_END_AT" ]; then
        echo "$study/$name: stopped at EXP_END_AT after $((SECONDS - t0)) s, incomplete (the next start reruns it)"
    elif grep -q 'runs on the GPU only' "$log"; then   # -D auto without a GPU
        skip "$log" "gradient release (-R 1) is GPU-only and no GPU was used"
    else
        echo "$study/$name: FAILED (exit $rc) after $((SECONDS - t0)) s, see $log: $(tail -n 1 "$log")"
    fi
}

# same STUDY NAME FROM_STUDY FROM_NAME: this run is exactly that one (the same trainer command, e.g.
# study 3's seed 1337 is study 1's fp32 AdamW): its complete log is copied instead of training twice.
same() {
    local log=$EXP_OUT/logs/$1/$2.log from=$EXP_OUT/logs/$3/$4.log
    if [ "$EXP_PLOT_ONLY" = 1 ]; then return 0; fi
    if [ -n "$EXP_QUEUE" ]; then echo "same $*" >> "$EXP_QUEUE"; return 0; fi
    [ -z "$EXP_ONLY" ] || [[ " $EXP_ONLY " == *" $2 "* ]] || return 0
    if ! grep -q '^speed ' "$from" 2>/dev/null; then echo "$1/$2: the same run as $3/$4, which has no complete log yet"; return 0; fi
    mkdir -p "$(dirname "$log")"
    { echo "# copy of $3/$4: the same trainer command"; sed "s|^# run $3/$4\$|# run $1/$2|" "$from"; } > "$log"
    echo "$1/$2: copied from $3/$4"
}

# plot STUDY NAME TITLE RUN...: train and val loss of these runs in $EXP_OUT/plots/STUDY_NAME.png; a
# RUN of another study is named OTHER_STUDY/RUN (a reference made there). Nothing while the runs are
# only listed (EXP_QUEUE).
plot() {
    local study=$1 name=$2 title=$3 r logs=()
    shift 3
    [ -z "$EXP_QUEUE" ] || return 0
    command -v gnuplot > /dev/null || { echo "plot $study/$name: no gnuplot (apt-get install -y gnuplot-nox)"; return 0; }
    local own=0
    for r in "$@"; do
        if [[ $r == */* ]]; then logs+=("$EXP_OUT/logs/$r.log"); else logs+=("$EXP_OUT/logs/$study/$r.log"); fi
        [[ $r == */* ]] || [ ! -f "${logs[-1]}" ] || own=1
    done
    [ $own = 1 ] || { echo "plot $study/$name: none of its own runs has a log yet"; return 0; }
    mkdir -p "$EXP_OUT/plots"
    python3 dev/experiments/plot.py "$EXP_OUT/plots/${study}_$name.png" "$title" "${logs[@]}" ||
        echo "plot $study/$name failed"
}
