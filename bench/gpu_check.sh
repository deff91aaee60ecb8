#!/usr/bin/env bash
# Everything the GPU machine checks and measures, in one call. Expects the binaries built
# by bench/gpu_build.sh in .gpu/ (carried with the call). Full logs go to $OUT.
# Usage: bench/gpu_check.sh [all|test|san|bench|sweep|nodes|variants|python|mpi|stress|firstcall]...  (several modes run in order;
#   BENCH_ARGS adds options to every bench; SWEEP_SMS the SM counts of `sweep`)
#   test: the GPU tests (test_gpu_train's one-node cases again with HEP_DISPATCH_STORES=bulk,
#     TRAIN_BULK_FILTER); san: compute-sanitizer memcheck and racecheck on small cases (SAN_BINS
#     the binaries, default test_gpu_ep test_gpu_train; SAN_LIMIT seconds a run, 150;
#     SAN_TIMEOUT_MS the kernels' HEP_TIMEOUT_MS under the tools, 20000)
#   sweep: one rank (E_l = 8, K = 8) and eight ranks (bench defaults) across SM counts
#   nodes: the benches of 2 x 4 and 4 x 2 virtual nodes over the loopback NIC
#   variants: the benches of each kernel variant built by bench/gpu_variants.sh
#   python: the Python package's GPU run (python/tests/gpu_run.sh, 8 processes under torchrun,
#     with and without MPS; its summary table at the end)
#   mpi: one process per rank under mpirun -np 8 (bench/gpu_mpi.sh: builds libhybridep_mpi
#     and tests/test_gpu_mpi.c there with mpicc; correctness vs the host backend, bench, a
#     missing rank, 2 x 4 nodes across processes; with and without MPS)
#   stress: the inter-node stress (tests/stress_internode.c) on the GPU: 2 x 2, 2 x 4, 4 x 2
#     virtual nodes over the loopback NIC, STRESS_CALLS (10000) calls a shape within
#     STRESS_SECONDS (150) a shape, with HEP_DEBUG_JITTER_US=STRESS_JITTER_US (20), then
#     STRESS_SAN_CALLS (200) calls a shape under compute-sanitizer memcheck and racecheck
#     (not part of `all`: name it); STRESS_PLAIN=0 leaves the plain run out
#   train: hybridep bench --layout expert --pad-multiple 128 (TRAIN_DTYPES: bf16 fp8; the
#     training API's GPU tests run in `test`) (not part of `all`: name it)
#   profile: Nsight Compute on the one-rank dispatch and combine at PROFILE_SMS (16) SMs: the
#     speed-of-light, memory, warp-state and scheduler sections (not part of `all`: name it)
#   scatter: bench/scatter.cu, the eight-rank dispatch's row traffic as one kernel, per store
#     method at SCATTER_BLOCKS (32,64,128) blocks, BF16 and FP8, and Nsight Compute on the
#     SCATTER_PROFILE modes (plain bulk) at 128 blocks (not part of `all`: name it)
#   nodesms: the 2 x 4 and 4 x 2 benches (BF16) at NODE_SMS (8 12 16) SMs per rank: how the
#     loopback NIC's copies fare with more SMs left free (not part of `all`: name it)
#   ntrace: the timeline of the phases across nodes (NTRACE_RUNS, "nodes ranks SMs" each,
#     separated by ';', default "2 4 12;4 2 8") with the HEP_NODE_TRACE build in NTRACE_DIR
#     (.gpu/var/ntrace: printf 'ntrace HEP_NODE_TRACE\n' | bash bench/gpu_variants.sh),
#     summarized by bench/ntrace.py (not part of `all`: name it)
#   btrace: when each rank's push ends at eight ranks on the GPU (BTRACE_ARGS, bench option
#     sets separated by ';', default "--sms 16;--sms 16 --dtype fp8;--sms 8") with the
#     HEP_BLOCK_TRACE build in BTRACE_DIR (.gpu/var/btr: printf 'btr HEP_BLOCK_TRACE\n' |
#     bash bench/gpu_variants.sh), summarized by bench/btrace.py (not part of `all`: name it)
#   firstcall: FIRSTCALL_RUNS (12) fresh processes of one test_gpu_train case (FIRSTCALL_FILTER,
#     'handles_interleaved*'), HEP_TIMEOUT_MS=FIRSTCALL_TIMEOUT_MS (3000), HEP_LOG_LEVEL=debug;
#     for every run whose first call timed out, each rank's first dispatch launch times (a
#     late host launch, a launch call that blocked, a kernel the GPU started late) (not part
#     of `all`: name it; the failing runs' logs in $OUT/firstcall.txt)
#   firstlaunch: bench/first_launch.cu, FIRSTLAUNCH_RUNS (8) fresh processes of each mode
#     (warm, preloaded, cold, none, newstream, smem_warm, smem_preloaded): does a kernel's first launch hold back work launched
#     after it on other streams until the running kernels end (not part of `all`: name it)
#   repeat: REPEAT_RUNS (10) fresh processes of REPEAT_BIN (test_gpu_ep) with HEP_GPU_TEST_FILTER
#     =REPEAT_FILTER (comma-separated patterns, e.g. 'gpu_sixteen*,gpu_graph*': a case after
#     the one before it): how many failed, each failure's first lines (not part of `all`)
#   GPU_DIR: the build to run (.gpu; e.g. .gpu/ring for a second build carried beside it)
#   TEST_FILTER: cmocka patterns, comma-separated (e.g. '*huge_timeout*') for the test_gpu_ep cases `test`
#     runs; TRAIN_TEST_FILTER the same for test_gpu_train
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/gpu_unpack.sh
OUT=${OUT:-/tmp/hep-gpu}
mkdir -p "$OUT"
B=${GPU_DIR:-.gpu}
export LD_LIBRARY_PATH=$PWD/$B/lib:${LD_LIBRARY_PATH:-}
export CUDA_DEVICE_MAX_CONNECTIONS=32 PYTHONUNBUFFERED=1 HEP_TIMEOUT_MS=${HEP_TIMEOUT_MS:-5000}
MODES=" ${*:-all} "
want() { [[ "$MODES" == *" all "* || "$MODES" == *" $1 "* ]]; }
named() { [[ "$MODES" == *" $1 "* ]]; }
step() { echo; echo "=== $* ($(date +%T))"; }
{
  step "device"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
  $B/hybridep doctor
} 2>&1 | tee "$OUT/device.txt"
if want test; then
  {
    step "GPU tests (kernels vs host backend and oracle, graph replay, timeout, DMA-BUF)"
    HEP_GPU_TEST_FILTER=${TEST_FILTER:-} timeout 300 $B/test_gpu_ep
    echo "test_gpu_ep exit: $?"
    step "GPU tests of the training API (handles, caller outputs, probabilities, capacity)"
    HEP_GPU_TEST_FILTER=${TRAIN_TEST_FILTER:-} timeout 300 $B/test_gpu_train
    echo "test_gpu_train exit: $?"
    step "the training API's one-node cases with the bulk-store dispatch kernel forced (handles, capacity, drops)"
    HEP_DISPATCH_STORES=bulk HEP_GPU_TEST_FILTER=${TRAIN_BULK_FILTER:-'handles*,capacity*,no_sync*,graph_replays*'} \
      timeout 300 $B/test_gpu_train
    echo "test_gpu_train (bulk) exit: $?"
  } > "$OUT/test.txt" 2>&1
  grep -vE '^\[ *(RUN|OK) \]|unavailable; using DMA-BUF' "$OUT/test.txt" | tail -60
fi
if want san; then
  {
    # the kernels run many times slower under the tools: HEP_TIMEOUT_MS SAN_TIMEOUT_MS (20000)
    for bin in ${SAN_BINS:-test_gpu_ep test_gpu_train}; do
      for tool in memcheck racecheck; do
        step "compute-sanitizer $tool $bin (small cases)"
        leak=; [ $tool = memcheck ] && leak="--leak-check full"
        HEP_GPU_TEST_SMALL=1 HEP_TIMEOUT_MS=${SAN_TIMEOUT_MS:-20000} timeout ${SAN_LIMIT:-150} \
          compute-sanitizer --tool $tool $leak $B/$bin
        echo "compute-sanitizer $tool $bin exit: $?"
      done
    done
  } > "$OUT/sanitizer.txt" 2>&1
  # every binary's summary (a run cut by the call's bound still shows the earlier ones)
  grep -E "===|SUMMARY|FAILED|PASSED|exit" "$OUT/sanitizer.txt" | grep -v "^=== *$" | head -60
fi
if want sweep; then
  {
    step "one rank: hybridep bench --ranks-per-node 1 --experts-per-rank 8 --topk 8 --sweep-sms ${SWEEP_SMS:-8,16,24,32,48,64,96,128,132}"
    $B/hybridep bench --ranks-per-node 1 --experts-per-rank 8 --topk 8 \
      --sweep-sms "${SWEEP_SMS:-8,16,24,32,48,64,96,128,132}" --json-file "$OUT/sweep1.json" ${BENCH_ARGS:-}
    step "one rank, T = 16384: hybridep bench --ranks-per-node 1 --experts-per-rank 8 --topk 8 --tokens 16384 --sms 24"
    $B/hybridep bench --ranks-per-node 1 --experts-per-rank 8 --topk 8 --tokens 16384 --sms 24 ${BENCH_ARGS:-}
    step "eight ranks: hybridep bench --sweep-sms 4,8,12,16"
    $B/hybridep bench --sweep-sms 4,8,12,16 --json-file "$OUT/sweep8.json" ${BENCH_ARGS:-}
  } 2>&1 | tee "$OUT/sweep.txt" | grep -vE '^\[bench\]'
fi
if want variants; then
  {
    for v in $B/var/*/; do
      v=${v%/}
      step "variant $(basename "$v"): hybridep bench (bf16, fp8) and one rank at 24 SMs"
      LD_LIBRARY_PATH=$v:$LD_LIBRARY_PATH $v/hybridep bench ${BENCH_ARGS:-}
      LD_LIBRARY_PATH=$v:$LD_LIBRARY_PATH $v/hybridep bench --dtype fp8 ${BENCH_ARGS:-}
      LD_LIBRARY_PATH=$v:$LD_LIBRARY_PATH $v/hybridep bench --ranks-per-node 1 --experts-per-rank 8 --topk 8 --sms 24 ${BENCH_ARGS:-}
    done
  } 2>&1 | tee "$OUT/variants.txt" | grep -E '^===|^(preprocess|layout|dispatch|combine)|verified|rror|timed out'
fi
if want bench; then
  {
    for dt in bf16 fp8; do
      step "hybridep bench --dtype $dt ${BENCH_ARGS:-}"
      $B/hybridep bench --dtype $dt --dump-routing /tmp/routing_$dt.bin \
        --json-file /tmp/bench_$dt.json ${BENCH_ARGS:-}
      step "torch baseline, same routing ($dt)"
      python3 bench/torch_baseline.py /tmp/routing_$dt.bin --ours /tmp/bench_$dt.json 2>&1
    done
  } 2>&1 | tee "$OUT/bench.txt" | grep -vE '^\[bench\]'
fi
if want nodes; then
  {
    for shape in "2 4" "4 2"; do
      set -- $shape
      for dt in bf16 fp8; do
        step "hybridep bench --nodes $1 --ranks-per-node $2 --dtype $dt ${BENCH_ARGS:-}"
        HEP_GPU_MR_MODE=dmabuf HEP_LOG_LEVEL=warn $B/hybridep bench --nodes "$1" \
          --ranks-per-node "$2" --dtype $dt --json-file "/tmp/bench_n$1_$dt.json" ${BENCH_ARGS:-}
      done
    done
  } 2>&1 | tee "$OUT/bench_nodes.txt" | grep -vE '^\[bench\]'
fi
if named nodesms; then
  {
    for shape in "2 4" "4 2"; do
      set -- $shape
      for sms in ${NODE_SMS:-8 12 16}; do
        step "hybridep bench --nodes $1 --ranks-per-node $2 --sms $sms ${BENCH_ARGS:-}"
        HEP_GPU_MR_MODE=dmabuf HEP_LOG_LEVEL=warn $B/hybridep bench --nodes "$1" \
          --ranks-per-node "$2" --sms "$sms" ${BENCH_ARGS:-}
      done
    done
  } > "$OUT/bench_nodesms.txt" 2>&1
  grep -E '^===|^(dispatch|combine) |verified|loopback copies|rror|timed out' "$OUT/bench_nodesms.txt"
fi
if named ntrace; then
  # the timeline of the phases across nodes (a HEP_NODE_TRACE build, bench/ntrace.py)
  T=${NTRACE_DIR:-.gpu/var/ntrace}
  IFS=';' read -ra runs <<< "${NTRACE_RUNS:-2 4 12;4 2 8}"
  for run in "${runs[@]}"; do
    set -- $run
    step "trace: hybridep bench --nodes $1 --ranks-per-node $2 --sms $3 ${BENCH_ARGS:-}"
    HEP_GPU_MR_MODE=dmabuf HEP_LOG_LEVEL=warn LD_LIBRARY_PATH=$T:$LD_LIBRARY_PATH $T/hybridep \
      bench --nodes "$1" --ranks-per-node "$2" --sms "$3" ${BENCH_ARGS:-} \
      > "$OUT/ntrace_$1x$2.txt" 2>&1
    grep -E '^(dispatch|combine) |verified|loopback copies|rror|timed out' "$OUT/ntrace_$1x$2.txt"
    python3 bench/ntrace.py < "$OUT/ntrace_$1x$2.txt"
  done
fi
if named btrace; then
  # the spread of the ranks' push ends (a HEP_BLOCK_TRACE build, bench/btrace.py); the
  # trace build prints a line a block and call, so its phase times are not the library's
  T=${BTRACE_DIR:-.gpu/var/btr}
  IFS=';' read -ra runs <<< "${BTRACE_ARGS:---sms 16;--sms 16 --dtype fp8;--sms 8}"
  for i in "${!runs[@]}"; do
    step "block trace: hybridep bench --iters 7 --warmup 2 ${runs[$i]}"
    LD_LIBRARY_PATH=$T:$LD_LIBRARY_PATH $T/hybridep bench --iters 7 --warmup 2 ${runs[$i]} \
      > "$OUT/btrace_$i.txt" 2>&1
    grep -E '^(dispatch|combine) |verified|rror|timed out' "$OUT/btrace_$i.txt"
    python3 bench/btrace.py < "$OUT/btrace_$i.txt"
  done
fi
# the stall reasons, cycles a warp waits per issued instruction on each (Nsight Compute)
STALLS='^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$'
if named profile; then
  {
    # Nsight Compute on one rank (profiling serializes kernels: co-dependent ranks cannot
    # meet under it): where the dispatch and combine warps wait, at PROFILE_SMS (16) SMs
    NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
    if [ -z "$NCU" ]; then
      echo "profile: no ncu on this machine: not profiled"
    else
      for k in k_dispatch k_combine; do
        step "ncu $k: hybridep bench --ranks-per-node 1 --experts-per-rank 8 --topk 8 --sms ${PROFILE_SMS:-16}"
        # past group creation's warm-up launches (one block each, returning at once)
        timeout 240 "$NCU" --kernel-name "regex:$k" --launch-skip 24 --launch-count 1 \
          --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
          --section SchedulerStats --section Occupancy --section LaunchStats \
          --metrics "regex:$STALLS" \
          $B/hybridep bench --ranks-per-node 1 --experts-per-rank 8 --topk 8 \
          --sms "${PROFILE_SMS:-16}" --iters 20 --warmup 10
        echo "ncu $k exit: $?"
      done
    fi
  } > "$OUT/profile.txt" 2>&1
  grep -E "^===|exit|Throughput|Stall|stalled|Warp Cycles|Issued|Eligible|Active Warps|Duration|Grid Size|not profiled" \
    "$OUT/profile.txt" | head -120
fi
if named scatter; then
  {
    # bench/scatter.cu: the eight-rank dispatch's row traffic as one kernel (no layout, no
    # flags), against the same blocks' copy; then where its warps wait (Nsight Compute)
    step "scatter: BF16 rows, SCATTER_BLOCKS (${SCATTER_BLOCKS:-32,64,128}) blocks"
    "$B/scatter" --blocks "${SCATTER_BLOCKS:-32,64,128}" --iters 20
    step "scatter: FP8 rows"
    "$B/scatter" --blocks "${SCATTER_BLOCKS:-32,64,128}" --iters 20 --esize 1
    NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
    for m in ${SCATTER_PROFILE-plain bulk}; do
      [ -n "$NCU" ] || { echo "scatter: no ncu on this machine: not profiled"; break; }
      step "ncu scatter $m, 128 blocks"
      timeout 120 "$NCU" --kernel-name regex:k_scatter --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        --metrics "regex:$STALLS" "$B/scatter" --blocks 128 --modes "$m" --iters 3
      echo "ncu scatter $m exit: $?"
    done
  } > "$OUT/scatter.txt" 2>&1
  grep -E "^===|^scatter|^mode|^[a-z0-9]+ +[0-9]+ +[0-9.]+ |exit|Throughput|Duration|stalled" \
    "$OUT/scatter.txt" | head -150
fi
if want mpi; then
  step "mpirun -np 8: the GPU backend, one process per rank (CUDA IPC), with and without MPS"
  timeout ${MPI_SCRIPT_TIMEOUT:-560} bash bench/gpu_mpi.sh > "$OUT/mpi.txt" 2>&1
  echo "gpu_mpi.sh exit: $?"
  sed -n '/^=== mpirun summary/,$p' "$OUT/mpi.txt"
  grep -q '^=== mpirun summary' "$OUT/mpi.txt" || tail -30 "$OUT/mpi.txt"
fi
if named train; then
  {
    for dt in ${TRAIN_DTYPES:-bf16 fp8}; do
      step "hybridep bench --layout expert --pad-multiple 128 --dtype $dt ${BENCH_ARGS:-}"
      timeout 120 $B/hybridep bench --layout expert --pad-multiple 128 --dtype $dt ${BENCH_ARGS:-}
    done
  } > "$OUT/train.txt" 2>&1
  grep -vE '^\[ *(RUN|OK) \]|^\[bench\]' "$OUT/train.txt" | tail -70
fi
if want python; then
  step "python package on the GPU (8 processes, with and without MPS)"
  HEP_BUILD_DIR=$B timeout ${PY_TIMEOUT:-560} bash python/tests/gpu_run.sh > "$OUT/python.txt" 2>&1
  echo "gpu_run.sh exit: $?"
  sed -n '/^=== python summary/,$p' "$OUT/python.txt"
  grep -q '^=== python summary' "$OUT/python.txt" || tail -30 "$OUT/python.txt"
fi
if named stress; then
  {
    J=${STRESS_JITTER_US:-20}
    if [ "${STRESS_PLAIN:-1}" != 0 ]; then
      step "stress_internode gpu: ${STRESS_CALLS:-10000} calls a shape, HEP_DEBUG_JITTER_US=$J"
      HEP_GPU_MR_MODE=dmabuf HEP_LOG_LEVEL=warn HEP_DEBUG_JITTER_US=$J \
        HEP_STRESS_CALLS=${STRESS_CALLS:-10000} HEP_STRESS_SECONDS=${STRESS_SECONDS:-150} \
        timeout 540 $B/stress_internode gpu
      echo "stress_internode gpu exit: $?"
    fi
    for tool in memcheck racecheck; do
      step "compute-sanitizer $tool stress_internode gpu: ${STRESS_SAN_CALLS:-200} calls a shape"
      HEP_GPU_MR_MODE=dmabuf HEP_LOG_LEVEL=warn HEP_DEBUG_JITTER_US=$J HEP_TIMEOUT_MS=20000 \
        HEP_STRESS_CALLS=${STRESS_SAN_CALLS:-200} HEP_STRESS_SECONDS=${STRESS_SAN_SECONDS:-60} \
        timeout ${STRESS_SAN_LIMIT:-250} compute-sanitizer --tool $tool $B/stress_internode gpu
      echo "compute-sanitizer $tool exit: $?"
    done
  } > "$OUT/stress.txt" 2>&1
  grep -E "^===|^stress|exit|FAILED|timed out|SUMMARY|differ" "$OUT/stress.txt" | tail -30
fi
if named repeat; then
  (
  runs=${REPEAT_RUNS:-10} bin=${REPEAT_BIN:-test_gpu_ep} filter=${REPEAT_FILTER:-} failed=0
  [ -n "$filter" ] || { echo "repeat: set REPEAT_FILTER (e.g. 'gpu_graph*')"; exit 0; }
  for i in $(seq 1 "$runs"); do
    log=/tmp/hep_repeat_run.txt
    HEP_GPU_TEST_FILTER=$filter timeout 200 "$B/$bin" > "$log" 2>&1
    rc=$?
    [ $rc = 0 ] && continue
    failed=$((failed + 1))
    echo "run $i: exit $rc:"
    grep -E "FAILED  \\]|timed out|differ|rows vs" "$log" | head -4 | cut -c1-300
    { echo "=== run $i (exit $rc)"; cat "$log"; } >> "$OUT/repeat.txt"
  done
  echo "repeat: $bin '$filter': $failed of $runs runs failed"
  )
fi
if named firstcall; then
  # the first call of a fresh process, again and again: for every run whose first call timed
  # out, each rank's first dispatch launch ("launching" / "launched", HEP_LOG_LEVEL=debug)
  # relative to the earliest rank's (the settings in a subshell: later modes keep theirs)
  (
  export HEP_LOG_LEVEL=debug HEP_TIMEOUT_MS=${FIRSTCALL_TIMEOUT_MS:-3000}
  runs=${FIRSTCALL_RUNS:-12} filter=${FIRSTCALL_FILTER:-handles_interleaved*} failed=0 ran=0
  for i in $(seq 1 "$runs"); do
    log=/tmp/hep_firstcall_run.txt
    HEP_GPU_TEST_FILTER=$filter timeout 60 "$B/test_gpu_train" > "$log" 2>&1
    rc=$?
    if [ $rc = 77 ]; then
      echo "firstcall: test_gpu_train skipped (exit 77: $(tail -1 "$log" | cut -c1-160))"
      break
    fi
    ran=$i
    if grep -q "timed out" "$log" || [ $rc != 0 ]; then
      failed=$((failed + 1))
      if grep -q "timed out" "$log"; then
        echo "run $i: exit $rc, the first call timed out:"
        grep -m2 "timed out" "$log" | cut -c1-220
      else
        echo "run $i: exit $rc, failed without a timeout:"
        grep -m2 -E "FAILED|ERROR|differ" "$log" | cut -c1-220
      fi
      # each rank's first dispatch: "launching" and "launched" lines, relative to the earliest
      awk '/debug: rank [0-9]+: dispatch call 1: kernel (launching|launched)/ {
             r = $4; sub(":", "", r); t = $(NF - 1) + 0
             if ($9 == "launching" && !(r in a)) a[r] = t
             if ($9 == "launched" && !(r in d)) d[r] = t
             if (!n++ || t < t0) t0 = t
           }
           END { for (r in a) printf "  rank %s: launching at +%.3f ms, launched at +%.3f ms\n",
                                     r, a[r] - t0, (r in d ? d[r] : a[r]) - t0 }' "$log" | sort -k2n
      { echo "=== run $i, exit $rc"; cat "$log"; } >> "$OUT/firstcall.txt"
    fi
  done
  echo "first call of a fresh process ($filter, HEP_TIMEOUT_MS=$HEP_TIMEOUT_MS): $failed of $ran runs failed"
  )
fi
if named firstlaunch; then
  for mode in warm preloaded cold none newstream smem_warm smem_preloaded; do
    seen=0
    for i in $(seq 1 "${FIRSTLAUNCH_RUNS:-8}"); do
      "$B/first_launch" $mode >> "$OUT/firstlaunch.txt" 2>&1 && seen=$((seen + 1))
    done
    echo "first_launch $mode: the flag seen in $seen of ${FIRSTLAUNCH_RUNS:-8} fresh processes"
  done
  tail -4 "$OUT/firstlaunch.txt"
fi
