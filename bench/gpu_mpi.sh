#!/usr/bin/env bash
# The GPU backend with one process per rank under mpirun, on the GPU machine: builds
# libhybridep_mpi and tests/test_gpu_mpi.c there with the machine's own mpicc (against the
# carried .gpu/lib/libhybridep.so.0.1: the MPI of the build machine may not match), then
#   with MPS:    correct (GPU vs host backend, element by element), permute (the
#                expert-major layout through the group's staging, against the host
#                backend), bench (phase medians,
#                beside `hybridep bench`'s in-process figures), missing (a rank that never
#                calls dispatch is named by every other), nodes (2 x 4 across processes)
#   without MPS: correct, permute and missing again: co-dependent kernels of different processes
#                time-slice, so each run must end, passing or with a HEP_ERR_TIMEOUT naming
#                a rank; a run killed by `timeout` is a HUNG, the one unacceptable end.
# MPS is stopped on every exit (trap). Full logs in $OUT/mpi_*.txt; a table at the end.
#   NP (8), MPI_TIMEOUT_MS (20000: the bound of the correctness runs' waits), MPI_MPS_ONLY=1
#   (the runs under MPS only)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hep-gpu}
mkdir -p "$OUT"
NP=${NP:-8}
B=$PWD/.gpu
. bench/mps.sh
trap 'mps_stop "$OUT"' EXIT
declare -a ROWS
row() { ROWS+=("$(printf '%-44s %s' "$1" "$2")"); }
summary() {
    echo
    echo "=== mpirun summary (logs: $OUT/mpi_*.txt)"
    printf '%s\n' "${ROWS[@]}"
}

MPICC=$(command -v mpicc || true)
MPIRUN=$(command -v mpirun || command -v mpiexec || true)
if [ -z "$MPICC" ] || [ -z "$MPIRUN" ]; then
    echo "gpu_mpi: needs an MPI C compiler and launcher (mpicc: ${MPICC:-absent}, mpirun: ${MPIRUN:-absent}):"
    echo "  install Open MPI (apt-get install libopenmpi-dev openmpi-bin); nothing was run"
    exit 2
fi
[ -f "$B/lib/libhybridep.so.0.1" ] || { echo "gpu_mpi: no $B/lib/libhybridep.so.0.1 (run bench/gpu_build.sh first)"; exit 2; }
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$NVCC")")")}
echo "== MPI: $("$MPIRUN" --version 2>&1 | head -1); mpicc: $MPICC; CUDA: $CUDA_HOME"

# ---- build (seconds): libhybridep_mpi.so, then the test over it
mkdir -p "$B/mpi"
ln -sf "$B/lib/libhybridep.so.0.1" "$B/mpi/libhybridep.so"
CF=(-std=c11 -O2 -D_POSIX_C_SOURCE=200809L -Wall -Wextra -Iinclude -I"$CUDA_HOME/include")
if ! "$MPICC" "${CF[@]}" -fPIC -shared bindings/mpi/bootstrap_mpi.c -L"$B/mpi" -lhybridep \
        -Wl,-soname,libhybridep_mpi.so.0.1 -o "$B/mpi/libhybridep_mpi.so.0.1" > "$OUT/mpi_build.txt" 2>&1 ||
   ! ln -sf libhybridep_mpi.so.0.1 "$B/mpi/libhybridep_mpi.so" ||
   ! "$MPICC" "${CF[@]}" tests/test_gpu_mpi.c -L"$B/mpi" -lhybridep_mpi -lhybridep \
        -L"$CUDA_HOME/lib64" -lcudart_static -ldl -lrt -lpthread -lm \
        -Wl,-rpath,"$B/mpi:$B/lib" -o "$B/mpi/test_gpu_mpi" >> "$OUT/mpi_build.txt" 2>&1; then
    echo "gpu_mpi: the build with $MPICC failed:"; tail -20 "$OUT/mpi_build.txt"
    exit 2
fi
echo "== built $B/mpi/libhybridep_mpi.so and $B/mpi/test_gpu_mpi"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# no single-copy (CMA/ptrace) in containers; the names of Open MPI 4 (vader) and 5 (sm)
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_btl_sm_single_copy_mechanism=none
export LD_LIBRARY_PATH=$B/mpi:$B/lib:${LD_LIBRARY_PATH:-}
fails=0
# name, seconds, allowed ("pass" or "pass-or-named-timeout"), env..., -- mode
mrun() {
    local name=$1 secs=$2 allow=$3; shift 3
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    local log="$OUT/mpi_${name// /_}.txt"
    echo "== $name"
    timeout -k 10 "$secs" env "${envs[@]}" "$MPIRUN" --oversubscribe -np "$NP" "$B/mpi/test_gpu_mpi" "$@" > "$log" 2>&1
    local rc=$?
    grep -vE '^\[HybridEP\] (info|warning: legacy)' "$log" | tail -25
    local verdict
    case $rc in
        0) verdict="passed" ;;
        77) verdict="SKIPPED ($(grep -m1 '^skipped' "$log"))"; fails=$((fails + 1)) ;;
        124|137) verdict="HUNG (killed after $secs s)"; fails=$((fails + 1)) ;;
        *) if [ "$allow" = pass-or-named-timeout ] && grep -q 'HEP_ERR_TIMEOUT\|did not arrive' "$log" &&
               ! grep -q 'differs\|mismatch' "$log"; then
               verdict="ended with a named timeout: $(grep -m1 -o 'rank [0-9]* did not arrive' "$log")"
           else
               verdict="FAILED (exit $rc)"; fails=$((fails + 1))
           fi ;;
    esac
    grep -q 'cudaErrorDevicesUnavailable\|busy or unavailable' "$log" &&
        verdict="$verdict; cudaErrorDevicesUnavailable seen (mps log in $OUT)"
    row "$name" "$verdict"
}

if mps_start "$B/hybridep" doctor; then
    mrun "mps correct" 300 pass HEP_TIMEOUT_MS=${MPI_TIMEOUT_MS:-20000} -- correct
    mrun "mps permute" 300 pass HEP_TIMEOUT_MS=${MPI_TIMEOUT_MS:-20000} -- permute
    mrun "mps bench" 300 pass HEP_TIMEOUT_MS=${MPI_TIMEOUT_MS:-20000} -- bench
    mrun "mps missing rank" 120 pass HEP_TIMEOUT_MS=3000 -- missing
    mrun "mps 2 x 4 nodes" 120 pass HEP_TIMEOUT_MS=${MPI_TIMEOUT_MS:-20000} -- nodes
    mps_stop "$OUT"
else
    row "MPS" "did not start (see above): the MPS runs were not made"
    fails=$((fails + 1))
    mps_stop "$OUT"
fi
# the in-process bench of the same shape (threads, one process), for the ratio
if [ -x "$B/hybridep" ]; then
    timeout 300 "$B/hybridep" bench --iters 20 --json-file "$OUT/mpi_c_bench.json" > "$OUT/mpi_c_bench.txt" 2>&1
    c_d=$(grep -m1 -E '^dispatch' "$OUT/mpi_c_bench.txt" | awk '{for(i=1;i<=NF;i++) if($i=="ms"){print $(i-1); exit}}')
    c_c=$(grep -m1 -E '^combine' "$OUT/mpi_c_bench.txt" | awk '{for(i=1;i<=NF;i++) if($i=="ms"){print $(i-1); exit}}')
    m_line=$(grep -h '^BENCH_MPI' "$OUT/mpi_mps_bench.txt" 2>/dev/null | tail -1)
    m_d=$(sed -n 's/.*dispatch_ms=\([0-9.]*\).*/\1/p' <<<"$m_line")
    m_c=$(sed -n 's/.*combine_ms=\([0-9.]*\).*/\1/p' <<<"$m_line")
    if [ -n "$c_d" ] && [ -n "$m_d" ]; then
        row "bench dispatch: mpirun vs in-process" "$m_d ms vs $c_d ms (ratio $(awk -v a="$m_d" -v b="$c_d" 'BEGIN{printf "%.3f", a/b}'))"
        row "bench combine: mpirun vs in-process" "$m_c ms vs $c_c ms (ratio $(awk -v a="$m_c" -v b="$c_c" 'BEGIN{printf "%.3f", a/b}'))"
    else
        row "bench ratio" "not computed (see $OUT/mpi_c_bench.txt, $OUT/mpi_mps_bench.txt)"
    fi
fi
if [ "${MPI_MPS_ONLY:-0}" != 1 ]; then
    mrun "no MPS correct" 400 pass-or-named-timeout HEP_TIMEOUT_MS=${MPI_TIMEOUT_MS:-20000} -- correct
    mrun "no MPS permute" 400 pass-or-named-timeout HEP_TIMEOUT_MS=${MPI_TIMEOUT_MS:-20000} -- permute
    mrun "no MPS missing rank" 200 pass-or-named-timeout HEP_TIMEOUT_MS=10000 -- missing
fi
summary
echo "gpu_mpi: $fails step(s) did not pass"
exit $((fails > 0))
