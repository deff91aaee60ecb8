#!/usr/bin/env bash
# A/B of kernel builds in one call: the main build (.gpu) against each variant built by
# bench/gpu_variants.sh (.gpu/var/<name>), AB_ROUNDS (2) rounds, builds alternating, so that
# the GPU's state drifts over all of them alike. Prints one table row per (build, bench).
# AB_VARIANTS: the variant names (default: every .gpu/var/* without "trace" in its name);
# AB_SWEEP1: the one-rank SM counts (16,132). A name may also be a whole second build carried
# as .gpu/<name> (bench/gpu_build.sh of another branch, its library in .gpu/<name>/lib), or
# env:VAR=value, the main build run with that setting (e.g. env:HEP_DISPATCH_STORES=plain), or
# NAME:VAR=value, build NAME run with it (e.g. rg:HEP_DISPATCH_STORES=bulk).
# AB_SET=nodes runs the 2 x 4 and 4 x 2 loopback benches instead (BF16, --sms 8 and 12 (16 leaves
# the loopback copies 4 free SMs: 2-3x slower, noise), and
# AB_NODE_ARGS, default "--chunk 0", more sets separated by ';' (e.g. "--chunk 0;--chunk 2048"),
# each where the build has its option: one extra row set each, at 12 SMs). AB_SET=one: the
# one-rank sweep only. Trace builds (HEP_LAYOUT_TRACE) run once each, their cycle lines printed.
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/gpu_unpack.sh
OUT=${OUT:-/tmp/hep-gpu}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.gpu/lib:${LD_LIBRARY_PATH:-}
node_args=${AB_NODE_ARGS-"--chunk 0"}
names=${AB_VARIANTS:-$(ls .gpu/var 2>/dev/null | grep -v trace | tr '\n' ' ')}
run() { # build-dir label args...
  local dir=$1 label=$2 setting=; shift 2
  [[ "$label" == *:*=* ]] && setting=${label#*:}
  local json=; [[ "$*" == *--sweep-sms* ]] && json="--json-file $OUT/ab_last.json"
  rm -f "$OUT/ab_last.json"
  env $setting LD_LIBRARY_PATH=$dir:$dir/lib:$LD_LIBRARY_PATH timeout 120 $dir/hybridep bench "$@" $json > "$OUT/ab_last.txt" 2>&1
  local rc=$?
  echo "== $label $*" >> "$OUT/ab.txt"; cat "$OUT/ab_last.txt" >> "$OUT/ab.txt"
  awk -v l="$label" '/^ *[0-9]+ +[0-9]+ +[0-9.]+ /{printf "%-8s %s\n", l, $0}
                     /^(dispatch|combine)/{printf "%-8s %s\n", l, $0}' "$OUT/ab_last.txt"
  # the sweep's layout step in us (the table rounds it to 1 us)
  [ -s "$OUT/ab_last.json" ] && python3 -c 'import json,sys
rows = json.load(open(sys.argv[1]))["sweep"]
print("%-8s layout us: " % sys.argv[2] + " ".join("%d SMs %.2f" % (r["sms_per_rank"], r["layout_ms"] * 1e3) for r in rows if "layout_ms" in r))' "$OUT/ab_last.json" "$label"
  [ $rc = 0 ] && grep -q verified "$OUT/ab_last.txt" ||
    { echo "$label: exit $rc, not verified:"; tail -5 "$OUT/ab_last.txt"; }
}
for r in $(seq 1 "${AB_ROUNDS:-2}"); do
  echo "--- round $r ($(date +%T))"
  for n in base $names; do
    b=${n%%:*}; [ "$b" = env ] && b=base
    d=.gpu; [ "$b" = base ] || d=.gpu/var/$b; [ -d "$d" ] || d=.gpu/$b
    if [ "${AB_SET:-kernels}" = nodes ]; then
      for shape in "2 4" "4 2"; do
        set -- $shape
        for sms in 8 12; do
          HEP_GPU_MR_MODE=dmabuf HEP_LOG_LEVEL=warn run $d "$n" --nodes $1 --ranks-per-node $2 --sms $sms
        done
        IFS=';' read -ra sets <<< "$node_args"
        for extra in "${sets[@]}"; do
          [ -n "$extra" ] && "$d/hybridep" bench --help 2>&1 | grep -q -- "${extra%% *}" &&
            HEP_GPU_MR_MODE=dmabuf HEP_LOG_LEVEL=warn run $d "$n" --nodes $1 --ranks-per-node $2 --sms 12 $extra
        done
      done
      continue
    fi
    run $d "$n" --ranks-per-node 1 --experts-per-rank 8 --topk 8 --sweep-sms "${AB_SWEEP1:-16,132}"
    [ "${AB_SET:-kernels}" = one ] && continue
    run $d "$n" --sweep-sms 8,16
    run $d "$n" --dtype fp8 --sweep-sms 16
  done
done
# (the layout trace builds' one-rank runs; AB_SET=nodes leaves them out: a HEP_NODE_TRACE
# build is for bench/gpu_check.sh ntrace)
[ "${AB_SET:-kernels}" = nodes ] && exit 0
for t in $(ls .gpu/var 2>/dev/null | grep trace); do
  for args in "--ranks-per-node 1 --experts-per-rank 8 --topk 8 --sms 132" \
              "--ranks-per-node 1 --experts-per-rank 8 --topk 8 --sms 132 --tokens 512" \
              "--ranks-per-node 1 --experts-per-rank 8 --topk 8 --sms 16" ""; do
    echo "--- $t: bench $args --iters 4"
    LD_LIBRARY_PATH=.gpu/var/$t:$LD_LIBRARY_PATH .gpu/var/$t/hybridep bench $args --iters 4 \
      > "$OUT/ab_trace.txt" 2>&1
    grep LTRACE "$OUT/ab_trace.txt" | tail -4
  done
done
