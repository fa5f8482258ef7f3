#!/usr/bin/env bash
# dev/llmc/check.sh — on one GPU: llm.c (an unmodified checkout, $LLMC, default ../shared/llmc) patched
# by dev/llmc/apply.sh and built with llm.c's own `make train_gpt2cu` plus the guide's rule, then
# llm.c's AdamW against bnb8's recipes on GPT-2 d12 (B=16, T=1024) over the study corpus (`make
# corpus`, dev/data/corpus/), STEPS steps (default 1000) each:
#   - llm.c's AdamW with 3 initialization seeds (the check's own edit of its copy: llm.c fixes the
#     seed at 42; LLMC_SEED picks another), bnb8's 8bit-int8, flash and 8bit-fp32 with seed 42;
#   - per run: the final val loss, tokens/s (median of the steps after the first 10), the optimizer +
#     master memory (llm.c's m, v and master as it allocates them; bnb8's bnb8_optimizer_memory line),
#     the GPU memory in use after the allocations;
#   - a resume per bnb8 recipe and for llm.c's AdamW: 40 steps writing checkpoints at 20 and 40, then
#     the checkpoint of step 20 alone resumed to 40 in another directory: the model and state files of
#     step 40 equal byte for byte.
# Prints a table; logs go to $OUT (the device tool's folder) or build/llmc_check.
#   bash dev/llmc/check.sh                 # everything (~15 minutes on an H100)
#   STEPS=200 CHECKS=resume RECIPES=flash bash dev/llmc/check.sh
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
LLMC=${LLMC:-$ROOT/../shared/llmc}
OUT=${OUT:-$ROOT/build/llmc_check}
STEPS=${STEPS:-1000}
CHECKS=${CHECKS:-"train resume"}
SEEDS=${SEEDS:-"42 1 2"}                       # llm.c's AdamW
RECIPES=${RECIPES:-"8bit-int8 flash 8bit-fp32"}   # bnb8's
on() { case " $CHECKS " in *" $1 "*) return 0 ;; esac; return 1; }
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
CORPUS=${CORPUS:-$ROOT/dev/data/corpus}
TRAIN_BIN=$(ls "$CORPUS"/*train*.bin 2> /dev/null | head -n 1)
VAL_BIN=$(ls "$CORPUS"/*val*.bin 2> /dev/null | head -n 1)
[ -n "$TRAIN_BIN" ] && [ -n "$VAL_BIN" ] || { echo "check.sh: no corpus in dev/data/corpus (make corpus, then carry it)"; exit 1; }
W=$OUT/llmc
T0=$SECONDS
if [ -n "${REUSE:-}" ] && [ -x "$W/train_gpt2cu" ]; then   # a build of an earlier call on a warm machine
    echo "reusing $W/train_gpt2cu"
else
    rm -rf "$W" && cp -r "$LLMC" "$W" || exit 1
    bash "$ROOT/dev/llmc/apply.sh" "$W" || exit 1
    # the check's own edit, not the guide's: llm.c's initialization seed from LLMC_SEED
    sed -i 's/manual_seed(&init_rng, 42);/manual_seed(\&init_rng, getenv("LLMC_SEED") ? atoi(getenv("LLMC_SEED")) : 42);/' "$W/train_gpt2.cu"
    # and llm.c's own line that CUDA 13 no longer compiles (cudaMemAdvise takes a cudaMemLocation there)
    perl -0pi -e 's/^(\s*)(cudaCheck_\(cudaMemAdvise\(\*out, bytes, cudaMemAdviseSetPreferredLocation, )cudaCpuDeviceId(\), file, line\);)\n/#if CUDART_VERSION >= 13000\n$1$2cudaMemLocation{cudaMemLocationTypeHost, 0}$3\n#else\n$1$2cudaCpuDeviceId$3\n#endif\n/m' "$W/llmc/cuda_utils.cuh"
    (cd "$W" && make -j3 train_gpt2cu NO_MULTI_GPU=1 USE_CUDNN=0 > "$OUT/build.log" 2>&1) || { tail -n 30 "$OUT/build.log"; exit 1; }
fi
changed=$(diff -U0 "$LLMC/train_gpt2.cu" "$W/train_gpt2.cu" | grep -c '^[-+][^-+]')   # the guide's lines and the seed's
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 1
echo "patched llm.c built in $((SECONDS - T0)) s; train_gpt2.cu: $changed lines changed (apply.sh's and the seed's one)"
table=""
row() { table+=$(printf '%-22s %s' "$1" "$2")$'\n'; echo "--> $1: $2"; }
F="-i $TRAIN_BIN -j $VAL_BIN -e d12 -b 16 -t 1024 -l 6e-4 -u 100 -q 0.1 -c 0.1 -s 0 -h 0 -m 20"

# run NAME RECIPE SEED FLAGS...: llm.c in $W, its output in $OUT/NAME.log
run() {
    local name=$1 recipe=$2 seed=$3
    shift 3
    (cd "$W" && BNB8_RECIPE=$recipe LLMC_SEED=$seed ./train_gpt2cu $F "$@" > "$OUT/$name.log" 2>&1)
}
val_loss() { awk '$1 == "val" && $2 == "loss" { v = $3 } END { print v }' "$1"; }
tokens() { awk -F'|' '$1 ~ /^step/ { split($1, a, "[ /]+"); if (a[2] > 10) { n = split($NF, b, " "); print b[1] } }' "$1" | sort -n | awk '{ v[NR] = $1 } END { print NR ? v[int((NR + 1) / 2)] : "?" }'; }
memory() {   # optimizer + master MiB: bnb8's line, or llm.c's three allocations
    local b
    b=$(grep -a -o 'optimizer states [0-9]* MiB + master [0-9]* MiB' "$1" | awk '{ print $3 + $7 }')
    [ -n "$b" ] && { echo "$b"; return; }
    grep -a -E 'allocating [0-9]+ MiB for (AdamW optimizer state|master copy)' "$1" | awk '{ s += $2 } END { print s }'
}
in_use() { grep -a -o 'device memory usage: [0-9]* MiB' "$1" | head -n 1 | awk '{ print $4 }'; }

if on train; then
    jobs=""
    for seed in $SEEDS; do jobs+="adamw_s$seed:adamw:$seed "; done
    for recipe in $RECIPES; do jobs+="$recipe:$recipe:42 "; done
    for job in $jobs; do
        set -- ${job//:/ }
        t=$SECONDS
        run "$1" "$2" "$3" -x "$STEPS" -v "$STEPS"
        row "$1" "val $(val_loss "$OUT/$1.log") | $(tokens "$OUT/$1.log") tok/s | optimizer+master $(memory "$OUT/$1.log") MiB | GPU in use $(in_use "$OUT/$1.log") MiB ($((SECONDS - t)) s)"
    done
fi
if on resume; then
    for recipe in adamw $RECIPES; do
        t=$SECONDS
        rm -rf "$OUT/ck_$recipe" "$OUT/re_$recipe"
        run "ck_$recipe" "$recipe" 42 -x 40 -n 20 -v 100 -o "$OUT/ck_$recipe"
        mkdir -p "$OUT/re_$recipe"
        cp "$OUT/ck_$recipe"/*00000020* "$OUT/re_$recipe/"
        run "re_$recipe" "$recipe" 42 -x 40 -n 20 -v 100 -o "$OUT/re_$recipe" -y 1
        same=yes
        for f in model_00000040.bin state_00000040_00000.bin; do cmp -s "$OUT/ck_$recipe/$f" "$OUT/re_$recipe/$f" || same=NO; done
        row "resume $recipe" "step 20 resumed to 40 = 40 straight, model and state files: $same ($((SECONDS - t)) s)"
        rm -rf "$OUT/ck_$recipe" "$OUT/re_$recipe"
    done
fi
echo
echo "llm.c + bnb8 (dev/llmc/check.sh), $STEPS steps, $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1), commit $(cd "$ROOT" && git rev-parse --short HEAD 2> /dev/null)"
printf '%s' "$table"
