#!/usr/bin/env bash
# Call 1 on one H100: the largest model (carried trainer of 225498b) on the GPU while the head's and
# the p16 branch's test_gpu / bench_gpu build on the CPU; then the p16 rows of bench_gpu.
S=$SECONDS; el() { echo "[h1a $((SECONDS - S)) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g | head -2
mkdir -p dev/data/corpus build $OUT/r
xz -T0 -dc .base/corpus/corpus_train.bin.xz > dev/data/corpus/corpus_train.bin; cp .base/corpus/corpus_val.bin dev/data/corpus/
xz -T0 -dc .carry/train.xz > build/train_gpt2_8bit_cuda; chmod +x build/train_gpt2_8bit_cuda; echo 225498b > build/train_gpt2_8bit_cuda.commit
sha256sum dev/data/corpus/*.bin
el unpacked
(while sleep 5; do echo "$((SECONDS - S)) $(free -m | awk '/Mem/{print $3, $7}')"; done) > $OUT/r/mem.txt &
MON=$!
( nice make -j16 build/test_gpu build/bench_gpu build/test_train_gpu build/test_gpt2_cuda > $OUT/r/make_head.txt 2>&1; echo "rc $? at $((SECONDS - S)) s" >> $OUT/r/make_head.txt ) &
B="$!"
for c in ca32d23 2e1cf2d; do ( cd .p16/$c && nice make -j16 build/bench_gpu build/test_gpu > $OUT/r/make_$c.txt 2>&1; echo "rc $? at $((SECONDS - S)) s" >> $OUT/r/make_$c.txt ) & B="$B $!"; done
# The largest model: as the H200 run (dev/results/largest/logs/lean/h200x2_20261128_225498b/commands.sh).
D=$OUT/largest; mkdir -p $D; cp "$0" $D/commands.sh
C="-i dev/data/corpus/corpus_train.bin -j dev/data/corpus/corpus_val.bin"
/usr/bin/time -v timeout 430 ./build/train_gpt2_8bit_cuda -e d118c4096h32 -r 4bit-sr -R 1 -C 1 -b 1 -t 1024 $C -n 100 -l 3e-5 -u 30 -v 25 -m 8 -d 1337 > $D/d118c4096_4bit-sr.log 2> $D/d118c4096_4bit-sr.time
el "largest exit $?"
grep -E "parameters|computed|measured|^step +(1|2|3|50|100)/|val loss" $D/d118c4096_4bit-sr.log | head -30; grep -E "Elapsed|Maximum resident" $D/d118c4096_4bit-sr.time
tar czf $OUT/largest.tgz -C $OUT largest && rm -rf $D
wait $B
el "builds: $(tail -n1 $OUT/r/make_head.txt) / $(tail -n1 $OUT/r/make_ca32d23.txt) / $(tail -n1 $OUT/r/make_2e1cf2d.txt)"
for b in build .p16/ca32d23/build .p16/2e1cf2d/build; do
    [ $((SECONDS - S)) -lt 540 ] || break
    echo "=== $b"; timeout 40 $b/bench_gpu "8-bit, bf16 + int8" 2>&1 | grep -E "copy bandwidth|bf16 \+ int8|error|not run" 
done | tee $OUT/r/bench_p16_1.txt
el done
kill $MON; tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
