#!/usr/bin/env bash
# Builds what bench/gpu_check.sh runs (sm_90 only, no MPI) into .gpu/, with the one shared
# library the GPU machine lacks (cmocka), so the device call carries a ready build.
set -euo pipefail
cd "$(dirname "$0")/.."
# GPU_BUILD_DEFS: compile definitions of the whole build, host and kernels (a tuning build
# of another HEP_RING_POSITIONS, e.g. GPU_BUILD_DEFS="HEP_RING_POSITIONS=4"; move .gpu aside
# after),
# GPU_BUILD_DIR: its CMake folder (build/gpu; another keeps the main build's objects),
# GPU_BUILD_DEBUG=1: keep the host debug sections
defs=${GPU_BUILD_DEFS:-}
dir=${GPU_BUILD_DIR:-build/gpu}
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHEP_CUDA_ARCHS=90 -DHEP_WITH_MPI=OFF \
  -DBUILD_TESTING=ON -DCMAKE_C_FLAGS="${defs:+-D${defs// / -D}}" \
  -DCMAKE_CUDA_FLAGS="${defs:+-D${defs// / -D}}" >/dev/null
cmake --build "$dir" -j"$(nproc)" --target hybridep_cli hybridep test_gpu_ep test_gpu_train stress_internode >/dev/null
rm -rf .gpu && mkdir -p .gpu/lib .gpu/src
cp "$dir"/tools/hybridep "$dir"/tests/test_gpu_ep "$dir"/tests/test_gpu_train \
  "$dir"/tests/stress_internode .gpu/
# the command links libhybridep.so (found through LD_LIBRARY_PATH=.gpu/lib there); the
# Python package's GPU run takes the library from .gpu/src (HEP_BUILD_DIR=.gpu)
cp -L "$dir"/src/libhybridep.so.0.1 .gpu/lib/
cp -L "$dir"/src/libhybridep.so.0.1 .gpu/src/libhybridep.so
cp -L "$(ldconfig -p | awk '/libcmocka.so.0 /{print $NF; exit}')" .gpu/lib/
# the first-launch experiment of bench/gpu_check.sh firstlaunch (not part of the library)
"${CUDACXX:-/usr/local/cuda/bin/nvcc}" -O2 -gencode=arch=compute_90,code=sm_90 \
  -o .gpu/first_launch bench/first_launch.cu
# the row-traffic experiment of bench/gpu_check.sh scatter
"${CUDACXX:-/usr/local/cuda/bin/nvcc}" -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -diag-suppress 128 \
  -Isrc -o .gpu/scatter bench/scatter.cu
# host debug sections out (the device code keeps its line info): a call carries 64 MiB in
# all, with variants (bench/gpu_variants.sh) and a baseline (bench/gpu_prev.sh) beside it
[ -n "${GPU_BUILD_DEBUG:-}" ] || strip --strip-debug .gpu/hybridep .gpu/test_gpu_ep \
  .gpu/test_gpu_train .gpu/stress_internode .gpu/lib/libhybridep.so.0.1 .gpu/src/libhybridep.so
du -sh .gpu
