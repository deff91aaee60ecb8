#!/usr/bin/env bash
# Packs .gpu (bench/gpu_build.sh, gpu_variants.sh, gpu_prev.sh) into one gzip archive,
# .gpu/pack.tgz, so that a call carries a main build, its tests and several variants within
# the 64 MiB a call carries (a library compresses about 3:1). bench/gpu_check.sh and
# bench/gpu_ab.sh unpack it on the GPU machine (bench/gpu_unpack.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .gpu ] || { echo "gpu_pack.sh: no .gpu (run bench/gpu_build.sh first)" >&2; exit 1; }
[ -f .gpu/pack.tgz ] && { echo "gpu_pack.sh: .gpu is packed already" >&2; exit 1; }
tmp=$(mktemp "${TMPDIR:-/tmp}/hep-gpu-pack.XXXXXX")
tar czf "$tmp" -C .gpu .
rm -rf .gpu && mkdir .gpu && mv "$tmp" .gpu/pack.tgz
echo "packed: $(du -b .gpu/pack.tgz | cut -f1) bytes"
