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
