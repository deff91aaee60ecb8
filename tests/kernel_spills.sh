#!/bin/sh
# Every kernel instance compiles for sm_90 without register spills (ptxas -v), so that a change
# that makes a kernel spill shows here, and not first as a slower bench on the GPU machine.
# A known spill is allowed by a line "mangled-name max-store-bytes max-load-bytes" in
# tests/kernel_spills.allow, with a comment above it saying why. It also holds each instance's
# static shared memory to HEP_STATIC_SMEM_BOUND (kernels/probe.cu), the room hep_allow_smem
# leaves it under the device's opt-in limit.
# Usage: kernel_spills.sh NVCC SOURCE_DIR
set -u
nvcc=$1 src=$2
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT
allow="$src/tests/kernel_spills.allow"
bound=$(sed -n 's/^#define HEP_STATIC_SMEM_BOUND \([0-9][0-9]*\).*/\1/p' "$src/src/kernels/probe.cu")
[ -n "$bound" ] || { echo "no HEP_STATIC_SMEM_BOUND in src/kernels/probe.cu"; exit 1; }
fail=0
for f in "$src"/src/kernels/*.cu; do
  if ! "$nvcc" -arch=sm_90 -O3 -std=c++17 -I"$src/src" -I"$src/include" -cubin -Xptxas -v \
      -o "$tmp/k.cubin" "$f" > "$tmp/log" 2>&1; then
    echo "FAILED to compile: $f"; cat "$tmp/log"; fail=1; continue
  fi
  awk -v file="${f##*/}" -v allow="$allow" -v bound="$bound" '
    BEGIN { while ((getline l < allow) > 0) if (l !~ /^#/ && split(l, a, " ") == 3) {
              ok_s[a[1]] = a[2]; ok_l[a[1]] = a[3] } }
    /Compiling entry function/ { split($0, p, "\047"); name = p[2]; want = 1; next }
    want && /spill stores/ {
      s = $0; sub(/.*frame, /, "", s); split(s, q, " "); st = q[1] + 0; ld = q[5] + 0; want = 0
      lim_s = (name in ok_s) ? ok_s[name] + 0 : 0; lim_l = (name in ok_l) ? ok_l[name] + 0 : 0
      if (st > lim_s || ld > lim_l) {
        printf "SPILLS: %s %s: %d bytes of spill stores, %d of loads (allowed %d, %d)\n",
               file, name, st, ld, lim_s, lim_l; bad = 1
      } else
        printf "ok: %s %s: %d / %d bytes of spill stores / loads\n", file, name, st, ld
    }
    / bytes smem/ { m = $0; sub(/ bytes smem.*/, "", m); sub(/.* /, "", m)
      if (m + 0 > bound + 0) {
        printf "STATIC SMEM: %s %s: %d bytes (bound %d)\n", file, name, m, bound; bad = 1 } }
    END { exit bad }' "$tmp/log" || fail=1
  # The bulk dispatch's stages (dynamic shared memory) start where the kernel's static shared
  # memory ends, rounded up to that section's alignment: 128 (hep_stage's), so that a few
  # bytes of static shared memory more never leave the bulk copies' stages off 128-byte lines
  # (a variant 16 bytes off was 70% slower at one rank, 16 SMs: bench/NOTES.md, session 21).
  if [ "${f##*/}" = dispatch_bulk.cu ]; then
    readelf -SW "$tmp/k.cubin" 2>/dev/null | awk '
      function hex(h,  i, v) { v = 0; for (i = 1; i <= length(h); i++)
                                 v = v * 16 + index("0123456789abcdef", substr(h, i, 1)) - 1
                               return v }
      /\.nv\.shared\..*k_dispatch/ { n++; al = $NF + 0; sz = hex(tolower($(NF - 5)))
        if (al < 128 || sz % 128) { printf "STAGE ALIGNMENT: %s: align %d, size %d\n", $0, al, sz; bad = 1 } }
      END { if (!n) { print "STAGE ALIGNMENT: no k_dispatch_bulk shared section (readelf?)"; bad = 1 }
            else if (!bad) printf "ok: dispatch_bulk.cu: %d instances'"'"' stages on 128-byte lines\n", n
            exit bad }' || fail=1
  fi
done
exit $fail
