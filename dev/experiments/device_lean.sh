#!/usr/bin/env bash
# device_lean.sh: study 5 (study5_lean.sh) in one command on the GPU machine (the device tool): the
# corpus from its carried copy, the trainer built once, the runs spread over every GPU by
# run_all.sh (one per GPU at a time, in the study's order), and the logs packed into one tarball
# under $OUT with their place in the tree (dev/results/studies/logs/study5_lean/): `tar xzf` it in
# the checkout's root. Complete logs already in the tree are kept, so a second call makes only the
# runs the first left; the trainer it built comes back too, for the next call to carry (build/). Every run ends within EXP_BUDGET_S seconds of this script's start, build
# included (the device tool stops a command at 600 s).
#   EXP_COMMIT       the commit the logs name (the tree there has no .git): `git rev-parse --short HEAD`
#   EXP_BUDGET_S     seconds (default 570)
#   EXP_CORPUS_FROM  the carried corpus: corpus_train.bin.xz and corpus_val.bin (default .base/corpus)
#   EXP_RUN_EST, EXP_RUN_EST_D24   seconds a d12 and a d24 run take (default: from the GPU's name)
# and the settings of common.sh and study5_lean.sh (the ablations' flags), passed on.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
: "${EXP_BUDGET_S:=570}" "${EXP_CORPUS_FROM:=.base/corpus}"
DEST=${OUT:-build/device_out}
mkdir -p "$DEST"
say() { echo "[device_lean $SECONDS s] $*"; }
if [ -z "${EXP_COMMIT:-}" ]; then say "WARNING: no EXP_COMMIT, the logs will say commit unknown"; fi
EXP_COMMIT=${EXP_COMMIT:-unknown}

# The corpus, checked against dev/data/README.md's sha256 (a wrong file would spoil every run).
corpus=dev/data/corpus
declare -A SHA=([corpus_train.bin]=3d7443966f9e1ae6b679108837914c60b6554b90c1fe96b68e58d7604c64c017
                [corpus_val.bin]=fd6a1a3890108bb7b4e07eddcc07e36c159c1e47c574841ddd598ebc154012d3)
mkdir -p "$corpus"
for f in corpus_train.bin corpus_val.bin; do
    if ! echo "${SHA[$f]}  $corpus/$f" | sha256sum -c --status 2> /dev/null; then
        if [ -f "$EXP_CORPUS_FROM/$f.xz" ]; then xz -T0 -dc "$EXP_CORPUS_FROM/$f.xz" > "$corpus/$f"
        else cp "$EXP_CORPUS_FROM/$f" "$corpus/$f"; fi
        echo "${SHA[$f]}  $corpus/$f" | sha256sum -c --status ||
            { say "$corpus/$f from $EXP_CORPUS_FROM: not the study corpus (sha256)"; exit 1; }
    fi
done
say "corpus ready"

nvidia-smi -L
gpus=$(nvidia-smi -L | grep -c '^GPU' || true)
# A d12 run's wall time (1,500 steps, start and evaluations) was ~79 s on an H100 (~82 s with
# release) and ~71 s on an H200; a d24 run ~181 s on an H200, so ~200 s on an H100 (d12's ratio).
# The estimates add a few seconds: a run that would not end in time is not started.
case $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1) in
    *H200*) : "${EXP_RUN_EST:=76}" "${EXP_RUN_EST_D24:=192}" ;;
    *) : "${EXP_RUN_EST:=85}" "${EXP_RUN_EST_D24:=215}" ;;
esac

# The trainer: a carried one built there from this commit (the .commit file beside it says which) saves
# the build's minutes; else built, and sent back with its .commit file for the next call to carry.
bin=build/train_gpt2_8bit_cuda
if [ "$EXP_COMMIT" != unknown ] && [ -x $bin ] && [ "$(cat $bin.commit 2> /dev/null)" = "$EXP_COMMIT" ]; then
    say "trainer of $EXP_COMMIT carried, not built"
else
    rm -f $bin.commit
    make -j "$(nproc)" $bin > "$DEST/make.txt" 2>&1 ||
        { tail -n 30 "$DEST/make.txt"; say "make $bin failed"; exit 1; }
    echo "$EXP_COMMIT" > $bin.commit
    say "trainer built"
    if [ "$(stat -c %s $bin)" -le $((16 << 20)) ]; then cp $bin $bin.commit "$DEST/"; fi
fi

export TRAINER=build/train_gpt2_8bit_cuda EXP_DEVICE=gpu EXP_BUILD=0 EXP_STUDIES=study5_lean
export EXP_WORKERS=${EXP_WORKERS:-$gpus} EXP_RUN_EST EXP_RUN_EST_D24 EXP_COMMIT
export EXP_BUDGET=$((EXP_BUDGET_S - SECONDS))
# run_all.sh stops every trainer by EXP_BUDGET; its own limit here only makes sure the tarball is written.
timeout $((EXP_BUDGET + 20)) bash dev/experiments/run_all.sh 2>&1 | tee "$DEST/run_all.txt"
mkdir -p dev/results/studies/logs/study5_lean
tar czf "$DEST/logs.tgz" dev/results/studies/logs/study5_lean
say "$(tar tzf "$DEST/logs.tgz" | grep -c '\.log$') logs in $DEST/logs.tgz"
