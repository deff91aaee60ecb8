#!/usr/bin/env bash
# Builds what bench/gpu_check.sh runs (sm_90 only, no MPI) into .gpu/, with the one shared
# library the GPU machine lacks (cmocka), so the device call carries a ready build.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build/gpu -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHEP_CUDA_ARCHS=90 -DHEP_WITH_MPI=OFF >/dev/null
cmake --build build/gpu -j"$(nproc)" --target hybridep_cli test_gpu_ep >/dev/null
rm -rf .gpu && mkdir -p .gpu/lib
cp build/gpu/tools/hybridep build/gpu/tests/test_gpu_ep .gpu/
cp -L "$(ldconfig -p | awk '/libcmocka.so.0 /{print $NF; exit}')" .gpu/lib/
du -sh .gpu
