#!/usr/bin/env bash
# The main job of the README: builds hybridep (no tests) if needed and runs `hybridep bench`
# with the default configuration (8 virtual ranks, H=7168, T=4096, E=256, K=8, BF16): on a
# GPU it verifies against the host backend and times dispatch and combine against the same
# run's ceilings; without a GPU (or without CUDA) it runs the host backend and says so.
# Extra arguments go to the bench (for example --dtype fp8). Works as any user once the
# build tools are there; as root it installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
hep_ensure_deps main
start=$(date +%s)
echo "== configure (build/main, tests off)"
mkdir -p build
if ! cmake -S . -B build/main -DCMAKE_BUILD_TYPE=RelWithDebInfo -DBUILD_TESTING=OFF >build/main.configure.log 2>&1; then
    cat build/main.configure.log
    exit 1
fi
grep "hybridep:" build/main.configure.log || true
echo "== build"
cmake --build build/main -j"$(nproc)" --target hybridep_cli
build/main/tools/hybridep doctor
rc=0
build/main/tools/hybridep bench "$@" || rc=$?
echo "== main: built in $(( $(date +%s) - start )) s in total, bench exit code $rc; next: build/main/tools/hybridep bench --help (or bash scripts/test.sh)"
exit $rc
