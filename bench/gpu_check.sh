#!/usr/bin/env bash
# Everything the GPU machine checks and measures, in one call. Expects the binaries built
# by bench/gpu_build.sh in .gpu/ (carried with the call). Logs go to $OUT (or /tmp).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hep-gpu}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.gpu/lib:${LD_LIBRARY_PATH:-}
export CUDA_DEVICE_MAX_CONNECTIONS=32 PYTHONUNBUFFERED=1 HEP_TIMEOUT_MS=${HEP_TIMEOUT_MS:-5000}
B=.gpu
step() { echo; echo "=== $* ($(date +%T))"; }
step "device"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
$B/hybridep doctor | tee "$OUT/doctor.txt"
MODE=${1:-all}
if [ "$MODE" = all ] || [ "$MODE" = test ]; then
  step "GPU tests (kernels vs host backend and oracle, graph replay, timeout, DMA-BUF)"
  timeout 420 $B/test_gpu_ep 2>&1 | tee "$OUT/test_gpu_ep.txt" | grep -vE '^\[ *(RUN|OK) ' | tail -40
  step "compute-sanitizer memcheck (small case)"
  HEP_GPU_TEST_SMALL=1 timeout 240 compute-sanitizer --tool memcheck --leak-check full \
    $B/test_gpu_ep 2>&1 | tail -12 | tee "$OUT/memcheck.txt"
  step "compute-sanitizer racecheck (small case)"
  HEP_GPU_TEST_SMALL=1 timeout 240 compute-sanitizer --tool racecheck \
    $B/test_gpu_ep 2>&1 | tail -8 | tee "$OUT/racecheck.txt"
fi
if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
  for dt in bf16 fp8; do
    step "hybridep bench --dtype $dt"
    $B/hybridep bench --dtype $dt --dump-routing "$OUT/routing_$dt.bin" ${BENCH_ARGS:-} \
      | tee "$OUT/bench_$dt.txt"
    $B/hybridep bench --dtype $dt --json --seed 7 ${BENCH_ARGS:-} > "$OUT/bench_$dt.json" 2>/dev/null
    step "torch baseline, same routing ($dt)"
    python3 bench/torch_baseline.py "$OUT/routing_$dt.bin" --ours "$OUT/bench_$dt.json" \
      2>&1 | tee "$OUT/torch_$dt.txt"
  done
  rm -f "$OUT"/routing_*.bin
  step "summary"
  grep -hE "^(ceiling|preprocess|dispatch|combine|hybridep vs|verified)" "$OUT"/bench_*.txt "$OUT"/torch_*.txt
fi
