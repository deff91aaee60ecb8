#!/usr/bin/env bash
# The main job of the README: builds hybridep if needed and runs `hybridep doctor`.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
hep_ensure_deps
cmake -S . -B build/release -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build/release -j"$(nproc)" --target hybridep_cli >/dev/null
exec build/release/tools/hybridep doctor "$@"
