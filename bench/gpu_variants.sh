#!/usr/bin/env bash
# Builds kernel variants (tuning experiments) into .gpu/var/<name>/ (the command and its
# library; run with LD_LIBRARY_PATH=.gpu/var/<name>). Reads "name defs" lines on stdin.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu/var
while read -r name defs; do
  [ -z "$name" ] && continue
  cmake -S . -B build/var-$name -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHEP_CUDA_ARCHS=90 \
    -DHEP_WITH_MPI=OFF -DBUILD_TESTING=OFF "-DHEP_KERNEL_DEFS=$defs" >/dev/null
  cmake --build build/var-$name -j"$(nproc)" --target hybridep_cli hybridep >/dev/null
  mkdir -p .gpu/var/$name && cp build/var-$name/tools/hybridep .gpu/var/$name/
  cp -L build/var-$name/src/libhybridep.so.0.1 .gpu/var/$name/
  strip --strip-debug .gpu/var/$name/hybridep .gpu/var/$name/libhybridep.so.0.1
  echo "$name: $defs"
done
