#!/usr/bin/env bash
# the 12.9e9 model's schedule: 6 steps at lr 1e-4 after 2 warm-up steps (the run whose loss rose), then 100 steps with a longer warm-up
mkdir -p build/corpus
[ -f build/corpus/corpus_train.bin ] || xz -dc .base/corpus/corpus_train.bin.xz > build/corpus/corpus_train.bin
cp .base/corpus/corpus_val.bin build/corpus/
make -j16 build/train_gpt2_8bit_cuda > /tmp/mk.log 2>&1 || { tail -20 /tmp/mk.log; exit 1; }
git log --oneline -1 2>/dev/null; nvidia-smi --query-gpu=name --format=csv,noheader
T=./build/train_gpt2_8bit_cuda
F="-e d96c3328h26 -r flash -R 1 -C 1 -b 1 -t 1024 -i build/corpus/corpus_train.bin -j build/corpus/corpus_val.bin -m 8 -d 1337"
go() { local name=$1; shift; echo "=== $name: $*"; timeout 200 $T $F "$@" > $OUT/$name.log 2>&1; echo "exit $?"; grep -E "^step|val|bytes|GB|tok" $OUT/$name.log | head -60; }
go rise -n 6 -l 1e-4 -u 2 -v 3
go warm30_lr3e-5 -n 100 -l 3e-5 -u 30 -v 25
go warm30_lr1e-4 -n 100 -l 1e-4 -u 30 -v 25
