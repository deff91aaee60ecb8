#!/usr/bin/env bash
# Builds the command and library of another revision (default: HEAD, the build before this
# change's uncommitted edits) into .gpu/prev/, so that bench/gpu_ab.sh compares it with the
# main build in the same GPU call (AB_VARIANTS="prev ..."). Run after bench/gpu_build.sh,
# which empties .gpu. Usage: bash bench/gpu_prev.sh [REV] [NAME (prev)]
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:-HEAD}
name=${2:-prev}
sha=$(git rev-parse --verify "$rev^{commit}")
tree=${TMPDIR:-/tmp}/hep-gpu-$name-$sha
[ -d "$tree" ] || git worktree add -f --detach "$tree" "$sha" >/dev/null
cmake -S "$tree" -B "$tree/build/gpu" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHEP_CUDA_ARCHS=90 \
  -DHEP_WITH_MPI=OFF -DBUILD_TESTING=OFF >/dev/null
cmake --build "$tree/build/gpu" -j"$(nproc)" --target hybridep_cli hybridep >/dev/null
rm -rf ".gpu/$name" && mkdir -p ".gpu/$name/lib"
cp "$tree/build/gpu/tools/hybridep" ".gpu/$name/"
cp -L "$tree/build/gpu/src/libhybridep.so.0.1" ".gpu/$name/lib/"
# host debug sections only (the device code keeps its line info): the call carries 64 MiB
strip --strip-debug ".gpu/$name/hybridep" ".gpu/$name/lib/libhybridep.so.0.1"
echo "$name: $(git log -1 --format='%h %s' "$sha")"
