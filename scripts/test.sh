#!/usr/bin/env bash
# The test command of the README: installs what is missing, builds hybridep (kernels for
# sm_90 and sm_100, host code with -Wall -Wextra -Werror), runs every host test, then
# builds again with AddressSanitizer + UndefinedBehaviorSanitizer and runs them again.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
hep_ensure_deps

jobs=$(nproc)
export ASAN_OPTIONS=${ASAN_OPTIONS:-protect_shadow_gap=0:detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

echo "== build (release, sm_90 + sm_100)"
cmake -S . -B build/release -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHEP_CUDA_ARCHS="90;100" >/dev/null
cmake --build build/release -j"$jobs"
echo "== tests (release)"
ctest --test-dir build/release --output-on-failure -j"$jobs" --timeout 600

echo "== build (AddressSanitizer + UndefinedBehaviorSanitizer)"
cmake -S . -B build/asan -DCMAKE_BUILD_TYPE=Debug -DHEP_SANITIZE=ON -DHEP_CUDA_ARCHS=90 >/dev/null
cmake --build build/asan -j"$jobs"
echo "== tests (sanitizers)"
ctest --test-dir build/asan --output-on-failure -j"$jobs" --timeout 900

# ---- Python package: hybridep for PyTorch on the host backend, one process per rank ----
echo "== python package tests (host backend, torch.distributed gloo processes)"
py=${HEP_PYTHON:-/usr/bin/python3}
if ! "$py" -c "import torch, pytest, numpy, setuptools" 2>/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            python3-torch python3-pytest python3-numpy python3-setuptools python3-pip >/dev/null
    else
        echo "missing: sudo apt-get install -y python3-torch python3-pytest python3-numpy python3-setuptools python3-pip" >&2
        exit 1
    fi
fi
rm -rf build/pyinstall
HEP_BUILD_DIR=build/release HEP_PYTHON="$py" bash scripts/install_python.sh --target build/pyinstall --quiet
py_rc=0
(cd build && PYTHONPATH="$PWD/pyinstall" HEP_TIMEOUT_MS=20000 timeout 600 \
    "$py" -m pytest -q -rs -p no:cacheprovider ../python/tests) || py_rc=$?
if [ "$py_rc" != 0 ]; then
    echo "python package tests failed (pytest exit $py_rc; 5 = no tests collected)" >&2
    exit 1
fi
