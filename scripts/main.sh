#!/usr/bin/env bash
# The main job of the README: builds hybridep if needed and runs `hybridep bench` with the
# default configuration (8 virtual ranks, H=7168, T=4096, E=256, K=8, BF16): on a GPU it
# verifies against the host backend and times dispatch and combine against the same run's
# ceilings; without a GPU it runs the host backend and says so. Extra arguments go to the
# bench (for example --dtype fp8).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
hep_ensure_deps
cmake -S . -B build/release -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build/release -j"$(nproc)" --target hybridep_cli >/dev/null
build/release/tools/hybridep doctor
exec build/release/tools/hybridep bench "$@"
