#!/usr/bin/env bash
# Builds kernel variants (tuning experiments) into .gpu/var/<name>/hybridep.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu/var
while read -r name defs; do
  [ -z "$name" ] && continue
  cmake -S . -B build/var-$name -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHEP_CUDA_ARCHS=90 \
    -DHEP_WITH_MPI=OFF -DBUILD_TESTING=OFF "-DHEP_KERNEL_DEFS=$defs" >/dev/null
  cmake --build build/var-$name -j"$(nproc)" --target hybridep_cli >/dev/null
  mkdir -p .gpu/var/$name && cp build/var-$name/tools/hybridep .gpu/var/$name/
  echo "$name: $defs"
done
