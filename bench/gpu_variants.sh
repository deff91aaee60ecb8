#!/usr/bin/env bash
# Builds kernel variants (tuning experiments) into .gpu/var/<name>/ (the command and its
# library; run with LD_LIBRARY_PATH=.gpu/var/<name>). Reads "name defs" lines on stdin.
# VAR_SRC: the source tree to build (this one by default; bench/gpu_prev.sh passes another
# revision's), its CMake folders under VAR_SRC/build/var-<name>.
set -euo pipefail
cd "$(dirname "$0")/.."
src=${VAR_SRC:-.}
mkdir -p .gpu/var
while read -r name defs; do
  [ -z "$name" ] && continue
  cmake -S "$src" -B "$src/build/var-$name" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHEP_CUDA_ARCHS=90 \
    -DHEP_WITH_MPI=OFF -DBUILD_TESTING=OFF "-DHEP_KERNEL_DEFS=$defs" >/dev/null
  cmake --build "$src/build/var-$name" -j"$(nproc)" --target hybridep_cli hybridep >/dev/null
  rm -rf ".gpu/var/$name" && mkdir -p ".gpu/var/$name"
  cp "$src/build/var-$name/tools/hybridep" ".gpu/var/$name/"
  cp -L "$src/build/var-$name/src/libhybridep.so.0.1" ".gpu/var/$name/"
  # host debug sections only (the device code keeps its line info): a call carries 64 MiB
  strip --strip-debug ".gpu/var/$name/hybridep" ".gpu/var/$name/libhybridep.so.0.1"
  echo "$name: $defs"
done
