#!/usr/bin/env bash
# the largest model on one H100 with 4bit-sr + release; then the 12.9e9 model's rise with -w 0 (fortunes and the corpus)
# run with CUDA_VISIBLE_DEVICES set to one GPU, after the trainer is built and the corpus unpacked (device_lean.sh's dev/data/corpus)
D=$OUT/largest; mkdir -p $D; cp "$0" $D/commands.sh
T=./build/train_gpt2_8bit_cuda
C="-i dev/data/corpus/corpus_train.bin -j dev/data/corpus/corpus_val.bin"
go() { local name=$1 lim=$2; shift 2; echo "=== $name: $*" | tee -a $D/summary.txt
       /usr/bin/time -v timeout $lim $T "$@" > $D/$name.log 2> $D/$name.time; local rc=$?
       echo "exit $rc" | tee -a $D/summary.txt; grep -E "parameters|computed|measured|VmHWM|^step +(1|2|3|50|100) |val loss" $D/$name.log | head -30 >> $D/summary.txt; return $rc; }
S=$SECONDS
go d118c4096_4bit-sr 330 -e d118c4096h32 -r 4bit-sr -R 1 -C 1 -b 1 -t 1024 $C -n 100 -l 3e-5 -u 30 -v 25 -m 8 -d 1337 ||
  go d100c4096_4bit-sr 300 -e d100c4096h32 -r 4bit-sr -R 1 -C 1 -b 1 -t 1024 $C -n 100 -l 3e-5 -u 30 -v 25 -m 8 -d 1337
F="-e d96c3328h26 -r flash -R 1 -C 1 -b 1 -t 1024 -m 8 -d 1337 -n 6 -l 1e-4 -u 2 -v 3"
[ $((SECONDS - S)) -lt 300 ] && go rise_w0_corpus 120 $F -w 0 $C
[ $((SECONDS - S)) -lt 380 ] && go rise_w0_fortunes 120 $F -w 0
echo "big done at $SECONDS s"
