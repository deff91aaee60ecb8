#!/usr/bin/env bash
# The test command of the README (and CI): installs what is missing, then
#  1. builds hybridep (kernels for sm_90 and sm_100, host code with -Wall -Wextra -Werror)
#     and runs every host test;
#  2. installs it into a scratch prefix and builds examples/ against it, once with CMake
#     find_package and once with pkg-config, and runs them;
#  3. configures and builds once with CUDA hidden and runs the tests there;
#  4. builds with AddressSanitizer + UndefinedBehaviorSanitizer (kernels for sm_90 only)
#     and runs the tests again.
# Tests that cannot run here are listed with their reasons after each ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
hep_ensure_deps test

jobs=$(nproc)
export ASAN_OPTIONS=${ASAN_OPTIONS:-protect_shadow_gap=0:detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
t0=$(date +%s)
step() { echo "== [$(( $(date +%s) - t0 )) s] $*"; }
configure() { # dir, then cmake options; the log is kept, the "hybridep:" lines shown
    local dir=$1
    shift
    mkdir -p "$dir"
    if ! cmake -S . -B "$dir" "$@" >"$dir.configure.log" 2>&1; then
        cat "$dir.configure.log"
        exit 1
    fi
    grep "hybridep:" "$dir.configure.log" || true
}
# ctest, then the reason of every skipped test (each prints "skipped: <reason>")
run_tests() {
    local dir=$1
    shift
    ctest --test-dir "$dir" --output-on-failure -j"$jobs" "$@"
    awk '/^[0-9]+\/[0-9]+ Test: /{name=$3} /^skipped: /{sub(/^skipped: /,""); print "   skipped " name ": " $0}' \
        "$dir/Testing/Temporary/LastTest.log"
}

step "build (release, sm_90 + sm_100)"
configure build/release -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHEP_CUDA_ARCHS="90;100" -DBUILD_TESTING=ON
cmake --build build/release -j"$jobs"
step "tests (release)"
run_tests build/release --timeout 600

step "install into a scratch prefix; examples with find_package and with pkg-config"
prefix=$PWD/build/prefix
rm -rf "$prefix" build/examples build/examples-pc
cmake --install build/release --prefix "$prefix" >/dev/null
cmake -S examples -B build/examples -DCMAKE_PREFIX_PATH="$prefix" >build/examples.configure.log 2>&1 ||
    { cat build/examples.configure.log; exit 1; }
cmake --build build/examples -j"$jobs" >/dev/null
build/examples/host_inproc >/dev/null
build/examples/train_step >/dev/null
if [ -x build/examples/mpi_group ]; then
    OMPI_MCA_btl=self,vader mpirun --allow-run-as-root --oversubscribe -np 1 build/examples/mpi_group >/dev/null
fi
mkdir -p build/examples-pc
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig:$(ls -d "$prefix"/lib/*/pkgconfig 2>/dev/null | tr '\n' ':')
# shellcheck disable=SC2046
cc -std=c11 -Wall -Wextra -Werror examples/host_inproc.c $(pkg-config --cflags --libs hybridep) \
    -lpthread -Wl,-rpath,"$(pkg-config --variable=libdir hybridep)" -o build/examples-pc/host_inproc
build/examples-pc/host_inproc >/dev/null
if pkg-config --exists hybridep-mpi; then
    # shellcheck disable=SC2046
    mpicc -std=c11 -Wall -Wextra -Werror examples/mpi_group.c $(pkg-config --cflags --libs hybridep-mpi) \
        -Wl,-rpath,"$(pkg-config --variable=libdir hybridep)" -o build/examples-pc/mpi_group
fi
"$prefix/bin/hybridep" --version
echo "   examples built and run against $prefix (find_package and pkg-config)"

step "build and tests with CUDA and the libibverbs headers hidden (host backend, loopback NIC only)"
configure build/nocuda -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CUDA_COMPILER=/nonexistent/nvcc -DHEP_VERBS=OFF -DBUILD_TESTING=ON
cmake --build build/nocuda -j"$jobs" >/dev/null
run_tests build/nocuda --timeout 600

step "build (AddressSanitizer + UndefinedBehaviorSanitizer, sm_90)"
configure build/asan -DCMAKE_BUILD_TYPE=Debug -DHEP_SANITIZE=ON -DHEP_CUDA_ARCHS=90 -DBUILD_TESTING=ON
cmake --build build/asan -j"$jobs"
step "tests (sanitizers)"
# kernel_variants and kernel_spills compile the kernel sources with nvcc alone (no flag of
# this build reaches them): the release pass ran them, and again here they cost 4-5 min
run_tests build/asan --timeout 900 -E '^kernel_(variants|spills)$'

# ---- Python package: hybridep for PyTorch on the host backend, one process per rank ----
step "python package tests (host backend, torch.distributed gloo processes)"
py=${HEP_PYTHON:-/usr/bin/python3}
rm -rf build/pyinstall
HEP_BUILD_DIR=build/release HEP_PYTHON="$py" bash scripts/install_python.sh --target build/pyinstall --quiet
py_rc=0
(cd build && PYTHONPATH="$PWD/pyinstall" HEP_TIMEOUT_MS=20000 timeout 600 \
    "$py" -m pytest -q -rs -p no:cacheprovider ../python/tests) || py_rc=$?
if [ "$py_rc" != 0 ]; then
    echo "python package tests failed (pytest exit $py_rc; 5 = no tests collected)" >&2
    exit 1
fi

step "all passed: release, install + examples, no-CUDA, sanitizers, python; next: bash scripts/main.sh (the bench) or build/release/tools/hybridep --help"
