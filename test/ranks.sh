# shellcheck shell=bash
# Sourced by test/nccl_checks.sh and test/mpi_checks.sh (they set TRAIN, the trainer, and OUT, the logs).
# ranks N LOG FLAGS...: N ranks of the trainer started by hand, rank r's output in LOG.r; 0 when every
# rank exits 0. The first rank to fail ends the others (they would wait in NCCL for it until killed).
RANKS_ID=0
ranks() {
    local n=$1 log=$2 pids="" r rc=0
    shift 2
    RANKS_ID=$((RANKS_ID + 1))   # a fresh NCCL id file a launch: no rank reads the last one's
    for r in $(seq 0 $((n - 1))); do
        BNB8_RANKS=$n BNB8_RANK=$r BNB8_LOCAL_RANK=$r BNB8_NCCL_ID="$OUT/nccl_id.$RANKS_ID" "$TRAIN" "$@" > "$log.$r" 2>&1 &
        pids="$pids $!"
    done
    # wait -n until a rank fails or none is left (127). Not a count of n waits: ranks that end together
    # can be reaped by one wait, the next then finds none (127), and a count would read that as a failure.
    local s
    while :; do wait -n; s=$?; [ "$s" -eq 0 ] || break; done
    # shellcheck disable=SC2086   # one pid a word
    [ "$s" -ne 127 ] && kill $pids 2> /dev/null
    for r in $pids; do wait "$r" || rc=1; done   # every rank's own status (bash keeps those of reaped ones)
    return $rc
}
