#!/usr/bin/env bash
# The first call of a fresh process, again and again (bench/RESULTS.md, session 8: one rank's
# dispatch kernel of the first call can start after the others gave up). Runs FIRSTCALL_RUNS
# (12) fresh processes of one test_gpu_train case (FIRSTCALL_FILTER, default
# 'handles_interleaved*') with HEP_LOG_LEVEL=debug and HEP_TIMEOUT_MS=FIRSTCALL_TIMEOUT_MS
# (3000), and for every run whose first call timed out prints, per rank, when its first
# dispatch kernel was being handed to CUDA and when that call returned (ms after the
# earliest rank's), so that a late host launch, a launch call that blocked, and a kernel the
# GPU started late can be told apart. GPU_DIR: the build (.gpu). Logs in $OUT/firstcall_*.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hep-gpu}
mkdir -p "$OUT"
B=${GPU_DIR:-.gpu}
export LD_LIBRARY_PATH=$PWD/$B/lib:${LD_LIBRARY_PATH:-}
export CUDA_DEVICE_MAX_CONNECTIONS=32 HEP_LOG_LEVEL=debug
export HEP_TIMEOUT_MS=${FIRSTCALL_TIMEOUT_MS:-3000}
runs=${FIRSTCALL_RUNS:-12} filter=${FIRSTCALL_FILTER:-handles_interleaved*} failed=0
for i in $(seq 1 "$runs"); do
  log=$OUT/firstcall_$i.txt
  HEP_GPU_TEST_FILTER=$filter timeout 60 "$B/test_gpu_train" > "$log" 2>&1
  rc=$?
  if grep -q "timed out" "$log" || [ $rc != 0 ]; then
    failed=$((failed + 1))
    echo "run $i: exit $rc, the first call timed out:"
    grep -m2 "timed out" "$log" | cut -c1-220
    # each rank's first dispatch: "launching" and "launched" lines, relative to the earliest
    awk '/debug: rank [0-9]+: dispatch call 1: kernel (launching|launched)/ {
           r = $4; sub(":", "", r); t = $(NF - 1) + 0
           if ($9 == "launching" && !(r in a)) a[r] = t
           if ($9 == "launched" && !(r in d)) d[r] = t
           if (!n++ || t < t0) t0 = t
         }
         END { for (r in a) printf "  rank %s: launching at +%.3f ms, launched at +%.3f ms\n",
                                   r, a[r] - t0, (r in d ? d[r] : a[r]) - t0 }' "$log" | sort -k2n
  else
    rm -f "$log"
  fi
done
echo "first call of a fresh process ($filter, HEP_TIMEOUT_MS=$HEP_TIMEOUT_MS): $failed of $runs runs timed out"
