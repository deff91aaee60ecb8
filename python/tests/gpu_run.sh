#!/usr/bin/env bash
# The Python package on the GPU machine: NPROC (8) processes sharing the GPU (CUDA IPC)
# under torchrun, with MPS and then without it. Every step runs under `timeout` (a HUNG is
# a failure; without MPS a HEP_ERR_TIMEOUT naming a rank is an acceptable end, since
# co-dependent kernels of different processes only time-slice). Steps, each suite:
#   moe_layer.py (correctness vs plain torch), gpu_bench.py (phases through the package,
#   beside `hybridep bench`'s: ratio), overhead.py (per-call Python overhead, no_sync),
#   the GPU pytest tests one by one (CUDA graph, torch.compile, permute), and once the
#   whole pytest suite (host backend too).
# Full logs in $OUT/py_*.txt; a summary table at the end (`=== python summary`).
#   HEP_BUILD_DIR  a build of this repository (required; its src/libhybridep.so is used;
#                  .gpu from bench/gpu_build.sh works)
#   HEP_PYTHON     python with torch + CUDA (default python3); NPROC (default 8)
#   PY_MPS_ONLY=1  only the example, the bench and the overhead script, under MPS
#                  (PY_MPS_TESTS=1: and the GPU pytest tests, under MPS only)
#   PY_GPU_TESTS   the GPU pytest tests to run (names in test_gpu.py; default: all)
#   PY_BENCH_VARIANTS=0  leaves out the bench's side-stream and pinned runs
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${HEP_BUILD_DIR:?set HEP_BUILD_DIR to a hybridep build directory (with src/libhybridep.so)}"
py=${HEP_PYTHON:-python3}
np=${NPROC:-8}
OUT=${OUT:-/tmp/hep-gpu}
mkdir -p "$OUT"
export HYBRIDEP_LIBRARY=$(readlink -f "$HEP_BUILD_DIR/src/libhybridep.so")
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUDA_DEVICE_MAX_CONNECTIONS=32 OMP_NUM_THREADS=1
[ -f "$HYBRIDEP_LIBRARY" ] || { echo "no library at $HYBRIDEP_LIBRARY" >&2; exit 1; }
. bench/mps.sh
trap 'mps_stop "$OUT"' EXIT
fails=0
declare -a ROWS
row() { ROWS+=("$(printf '%-52s %s' "$1" "$2")"); }
# name, timeout seconds, allowed (pass | pass-or-named-timeout), command...
run() {
    local name=$1 t=$2 allow=$3; shift 3
    local log="$OUT/py_$(tr -c 'A-Za-z0-9_.-' _ <<<"$name").txt"
    echo "== $name"
    timeout -k 10 "$t" "$@" > "$log" 2>&1
    local rc=$? verdict
    grep -E 'passed|failed|skipped|Error|error|PYBENCH|OVERHEAD|overhead|dispatch|combine|rank [0-9]+ did not arrive' "$log" | tail -12
    case $rc in
        0) verdict="passed" ;;
        5) verdict="no test ran"; fails=$((fails + 1)) ;;
        124|137) verdict="HUNG (killed after $t s)"; fails=$((fails + 1)) ;;
        *) if [ "$allow" = pass-or-named-timeout ] && grep -q 'did not arrive' "$log"; then
               verdict="ended with a named timeout ($(grep -m1 -o 'rank [0-9]* did not arrive' "$log"))"
           else
               verdict="FAILED (exit $rc)"; fails=$((fails + 1))
           fi ;;
    esac
    grep -q 'skipped' "$log" && [ $rc -eq 0 ] && verdict="$verdict; $(grep -m1 -oE '[0-9]+ skipped' "$log")"
    grep -q 'cudaErrorDevicesUnavailable\|busy or unavailable' "$log" &&
        verdict="$verdict; cudaErrorDevicesUnavailable (MPS: $MPS_OK; see $OUT/mps_*.log)"
    row "$name" "$verdict"
    return 0
}
# torchrun as a module of this python (a command, not a shell function: `timeout` runs programs)
trun=("$py" -m torch.distributed.run --standalone --nproc-per-node "$np")
GPU_TESTS=(test_cuda_graph_capture_and_replay_of_a_no_sync_buffer
           test_torch_compile_of_a_moe_layer_through_the_custom_ops
           test_dispatch_with_permute_on_the_gpu_runs_or_raises_the_library_message)
suite() { # label, allow
    local l=$1 allow=$2
    run "$l: moe_layer.py x$np" 300 "$allow" "${trun[@]}" examples/moe_layer.py --backend gpu --sms 4
    if [ "$l" = mps ]; then
        run "$l: gpu_bench.py x$np" 300 pass "${trun[@]}" python/tests/gpu_bench.py
        if [ "${PY_BENCH_VARIANTS:-1}" = 1 ]; then
            run "$l: gpu_bench.py x$np (side stream)" 300 pass "${trun[@]}" python/tests/gpu_bench.py --side-stream
            run "$l: gpu_bench.py x$np (pinned)" 300 pass "${trun[@]}" python/tests/gpu_bench.py --bind-cpu
        fi
        run "$l: overhead.py x$np (no_sync)" 200 pass "${trun[@]}" python/tests/overhead.py --backend gpu
    fi
    [ "${PY_MPS_ONLY:-0}" = 1 ] && [ "${PY_MPS_TESTS:-0}" != 1 ] && return 0
    for t in ${PY_GPU_TESTS:-${GPU_TESTS[@]}}; do # one pytest process each: one failure cannot poison the next
        run "$l: $t" 300 "$allow" env HEP_PY_GPU_WORLD="$np" "$py" -m pytest -q -rs -s \
            "python/tests/test_gpu.py::$t"
    done
}
"$py" -c "import torch, hybridep; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'lib', hybridep.library_path)" \
    > "$OUT/py_env.txt" 2>&1 || { cat "$OUT/py_env.txt"; exit 1; }
cat "$OUT/py_env.txt"
# the C bench of the same shape, for the ratio (threads of one process)
if [ -x "$HEP_BUILD_DIR/hybridep" ]; then
    LD_LIBRARY_PATH=$(dirname "$HYBRIDEP_LIBRARY"):$HEP_BUILD_DIR/lib:${LD_LIBRARY_PATH:-} \
        timeout 300 "$HEP_BUILD_DIR/hybridep" bench --iters 20 > "$OUT/py_c_bench.txt" 2>&1
fi
export HEP_TIMEOUT_MS=${HEP_TIMEOUT_MS:-60000}
if mps_start "$py" -c "import torch; torch.zeros(1, device='cuda').add_(1); torch.cuda.synchronize()"; then
    suite mps pass
else
    row "MPS" "did not start (see [mps] lines above): the MPS suite was not run"
    fails=$((fails + 1))
fi
mps_stop "$OUT"
if [ "${PY_MPS_ONLY:-0}" != 1 ]; then
    export HEP_TIMEOUT_MS=${HEP_TIMEOUT_MS_NO_MPS:-20000}
    suite "no MPS" pass-or-named-timeout
    run "pytest python/tests (host backend; GPU ones ran above)" 600 pass "$py" -m pytest -q -rs python/tests --ignore=python/tests/test_gpu.py
fi
# the bench through the package against the C bench
msv() { grep -m1 -E "^$2" "$1" 2>/dev/null | awk '{for(i=1;i<=NF;i++) if($i=="ms"){print $(i-1); exit}}'; }
for variant in "" "_side_stream__" "_pinned__"; do
pb=$(grep -h '^PYBENCH' "$OUT"/py_mps__gpu_bench.py_x${np}_${variant}.txt 2>/dev/null | tail -1)
label="bench"; v=$(echo ${variant//_/ }); [ -n "$variant" ] && label="bench ($v)"
for ph in dispatch combine; do
    p=$(sed -n "s/.*${ph}_ms=\([0-9.]*\).*/\1/p" <<<"$pb")
    c=$(msv "$OUT/py_c_bench.txt" "$ph")
    if [ -n "$p" ] && [ -n "$c" ]; then
        row "$label $ph: package vs C bench" "$p ms vs $c ms: ratio $(awk -v a="$p" -v b="$c" 'BEGIN{printf "%.3f (target <= 1.10)", a/b}')"
    else
        row "$label $ph: package vs C bench" "not measured (see $OUT/py_c_bench.txt and the gpu_bench log)"
    fi
done
done
ov=$(grep -h '^OVERHEAD' "$OUT"/py_mps__overhead.py*.txt 2>/dev/null | tail -1)
row "per-call Python overhead (GPU, no_sync)" "${ov:-not measured} (target <= 15 us)"
echo
echo "=== python summary (logs: $OUT/py_*.txt)"
printf '%s\n' "${ROWS[@]}"
echo "$fails step(s) did not pass"
exit $((fails > 0))
