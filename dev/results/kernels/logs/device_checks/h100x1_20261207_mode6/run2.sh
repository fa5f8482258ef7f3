#!/bin/bash
# device call 2 (warm): parity groups on the build of call 1, then the trainer at d72
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
ls build/test_gpu build/train_gpt2_8bit_cuda || exit 3
left() { echo $(( 585 - ($(date +%s) - T0) )); }
for s in stochastic "flash:"; do
  n=$(echo "$s" | tr -dc 'a-z')
  TEST_ONLY="$s" timeout $(left) ./build/test_gpu > $OUT/test_$n.log 2>&1; echo "rc=$?" >> $OUT/test_$n.log
  t "test $s: $(tail -2 $OUT/test_$n.log | tr "\n" " ")"
done
for r in flash 8bit-int8; do
  [ $(left) -gt 90 ] || break
  timeout 85 ./build/train_gpt2_8bit_cuda -D gpu -e d72 -b 1 -t 1024 -n 14 -l 3e-4 -w 0 -C 1 -R 1 -r $r -v 0 -G 0 > $OUT/d72_$r.txt 2>&1
  t "d72 $r rc $?: $(grep -E 'speed|measured' $OUT/d72_$r.txt | tr -s ' ' | tr "\n" ' ')"
done
for s in optimizers quantize "one absmax" gnorm shards; do
  [ $(left) -gt 20 ] || break
  n=$(echo "$s" | tr -dc 'a-z')
  TEST_ONLY="$s" timeout $(left) ./build/test_gpu > $OUT/test_$n.log 2>&1; echo "rc=$?" >> $OUT/test_$n.log
  t "test $s: $(tail -2 $OUT/test_$n.log | tr "\n" " ")"
done
