#!/usr/bin/env bash
# The trainer launched by OpenMPI's mpirun (Debian's, as llm.c users run it) against the same
# ranks launched by hand (BNB8_RANKS): the same program on the same ranks, so every step line's loss
# and norm must be equal. On a machine of 2 or more GPUs, ~2 minutes with the build.
#   bash test/mpi_checks.sh fetch   # here (Debian, network): Debian's OpenMPI packages into build/carry_mpi
#   bash test/mpi_checks.sh         # there: where mpirun is missing (the device machines have none), the
#                                   # packages of build/carry_mpi unpacked into /tmp/ompi and used from there
# Device tool: carry ["build/carry_mpi"]. Logs go to $OUT or build/mpi_checks; those worth keeping to
# dev/results/nccl/logs/mpi_checks/<gpu>x<count>_<yyyymmdd>_<commit>/ (dev/results/README.md).
set -uo pipefail
cd "$(dirname "$0")/.."
PKGS="openmpi-bin openmpi-common libopenmpi3 libpmix2 libhwloc15 libevent-core-2.1-7 libevent-pthreads-2.1-7
      libfabric1 libucx0 libibverbs1 libnl-3-200 libnl-route-3-200 librdmacm1 libnuma1 libpsm2-2 libpsm-infinipath1
      libmunge2 libxml2 libicu72 libpciaccess0 libudev1 libxnvctrl0 libx11-6 libxext6 libxcb1 libxau6 libxdmcp6
      libbsd0 libmd0 ocl-icd-libopencl1"
if [ "${1:-}" = fetch ]; then
    rm -rf build/carry_mpi && mkdir -p build/carry_mpi && cd build/carry_mpi || exit 1
    # shellcheck disable=SC2086   # one package a word
    apt-get download $PKGS 2>&1 | grep -v '^W: Download is performed unsandboxed' ; ls | wc -l; du -sh .
    exit 0
fi
OUT=${OUT:-build/mpi_checks}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
MPIRUN=$(command -v mpirun)
if [ -z "$MPIRUN" ]; then   # unpack Debian's packages (ar + tar: no dpkg needed) and relocate OpenMPI there
    ls build/carry_mpi/*.deb > /dev/null 2>&1 || { echo "no mpirun and no build/carry_mpi: run 'bash test/mpi_checks.sh fetch' first"; exit 1; }
    rm -rf /tmp/ompi && mkdir -p /tmp/ompi
    for d in build/carry_mpi/*.deb; do
        ar p "$d" "$(ar t "$d" | grep '^data\.tar')" | tar x --xz -C /tmp/ompi || { echo "cannot unpack $d"; exit 1; }
    done
    P=/tmp/ompi/usr
    export OPAL_PREFIX=$P PATH=$P/bin:$PATH
    export LD_LIBRARY_PATH=$P/lib/x86_64-linux-gnu:$P/lib/x86_64-linux-gnu/openmpi/lib:${LD_LIBRARY_PATH:-}
    MPIRUN=$P/bin/mpirun.openmpi
fi
"$MPIRUN" --version | head -n 1
make -j"$(nproc)" build/train_gpt2_8bit_cuda > "$OUT/make.log" 2>&1 || { tail -n 30 "$OUT/make.log"; exit 1; }
NG=$(nvidia-smi -L | grep -c '^GPU')
[ "$NG" -gt 8 ] && NG=8
F="-e d12 -r flash -b 8 -t 1024 -n 20 -v 0 -G 0 -u 5 -w 0"   # release with -N est, the GPU's default
t=$SECONDS
# shellcheck disable=SC2086   # F is split into words on purpose
"$MPIRUN" --allow-run-as-root --oversubscribe --bind-to none -np "$NG" -x NCCL_NVLS_ENABLE -x LD_LIBRARY_PATH \
    build/train_gpt2_8bit_cuda $F > "$OUT/mpirun.log" 2>&1
rc=$?
TRAIN=build/train_gpt2_8bit_cuda
source test/ranks.sh
# shellcheck disable=SC2086
ranks "$NG" "$OUT/hand.log" $F
hand=$?
steps() { awk '$1 == "step" && $2 ~ /\// { print $2, $5, $11 }' "$1"; }   # step, loss, norm
a=$(steps "$OUT/mpirun.log"); b=$(steps "$OUT/hand.log.0")
grep -a -h -E '^note|ranks|^error' "$OUT/mpirun.log" | head -n 4
same=NO; [ -n "$a" ] && [ "$a" = "$b" ] && same=yes
echo "=== mpirun -np $NG (exit $rc) vs $NG ranks by hand (exit $hand), d12 flash + release, 20 steps: every loss and norm equal: $same ($((SECONDS - t)) s)"
echo "    step 20: $(echo "$a" | tail -n 1) vs $(echo "$b" | tail -n 1)"
