#!/usr/bin/env bash
# The hybridep command line: exit codes, messages, figures and output formats.
# Usage: cli_test.sh path/to/hybridep   (scratch files go to a private directory under
# $HEP_TEST_TMP, else $TMPDIR, removed at exit)
set -u
H=$1
T=$(mktemp -d "${HEP_TEST_TMP:-${TMPDIR:-/tmp}}/hep_cli.XXXXXX") || exit 1
trap 'rm -rf "$T"' EXIT
pass=0
fail=0
check() { # name, then a command that must succeed
    local name=$1
    shift
    if "$@" >"$T/out" 2>&1; then
        pass=$((pass + 1))
    else
        fail=$((fail + 1))
        echo "FAILED: $name"
        sed 's/^/  | /' "$T/out" | head -20
    fi
}
# run CMD...; then $rc, $T/o (stdout), $T/e (stderr)
run() { "$@" >"$T/o" 2>"$T/e"; rc=$?; }
# the command exits with code $1 and its stderr has one line containing $2
fails_with() { local code=$1 text=$2; shift 2; run "$@"; cat "$T/e"
    test "$rc" -eq "$code" && test "$(grep -c . "$T/e")" -eq 1 && grep -qF -- "$text" "$T/e"; }
SMALL=(--backend host --ranks-per-node 4 --tokens 64 --hidden 256 --experts-per-rank 2 --topk 2)

plan_ep64() { "$H" plan --nodes 8 --ranks-per-node 8 --hidden 7168 --tokens 4096 \
    --experts-per-rank 4 --topk 8 --dtype bf16 | grep -q "total device memory per rank: 3974299648 bytes"; }
plan_accepts_opt_equals_value() { "$H" plan --nodes=8 --ranks-per-node=8 --hidden=7168 --tokens=4096 \
    --experts-per-rank=4 --topk=8 --dtype=bf16 | grep -q "total device memory per rank: 3974299648 bytes"; }
# issue 15: the receive capacity uniform top-8 routing of EP64 needs, against numbers worked
# out here: p = 1 - C(252, 8) / C(256, 8) exactly; the quantile is the normal
# approximation (checked exactly) and lies within 0.5% of the exact binomial 99.99% quantile
plan_ep64_capacity_advice() { "$H" plan --nodes 8 --ranks-per-node 8 --hidden 7168 --tokens 4096 \
    --experts-per-rank 4 --topk 8 --json | python3 -c '
import json, math, sys
a = json.load(sys.stdin)["capacity_advice"]
n = 64 * 4096
p = 1 - math.comb(252, 8) / math.comb(256, 8)
mean = n * p
sd = math.sqrt(n * p * (1 - p))
q = math.ceil(mean + 3.719016485 * sd)
row = 7168 * 2 + 4 * 4
def cdf_at_least(x):  # P(X >= x), summed from logs
    lp = lambda k: math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p) + (n - k) * math.log(1 - p)
    return sum(math.exp(lp(k)) for k in range(x, x + 2000))
exact = next(x for x in range(int(mean), n) if cdf_at_least(x + 1) <= 1e-4)
print(a, "hand:", p, mean, q, exact)
ok = (abs(a["p"] - p) < 1e-6 and abs(a["mean_rows"] - mean) < 0.1 and 31000 < mean < 32000
      and a["quantile_rows"] == q and abs(q - exact) <= 0.005 * exact
      and a["twice_mean_rows"] == math.ceil(2 * mean) and a["worst_case_rows"] == n
      and a["recv_bytes_per_row"] == row and a["recv_bytes_worst_case"] == n * row
      and a["recv_bytes_quantile"] == q * row and a["recv_bytes_twice_mean"] == math.ceil(2 * mean) * row)
sys.exit(0 if ok else 1)'; }
plan_text_prints_capacity_advice() { "$H" plan --nodes 8 --ranks-per-node 8 --hidden 7168 --tokens 4096 \
    --experts-per-rank 4 --topk 8 >"$T/o" && grep -q "mean (W x T x p) .* 31439.9 " "$T/o" &&
    grep -q "99.99% quantile (normal approximation) .* 32059 .* 460110768 .* 672071680" "$T/o" &&
    grep -q "worst case (W x T, max_recv_rows = 0) .* 262144 .* 3762290688 .* 3974299648" "$T/o"; }
# every token reaches the rank when E - E_l < K (p = 1: no spread)
plan_capacity_advice_all_tokens() { "$H" plan --nodes 1 --ranks-per-node 2 --experts-per-rank 4 --topk 5 \
    --tokens 100 --json | python3 -c 'import json,sys; a=json.load(sys.stdin)["capacity_advice"]; sys.exit(0 if a["p"]==1 and a["quantile_rows"]==200 and a["twice_mean_rows"]==200 else 1)'; }
# issue 15: --max-recv-rows sizes the receive buffers by the capacity and shows the worst case too
plan_max_recv_rows_sizes_the_receive_buffers() { "$H" plan --nodes 8 --ranks-per-node 8 --hidden 7168 --tokens 4096 \
    --experts-per-rank 4 --topk 8 --max-recv-rows 62880 --json | python3 -c '
import json, sys
d = json.load(sys.stdin)
b = {x["name"]: x for x in d["buffers"]}
sys.exit(0 if d["max_recv_rows"] == 62880 and b["exchange.token"]["count"] == 62880 * 7168
         and b["dispatch.recv_prob"]["count"] == 62880 * 4 and d["device_bytes"] < 3974299648 - 2 * 10**9
         and d["capacity_advice"]["device_bytes_worst_case"] == 3974299648 else 1)' &&
    "$H" plan --nodes 8 --ranks-per-node 8 --hidden 7168 --tokens 4096 --experts-per-rank 4 --topk 8 \
    --max-recv-rows 62880 | grep -q "with the worst case instead (max_recv_rows = 0): 3974299648 bytes"; }
# issues 13/14: --max-permuted-rows plans the expert-major staging (GPU plan only)
plan_max_permuted_rows_plans_the_staging() { "$H" plan --nodes 1 --ranks-per-node 8 --hidden 1024 --tokens 64 \
    --experts-per-rank 4 --topk 4 --dtype fp8 --max-permuted-rows 3000 --json | python3 -c '
import json, sys
d = json.load(sys.stdin)
b = {x["name"]: x for x in d["buffers"]}
sys.exit(0 if d["max_permuted_rows"] == 3000 and b["expert_major.token"]["bytes"] == 3000 * 1024 * 2
         and b["expert_major.prob"]["count"] == 3000 and b["expert_major.scaling_factor"]["count"] == 3000 * 8
         and b["expert_major.token"]["memory"] == "device, IPC-shared" else 1)' &&
    "$H" plan --nodes 1 --ranks-per-node 8 --hidden 1024 --tokens 64 --experts-per-rank 4 --topk 4 \
    --max-permuted-rows 3000 | grep -q "expert-major staging per rank: 3000 rows" &&
    ! "$H" plan --nodes 1 --ranks-per-node 8 --hidden 1024 --tokens 64 --experts-per-rank 4 --topk 4 \
    | grep -q "expert_major"; }
plan_rejects_capacity_above_worst_case() { fails_with 1 "config.max_recv_rows = 65537 is out of range 0..65536" \
    "$H" plan --nodes 2 --ranks-per-node 8 --tokens 4096 --max-recv-rows 65537; }
plan_json() { "$H" plan --nodes 2 --ranks-per-node 4 --dtype fp8 --json |
    python3 -c 'import json,sys; d=json.load(sys.stdin); n=[b for b in d["buffers"] if b["rdma_registered"]]; sys.exit(0 if len(n)==14 else 1)'; }
# issue 15: the GPU kernels take up to 128 nodes; 129 are refused naming the limit
plan_gpu_128_nodes_of_8_ranks() { "$H" plan --nodes 128 --ranks-per-node 8 --hidden 7168 --tokens 4096 \
    --experts-per-rank 4 --topk 8 --dtype bf16 --json | python3 -c '
import json, sys
d = json.load(sys.stdin)
b = {x["name"]: x for x in d["buffers"]}
sys.exit(0 if d["backend"] == "gpu" and d["max_recv_rows"] == 1024 * 4096
         and d["chunk_tokens"] == 3584 // 127 and d["ring_chunks"] == 2
         and b["dispatch.rdma_inter_node_group_token"]["count"] == 127 * 56 * 7168 else 1)'; }
plan_gpu_rejects_129_nodes() { fails_with 1 "129 nodes is not in 1..128 (the GPU backend's limit)" \
    "$H" plan --nodes 129 --ranks-per-node 8; }
plan_rejects_fp8_hidden() { fails_with 1 "multiple of 128" "$H" plan --dtype fp8 --hidden 7000; }
plan_help_lists_defaults_and_env() { run "$H" plan --help; test $rc -eq 0 &&
    grep -q -- "--hidden H.*default 7168" "$T/o" && grep -q HEP_TIMEOUT_MS "$T/o"; }
bench_help_lists_defaults() { run "$H" bench --help; test $rc -eq 0 &&
    grep -q -- "--tokens T.*default 4096; 1..65536" "$T/o" && grep -q -- "--seed S.*default 1;" "$T/o"; }
version_names_the_library() { "$H" --version | grep -qE "^hybridep [0-9]+\.[0-9]+\.[0-9]+ \(library [0-9]+\.[0-9]+\.[0-9]+"; }
unknown_argument_exits_2() { fails_with 2 "unknown option '--bogus'" "$H" plan --bogus; }
unknown_command_exits_2() { "$H" frobnicate; test $? -eq 2; }
doctor_text_exits_0() { "$H" doctor | grep -q "hybridep doctor"; }
doctor_prints_the_version() { "$H" doctor | grep -qE "^hybridep +: library [0-9]+\.[0-9]+\.[0-9]+"; }
doctor_json_is_one_document() { "$H" doctor --json | python3 -c 'import json,sys; d=json.load(sys.stdin); sys.exit(0 if d["hybridep_version"] else 1)'; }
bench_host_runs_and_says_so() { "$H" bench "${SMALL[@]}" | grep -q "HOST backend (no GPU)"; }
bench_host_two_nodes_runs() { "$H" bench --backend host --nodes 2 --ranks-per-node 2 \
    --tokens 32 --hidden 256 --experts-per-rank 2 --topk 2 | grep -q "2 node(s) x 2, loopback NIC"; }
bench_rejects_zero_nodes() { fails_with 2 "--nodes 0 is out of range (allowed: 1..4096)" "$H" bench --nodes 0; }
bench_rejects_bad_dtype() { fails_with 2 "--dtype 'int4' is not one of bf16|fp8" "$H" bench --dtype int4; }
# issue 11 D9: no empty reason
bench_rejects_zero_ranks_per_node() { fails_with 2 "--ranks-per-node 0 is out of range (allowed: 1..72)" "$H" bench --ranks-per-node 0; }
bench_rejects_too_many_ranks_naming_the_limit() { fails_with 2 "--nodes 100 x --ranks-per-node 4 = 400 ranks: at most 72" "$H" bench --nodes 100 --ranks-per-node 4; }
# issue 11 D5: no int overflow of nodes x ranks
bench_rejects_huge_nodes() { fails_with 2 "--nodes 536870913 is out of range" "$H" bench --nodes 536870913 --ranks-per-node 8; }
# issue 11 D14 / issue 12: a number too large is out of range, not "not an integer"
bench_says_out_of_range_for_big_numbers() { fails_with 2 "--tokens 2147483648 is out of range (allowed: 1..65536)" "$H" bench --tokens 2147483648 &&
    fails_with 2 "--tokens 99999999999 is out of range" "$H" bench --tokens 99999999999; }
bench_names_only_the_broken_rule() { fails_with 2 "--iters 0 is out of range (allowed: 1..100000)" "$H" bench --iters 0; }
bench_says_not_an_integer_for_words() { fails_with 2 "--tokens 'abc' is not an integer (allowed: 1..65536)" "$H" bench --tokens abc; }
# issue 11 D10: an option given last without its value is an error, not ignored
bench_option_without_value_last_is_an_error() {
    for o in --backend --routing --dump-routing --json-file --tokens; do
        fails_with 2 "$o needs a value" "$H" bench "${SMALL[@]}" "$o" || return 1
    done; }
bench_option_value_that_is_an_option_is_an_error() { fails_with 2 "--dump-routing needs a value (got the option '--tokens')" "$H" bench --dump-routing --tokens 8; }
bench_unwritable_json_file_exits_nonzero() { fails_with 2 "--json-file '/no/such/dir/x.json' cannot be written" "$H" bench "${SMALL[@]}" --json-file /no/such/dir/x.json; }
bench_json_file_is_written() { "$H" bench "${SMALL[@]}" --json-file "$T/r.json" >/dev/null 2>&1 &&
    python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if d["backend"]=="host" else 1)' "$T/r.json"; }
bench_host_json_says_one_timed_run() { "$H" bench "${SMALL[@]}" --json 2>/dev/null |
    python3 -c 'import json,sys; d=json.load(sys.stdin); sys.exit(0 if d["iters"]==1 and d["warmup"]==0 else 1)'; }
bench_json_error_is_a_json_object() { run "$H" bench --json --tokens 0; test $rc -eq 2 &&
    python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if "--tokens 0" in d["error"] and d["exit_code"]==2 else 1)' "$T/o"; }
bench_default_seed_is_fixed_and_printed() { "$H" bench "${SMALL[@]}" --dump-routing "$T/a.bin" 2>"$T/e1" >"$T/o1" &&
    "$H" bench "${SMALL[@]}" --dump-routing "$T/b.bin" >/dev/null 2>&1 && cmp -s "$T/a.bin" "$T/b.bin" &&
    grep -q "seed 1" "$T/o1"; }
# issue 11 D4: skewed routing ends for small shapes and reaches every expert
bench_skewed_routing_ends_on_few_experts() { timeout 60 "$H" bench --backend host --ranks-per-node 4 --experts-per-rank 2 --topk 4 \
    --tokens 64 --hidden 256 --routing skewed --json 2>/dev/null |
    python3 -c 'import json,sys; d=json.load(sys.stdin); sys.exit(0 if d["experts_reached"]==8 else 1)'; }
bench_skewed_routing_reaches_every_expert_with_defaults() { timeout 120 "$H" bench --backend host --routing skewed --tokens 512 --hidden 128 --json 2>/dev/null |
    python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["experts_reached"]); sys.exit(0 if d["experts_reached"]==256 else 1)'; }
# issue 11 D6: a failed host allocation is a message, not SIGSEGV (not under ASan: it
# reserves more address space than the limit allows)
bench_out_of_host_memory_is_a_message() {
    if ldd "$H" | grep -q libasan || nm "$H" 2>/dev/null | grep -q __asan_init; then echo "not under ASan"; return 0; fi
    (ulimit -v 1000000; "$H" bench --backend host --tokens 65536 --hidden 65536 --ranks-per-node 8 --experts-per-rank 2 --topk 2 >"$T/o" 2>"$T/e"); rc=$?
    cat "$T/e"; test $rc -eq 1 && grep -q "out of host memory" "$T/e"; }
bench_gpu_without_gpu_says_it_once() {
    if "$H" doctor --json | python3 -c 'import json,sys; d=json.load(sys.stdin); sys.exit(0 if d.get("gpus") else 1)'; then echo "has a GPU"; return 0; fi
    run "$H" bench --backend gpu --ranks-per-node 4; cat "$T/e"; test $rc -eq 1 && test "$(grep -c . "$T/e")" -eq 1 && grep -q -- "--backend gpu:" "$T/e"; }
bench_sweep_needs_the_gpu() { fails_with 2 "--sweep-sms times GPU kernels: not with --backend host" "$H" bench --backend host --sweep-sms 4,8; }
bench_sweep_rejects_bad_list() { fails_with 2 "--sweep-sms 0 is out of range (allowed: 1..132)" "$H" bench --sweep-sms 4,0; }

for t in plan_ep64 plan_accepts_opt_equals_value plan_ep64_capacity_advice \
    plan_text_prints_capacity_advice plan_capacity_advice_all_tokens \
    plan_max_recv_rows_sizes_the_receive_buffers plan_max_permuted_rows_plans_the_staging plan_rejects_capacity_above_worst_case plan_json plan_rejects_fp8_hidden \
    plan_gpu_128_nodes_of_8_ranks plan_gpu_rejects_129_nodes \
    plan_help_lists_defaults_and_env bench_help_lists_defaults version_names_the_library \
    unknown_argument_exits_2 unknown_command_exits_2 doctor_text_exits_0 doctor_prints_the_version \
    doctor_json_is_one_document bench_host_runs_and_says_so bench_host_two_nodes_runs \
    bench_rejects_zero_nodes bench_rejects_bad_dtype bench_rejects_zero_ranks_per_node \
    bench_rejects_too_many_ranks_naming_the_limit bench_rejects_huge_nodes \
    bench_says_out_of_range_for_big_numbers bench_names_only_the_broken_rule \
    bench_says_not_an_integer_for_words bench_option_without_value_last_is_an_error \
    bench_option_value_that_is_an_option_is_an_error bench_unwritable_json_file_exits_nonzero \
    bench_json_file_is_written bench_host_json_says_one_timed_run bench_json_error_is_a_json_object \
    bench_default_seed_is_fixed_and_printed bench_skewed_routing_ends_on_few_experts \
    bench_skewed_routing_reaches_every_expert_with_defaults bench_out_of_host_memory_is_a_message \
    bench_gpu_without_gpu_says_it_once bench_sweep_needs_the_gpu bench_sweep_rejects_bad_list; do
    check "$t" "$t"
done
echo "$pass passed, $fail failed"
test "$fail" -eq 0
