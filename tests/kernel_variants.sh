#!/bin/sh
# The kernel tuning variants of bench/NOTES.md (HEP_KERNEL_DEFS, bench/gpu_variants.sh) and the
# row-traffic experiment bench/scatter.cu still compile, warnings as errors, so an A/B on the
# GPU machine never starts with a broken build.
# Usage: kernel_variants.sh NVCC SOURCE_DIR
set -u
nvcc=$1 src=$2
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT
fail=0
for v in "dispatch_bulk.cu HEP_STRIDED_TOKENS" "dispatch_bulk.cu HEP_LAYOUT_TRACE" \
         "dispatch.cu DISPATCH_GRAB=0" "dispatch_bulk.cu DISPATCH_GRAB=1" \
         "dispatch.cu DISPATCH_RGRAB=0" "dispatch_bulk.cu DISPATCH_RGRAB=1" \
         "dispatch_bulk.cu BULK_PIPE=0" "dispatch_bulk.cu BULK_NS=5 BULK_CH=2048" \
         "dispatch.cu HEP_BLOCK_TRACE" "dispatch.cu NODES_RGRAB=0" "dispatch.cu NODES_FGRAB=0" \
         "dispatch.cu HEP_STREAMING_STORES" "dispatch.cu HEP_LAYOUT_TRACE" "dispatch.cu DU=8" \
         "dispatch.cu HEP_LAYOUT_TRACE HEP_LAYOUT_PROBE" "dispatch.cu HEP_LAYOUT_TRACE HEP_LAYOUT_TWICE" \
         "dispatch.cu MASK_MAGIC=1" "dispatch_bulk.cu MASK_MAGIC=1" \
         "combine.cu HEP_STATIC_TOKENS" "combine.cu HEP_STREAMING_LOADS" "combine.cu COMBINE_CD=2" \
         "dispatch.cu HEP_NODE_TRACE" "combine.cu HEP_NODE_TRACE" "node_pack.cu HEP_NODE_TRACE" \
         "dispatch.cu HEP_NO_TOKEN_TAIL" "dispatch_bulk.cu HEP_NO_TOKEN_TAIL"; do
  set -- $v
  f=$1; shift
  defs=$(for d in "$@"; do printf -- '-D%s ' "$d"; done) # one file, its definitions
  if "$nvcc" -arch=sm_90 -O3 -std=c++17 -I"$src/src" -I"$src/include" -cubin $defs \
      --Werror all-warnings -o "$tmp/k.cubin" "$src/src/kernels/$f" > "$tmp/log" 2>&1; then
    echo "ok: $f $defs"
  else
    echo "FAILED: $f $defs"; cat "$tmp/log"; fail=1
  fi
done
# bench/scatter.cu, the row-traffic experiment (it includes the library's kernels/vec.cuh);
# its bulk modes leave the plain modes' store loop unreachable by design (-diag-suppress 128)
if "$nvcc" -arch=sm_90 -O3 -std=c++17 -I"$src/src" -cubin -diag-suppress 128 \
    --Werror all-warnings -o "$tmp/k.cubin" "$src/bench/scatter.cu" > "$tmp/log" 2>&1; then
  echo "ok: bench/scatter.cu"
else
  echo "FAILED: bench/scatter.cu"; cat "$tmp/log"; fail=1
fi
exit $fail
