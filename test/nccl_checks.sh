#!/usr/bin/env bash
# The checks of training over NCCL on a machine of 2 or more GPUs (DESIGN.md §8.8), in one call of
# at most ~9 minutes, cheapest and most important first; a short table at the end. Ranks are launched
# in the background with BNB8_RANKS / BNB8_RANK / BNB8_LOCAL_RANK (no mpirun on the device machines),
# NVLink multicast off.
#   1. the one-rank tests (test_train_gpu, TEST_ONLY=NCCL): the NCCL path with one rank = the plain
#      path bit for bit (-N prev, exact, est; with and without release), one rank's checkpoints: stop + resume bit-exact,
#      fall back past a damaged or missing rank file, another number of ranks refused;
#   then for N = 2 (and 4, 8 when there are that many GPUs):
#   2. d12 flash 30 steps on N ranks against one GPU with -A N (the same global batch): both losses
#      at step 30 and their gap (the reduction order differs: close, not equal);
#   2b. gradient release over NCCL against none, -N prev -g 0 and -N est -g 1: every loss and norm
#      equal with 2 ranks; with more the losses at step 30 and their gap (the sums' order differs);
#   3. a checkpoint at step 10 resumed to 20 against 20 straight steps, on N ranks: every rank's
#      optimizer file and the trainer state of step 20 equal byte for byte;
#   3b. the final weights exported (-X, fp32: rank 0 gathers every rank's masters) at the end of the
#      20 straight steps = the export of the checkpoint of step 20 (-y 1, no step), byte for byte; and
#      close to one GPU's with -A N (max |difference|); at -l 0 (the weights stay the initial ones)
#      N ranks' export = one GPU's byte for byte (every rank's part in its place);
#   4. that checkpoint resumed by another number of ranks: refused, the message printed;
#   5. tokens/s of N = 1, 2 (, 4, 8) GPUs at d12 and d24 (B=16, T=1024, 20 steps, -w 0): per-GPU efficiency
#      (rank 0's tokens/s, its share, over one GPU's);
#   6. the largest model line, flash + release (-N est) with -C 1, B=1 on all the GPUs: memory per GPU
#      and of the host. Up to 4 GPUs d72 (7.3e9), 3 steps; on 8, 10 steps of d64c6400 (31.8e9) where a
#      GPU holds 120 GB or more (H200), else d56c6400 (27.9e9). Parts 2-5 run without release (-R 0:
#      -A N on one GPU needs it; -N exact). On 8 GPUs the parts take more than one call of 10 minutes:
#      CHECKS="one ranks release stop resume", then "scale", then "largest".
#
#   bash test/nccl_checks.sh            # builds with make, runs everything
#   NG=2 bash test/nccl_checks.sh       # only 2 GPUs of the machine
#   CHECKS="scale largest" bash test/nccl_checks.sh   # parts: one (1), ranks (2), release (2b), stop (2c), resume (3-4), scale (5), largest (6)
# Logs go to $OUT (the device tool's output folder) or build/nccl_checks; those worth keeping, with the
# printed output, to dev/results/nccl/logs/nccl_checks/<gpu>x<count>_<yyyymmdd>_<commit>/
# (dev/results/README.md).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/nccl_checks}
CHECKS=${CHECKS:-"one ranks release stop resume scale largest"}
on() { case " $CHECKS " in *" $1 "*) return 0 ;; esac; return 1; }
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
T0=$SECONDS
make -j"$(nproc)" build/train_gpt2_8bit_cuda $(on one && echo build/test_train_gpu) > "$OUT/make.log" 2>&1 || { tail -n 30 "$OUT/make.log"; exit 1; }
grep -q 'NCCL *yes' "$OUT/make.log" || make info 2>/dev/null | grep NCCL
TRAIN=build/train_gpt2_8bit_cuda
GPUS=$(nvidia-smi -L | grep -c '^GPU')
NG=${NG:-$GPUS}
[ "$NG" -gt 8 ] && NG=8
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 1
echo "build: $((SECONDS - T0)) s; $GPUS GPUs, using up to $NG"
table=""
row() { table+=$(printf '%-58s %s' "$1" "$2")$'\n'; echo "--> $1: $2"; }

source test/ranks.sh   # ranks N LOG FLAGS...
loss_at() { awk -v s="$2/" '$1 == "step" && index($2, s) == 1 { print $5 }' "$1"; }   # LOG STEP
speed() { awk '$1 == "speed" { print $2 }' "$1"; }

# 1. one rank
if on one; then
t=$SECONDS
TEST_ONLY=NCCL ./build/test_train_gpu > "$OUT/one_rank.log" 2>&1
grep -a -E '^(ok|FAIL)|nccl|FAIL' "$OUT/one_rank.log" | head -n 40
row "one-rank tests (test_train_gpu, TEST_ONLY=NCCL)" "$(tail -n 1 "$OUT/one_rank.log") ($((SECONDS - t)) s)"
fi

F="-e d12 -r flash -R 0 -b 8 -t 1024 -v 0 -G 0 -u 5 -w 0"
for N in 2 4 8; do
    [ "$N" -gt "$NG" ] && break
    # 2. N ranks vs one GPU with -A N
    if on ranks; then
    t=$SECONDS
    "$TRAIN" $F -n 30 -A "$N" > "$OUT/d12_A$N.log" 2>&1
    ranks "$N" "$OUT/d12_N$N.log" $F -n 30
    a=$(loss_at "$OUT/d12_A$N.log" 30); b=$(loss_at "$OUT/d12_N$N.log.0" 30)
    row "d12 flash 30 steps: $N ranks vs 1 GPU -A $N (loss, gap)" "$b vs ${a:-?}, gap $(awk -v a="${a:-nan}" -v b="${b:-nan}" 'BEGIN { printf "%+.4f", b - a }') ($((SECONDS - t)) s)"
    fi
    # 2b. gradient release over NCCL against none, -N prev -g 0 (no clip) and -N est -g 1. Without
    #     release ZeRO-1 cuts G as one vector in N parts; with it, each group apart: an element's owner
    #     can differ, and NCCL's ring sums an element's N parts in an order set by its owner's place in
    #     the ring. A sum of two has one order: with 2 ranks every loss and norm equal; with more, close,
    #     not equal (one ring of one channel gives the same gap: the logs in dev/results/nccl/).
    if on release; then
    t=$SECONDS
    for n in prev est; do
        g=0; [ "$n" = est ] && g=1
        for R in 0 1; do ranks "$N" "$OUT/${n}${R}_N$N.log" ${F/-R 0/-R $R -N $n -g $g} -n 30; done
        a=$(awk '$1 == "step" && $2 ~ /\// { print $5, $11 }' "$OUT/${n}0_N$N.log.0" | tr '\n' ' ')
        b=$(awk '$1 == "step" && $2 ~ /\// { print $5, $11 }' "$OUT/${n}1_N$N.log.0" | tr '\n' ' ')
        same=NO; [ -n "$a" ] && [ "$a" = "$b" ] && same=yes
        [ "$N" -gt 2 ] && same="($same: $N ranks sum in another order)"
        [ "$n" = prev ] && grep -a -h -E 'per GPU|[+] exchange' "$OUT/${n}1_N$N.log.0" | head -n 2
        l1=$(loss_at "$OUT/${n}1_N$N.log.0" 30); l0=$(loss_at "$OUT/${n}0_N$N.log.0" 30)
        row "d12 flash 30 steps on $N ranks, -N $n -g $g: release vs none" "every loss and norm equal: $same; at 30: $l1 vs $l0, gap $(awk -v a="${l0:-nan}" -v b="${l1:-nan}" 'BEGIN { printf "%+.4f", b - a }'); clipped $(grep -a -c ' clipped' "$OUT/${n}1_N$N.log.0") / $(grep -a -c ' clipped' "$OUT/${n}0_N$N.log.0") ($((SECONDS - t)) s)"
    done
    fi
    # 2c. the stop after 10 bad steps in a row is the ranks' (each counts the elements its shards left
    #     unchanged; the stop reads their total): a run diverged on purpose (SGD at -l 1000, -N prev: an update may overflow on one rank first) ends on every
    #     rank, at the same steps, each rank on its own (not ended by another's failure: a rank left
    #     behind would wait in its next exchange until the timeout)
    if on stop; then
    t=$SECONDS
    pids=""
    for r in $(seq 0 $((N - 1))); do
        BNB8_RANKS=$N BNB8_RANK=$r BNB8_LOCAL_RANK=$r BNB8_NCCL_ID="$OUT/nccl_id.stop$N" timeout 120 "$TRAIN" \
            -e d2c128h4 -w 0 -r 8bit -R 0 -b 4 -t 64 -v 0 -G 0 -n 40 -p sgd -l 1000 -u 0 -g 0 -N prev > "$OUT/stop_N$N.log.$r" 2>&1 &
        pids="$pids $!"
    done
    codes=""; for p in $pids; do wait "$p"; codes="$codes $?"; done
    steps=$(for r in $(seq 0 $((N - 1))); do grep -a '^error' "$OUT/stop_N$N.log.$r" | grep -o 'steps [0-9]*\.\.[0-9]*' | head -n 1; done | sort -u | tr '\n' ' ')
    grep -a -h '^error' "$OUT/stop_N$N.log.0" | cut -c 1-160
    together=NO; [ "$(echo $codes)" = "$(printf '1 %.0s' $(seq 1 "$N") | sed 's/ $//')" ] && [ "$(echo "$steps" | grep -o "steps" | wc -l)" -eq 1 ] && together=yes
    row "diverged run on $N ranks: the 10-bad-steps stop" "every rank stopped, at the same steps: $together (exit codes$codes; $steps) ($((SECONDS - t)) s)"
    rm -f "$OUT/nccl_id.stop$N"
    fi
    if on resume; then
    # 3. checkpoint at 10, resume to 20, against 20 straight steps
    t=$SECONDS
    rm -rf "$OUT/ck_straight$N" "$OUT/ck_resumed$N"
    ranks "$N" "$OUT/ck_straight$N.log" $F -n 20 -o "$OUT/ck_straight$N" -X "$OUT/export_N$N.bin" -F fp32
    ranks "$N" "$OUT/ck_stop$N.log" $F -n 20 -x 10 -o "$OUT/ck_resumed$N"
    ranks "$N" "$OUT/ck_resume$N.log" $F -n 20 -y 1 -o "$OUT/ck_resumed$N"
    same=yes; files=0
    for f in "$OUT/ck_straight$N"/optim_00000020.rank*of$N.bin "$OUT/ck_straight$N/state_00000020.bin"; do
        files=$((files + 1))
        cmp -s "$f" "$OUT/ck_resumed$N/$(basename "$f")" || same=NO
    done
    [ "$files" -eq $((N + 1)) ] || same="NO ($files files, expected $((N + 1)))"
    grep -a -h 'checkpoint in\|ranks, an optimizer file' "$OUT/ck_straight$N.log.0" | tail -n 2
    row "checkpoint at 10 + resume to 20 vs 20 straight, $N ranks" "files of step 20 identical: $same ($((SECONDS - t)) s)"
    # 3b. the export
    t=$SECONDS
    ranks "$N" "$OUT/export_ck$N.log" $F -n 20 -y 1 -o "$OUT/ck_straight$N" -X "$OUT/export_ck_N$N.bin" -F fp32
    "$TRAIN" $F -n 20 -A "$N" -X "$OUT/export_A$N.bin" -F fp32 > "$OUT/export_A$N.log" 2>&1
    same=NO; cmp -s "$OUT/export_N$N.bin" "$OUT/export_ck_N$N.bin" && same=yes
    grep -a -h '^export\|^error' "$OUT/ck_straight$N.log.0" | head -n 2
    diff=$(python3 -c "import numpy as np, sys; a, b = (np.fromfile(f, dtype=np.float32)[256:] for f in sys.argv[1:]); print(f'{np.abs(a - b).max():.2e} over {a.size} weights' if a.size == b.size and a.size else 'sizes differ')" "$OUT/export_N$N.bin" "$OUT/export_A$N.bin" 2>&1 | tail -n 1)
    row "export (-X, fp32) on $N ranks" "= the checkpoint's export: $same; vs 1 GPU -A $N: max |diff| $diff ($((SECONDS - t)) s)"
    #     each rank's part in its place: at -l 0 the weights stay the initial ones whatever the sums, so
    #     N ranks' export of 2 steps is one GPU's byte for byte
    t=$SECONDS
    ranks "$N" "$OUT/export_l0_N$N.log" $F -n 2 -l 0 -X "$OUT/export_l0_N$N.bin" -F fp32
    "$TRAIN" $F -n 2 -l 0 -X "$OUT/export_l0_1.bin" -F fp32 > "$OUT/export_l0_1.log" 2>&1
    same=NO; [ -s "$OUT/export_l0_1.bin" ] && cmp -s "$OUT/export_l0_N$N.bin" "$OUT/export_l0_1.bin" && same=yes
    row "export at -l 0 (the initial weights), $N ranks vs 1 GPU" "identical: $same ($((SECONDS - t)) s)"
    # 4. another number of ranks refused
    M=1; [ "$N" -eq 2 ] && [ "$NG" -ge 4 ] && M=4
    ranks "$M" "$OUT/ck_other$N.log" $F -n 30 -y 1 -o "$OUT/ck_resumed$N" && refused=NO || refused=yes
    grep -a -h '^error' "$OUT/ck_other$N.log.0" | head -n 1
    row "resume of $N ranks' checkpoint by $M rank(s)" "refused: $refused"
    "$TRAIN" $F -n 30 -y 1 -o "$OUT/ck_resumed$N" > "$OUT/ck_plain$N.log" 2>&1 && refused=NO || refused=yes
    grep -a -h '^error' "$OUT/ck_plain$N.log" | head -n 1
    row "resume of $N ranks' checkpoint by a single process" "refused: $refused"
    rm -rf "$OUT/ck_straight$N" "$OUT/ck_resumed$N" "$OUT"/export_*$N.bin "$OUT/export_l0_1.bin"
    fi
done

# 5. scaling
S="-r flash -R 0 -b 16 -t 1024 -n 20 -v 0 -G 0 -w 0"
for d in d12 d24; do
    on scale || break
    t=$SECONDS
    "$TRAIN" -e $d $S > "$OUT/scale_${d}_1.log" 2>&1
    one=$(speed "$OUT/scale_${d}_1.log")
    line="1 GPU ${one:-?} tok/s"
    for N in 2 4 8; do
        [ "$N" -gt "$NG" ] && break
        ranks "$N" "$OUT/scale_${d}_$N.log" -e $d $S
        r0=$(speed "$OUT/scale_${d}_$N.log.0")
        line+=$(awk -v n="$N" -v r="${r0:-0}" -v o="${one:-0}" 'BEGIN { printf "; %d GPUs %.0f tok/s (%.1f%% per GPU)", n, n * r, (o > 0 ? 100 * r / o : 0) }')
    done
    row "tokens/s $d B=16 T=1024 20 steps" "$line ($((SECONDS - t)) s)"
done

# 6. the largest model line
if on largest; then
t=$SECONDS
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
big=d72; steps=3; limit=200
if [ "$NG" -ge 8 ]; then
    steps=10; limit=540; big=d56c6400
    [ "${mib:-0}" -ge 120000 ] && big=d64c6400
fi
timeout $limit bash -c "$(declare -f ranks); RANKS_ID=99; OUT='$OUT'; TRAIN='$TRAIN'; ranks $NG '$OUT/largest_N$NG.log' -e $big -r flash -R 1 -C 1 -b 1 -t 1024 -n $steps -v 0 -G 0 -w 0 -l 3e-4"
rc=$?
grep -a -h -E '^model|per GPU|[+] exchange|device memory|measured|resident|^loss|^error' "$OUT/largest_N$NG.log.0" | tail -n 9
row "$big flash + release -C 1 B=1 on $NG GPUs, $steps steps" "exit $rc, loss $(loss_at "$OUT/largest_N$NG.log.0" "$steps") ($((SECONDS - t)) s)"
fi

echo "=== summary ($((SECONDS - T0)) s)"
printf '%s' "$table"
