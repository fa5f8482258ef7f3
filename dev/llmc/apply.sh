#!/usr/bin/env bash
# dev/llmc/apply.sh LLMC_DIR — applies doc/your_trainer.md to a clean checkout of llm.c (train_gpt2.cu
# at f1e2ace, the copy the checks use): copies bnb8.h, bnb8.c, bnb8_cuda.cu to LLMC_DIR and
# adapters/llmc/bnb8_llmc.h to LLMC_DIR/llmc/, adds the guide's lines to train_gpt2.cu (each at a
# line of llm.c found exactly once, or nothing is changed) and the guide's rule to the Makefile.
# Nothing else is touched. Exit 0 when applied; 1, saying why, when LLMC_DIR is not such a checkout
# or was patched already.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DIR=${1:?usage: dev/llmc/apply.sh LLMC_DIR}
[ -f "$DIR/train_gpt2.cu" ] && [ -f "$DIR/Makefile" ] && [ -d "$DIR/llmc" ] || { echo "apply.sh: $DIR is not an llm.c checkout"; exit 1; }
if grep -q bnb8 "$DIR/train_gpt2.cu" "$DIR/Makefile"; then echo "apply.sh: $DIR already has bnb8's lines"; exit 1; fi
cp "$DIR/train_gpt2.cu" "$DIR/.train_gpt2.cu.before_bnb8"
python3 "$ROOT/dev/llmc/edit.py" "$ROOT/dev/llmc/train_gpt2.edits" "$DIR/train_gpt2.cu" || { rm -f "$DIR/.train_gpt2.cu.before_bnb8"; exit 1; }
cp "$ROOT/bnb8.h" "$ROOT/bnb8.c" "$ROOT/bnb8_cuda.cu" "$DIR/"
cp "$ROOT/adapters/llmc/bnb8_llmc.h" "$DIR/llmc/"
cat "$ROOT/dev/llmc/Makefile.rule" >> "$DIR/Makefile"
echo "apply.sh: $DIR/train_gpt2.cu: $(diff "$DIR/.train_gpt2.cu.before_bnb8" "$DIR/train_gpt2.cu" | grep -c '^>') lines added, $(diff "$DIR/.train_gpt2.cu.before_bnb8" "$DIR/train_gpt2.cu" | grep -c '^<') removed"
rm -f "$DIR/.train_gpt2.cu.before_bnb8"
