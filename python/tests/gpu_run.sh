#!/usr/bin/env bash
# The Python package on the GPU machine: 8 processes sharing the GPU (CUDA IPC), under MPS
# and then without it (co-dependent kernels time-slice: each run must end or fail with a
# named timeout, never hang: every command is under `timeout`).
#   HEP_BUILD_DIR  a build of this repository (required; its src/libhybridep.so is used)
#   HEP_PYTHON     python with torch + CUDA (default python3); NPROC (default 8)
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${HEP_BUILD_DIR:?set HEP_BUILD_DIR to a hybridep build directory (with src/libhybridep.so)}"
py=${HEP_PYTHON:-python3}
np=${NPROC:-8}
export HYBRIDEP_LIBRARY=$(readlink -f "$HEP_BUILD_DIR/src/libhybridep.so")
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
export CUDA_DEVICE_MAX_CONNECTIONS=32 HEP_TIMEOUT_MS=${HEP_TIMEOUT_MS:-60000}
[ -f "$HYBRIDEP_LIBRARY" ] || { echo "no library at $HYBRIDEP_LIBRARY" >&2; exit 1; }
fails=0
run() { # name, timeout seconds, command...
    local name=$1 t=$2; shift 2
    echo "== $name"
    timeout -k 10 "$t" "$@"
    local rc=$?
    case $rc in
        0) echo "== $name: ok" ;;
        124|137) echo "== $name: HUNG (killed after $t s)"; fails=$((fails + 1)) ;;
        *) echo "== $name: exit $rc"; fails=$((fails + 1)) ;;
    esac
    return 0
}
# a command, not a function: `timeout` runs programs only
trun=("$py" -m torch.distributed.run --standalone --nproc-per-node "$np")
suite() { # label
    run "$1: moe_layer.py x$np (correctness vs plain torch)" 300 "${trun[@]}" examples/moe_layer.py --backend gpu --sms 4
    run "$1: gpu_bench.py x$np (phases, Python overhead)" 600 "${trun[@]}" python/tests/gpu_bench.py
    run "$1: pytest GPU tests (CUDA graph, torch.compile)" 600 env HEP_PY_GPU_WORLD="$np" "$py" -m pytest -q -rs python/tests/test_gpu.py
    run "$1: pytest all (host backend too)" 600 "$py" -m pytest -q -rs python/tests
}
"$py" -c "import torch, hybridep; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'lib', hybridep.library_path)" || exit 1
echo "== starting MPS"
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/hep-mps-pipe} CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/hep-mps-log}
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
if nvidia-cuda-mps-control -d; then
    suite "with MPS"
    echo quit | nvidia-cuda-mps-control
    sleep 2
else
    echo "== MPS did not start: the MPS runs are skipped"; fails=$((fails + 1))
fi
# Without MPS the ranks' kernels time-slice: a timeout naming a rank is an acceptable end
export HEP_TIMEOUT_MS=${HEP_TIMEOUT_MS_NO_MPS:-20000}
suite "without MPS"
echo "== $fails step(s) did not pass (without MPS a named HEP_ERR_TIMEOUT is expected, a HUNG never)"
exit $((fails > 0))
