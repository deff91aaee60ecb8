#!/usr/bin/env bash
# The hybridep command line: exit codes, figures and output formats.
# Usage: cli_test.sh path/to/hybridep
set -u
H=$1
pass=0
fail=0
check() { # name, then a command that must succeed
    local name=$1
    shift
    if "$@" >/tmp/hep_cli_$$ 2>&1; then
        pass=$((pass + 1))
    else
        fail=$((fail + 1))
        echo "FAILED: $name"
        sed 's/^/  | /' /tmp/hep_cli_$$ | head -20
    fi
}
plan_ep64() { "$H" plan --nodes 8 --ranks-per-node 8 --hidden 7168 --tokens 4096 \
    --experts-per-rank 4 --topk 8 --dtype bf16 | grep -q "total device memory per rank: 4596695040 bytes"; }
plan_json() { "$H" plan --nodes 2 --ranks-per-node 4 --dtype fp8 --json |
    python3 -c 'import json,sys; d=json.load(sys.stdin); n=[b for b in d["buffers"] if b["rdma_registered"]]; sys.exit(0 if len(n)==14 else 1)'; }
plan_rejects_fp8_hidden() { "$H" plan --dtype fp8 --hidden 7000 >/tmp/hep_rej_$$ 2>&1; rc=$?; grep -q "multiple of 128" /tmp/hep_rej_$$ && test $rc -eq 1; }
unknown_argument_exits_2() { "$H" plan --bogus; test $? -eq 2; }
unknown_command_exits_2() { "$H" frobnicate; test $? -eq 2; }
doctor_text_exits_0() { "$H" doctor | grep -q "hybridep doctor"; }
doctor_json_is_one_document() { "$H" doctor --json | python3 -m json.tool >/dev/null; }
bench_host_runs_and_says_so() { "$H" bench --backend host --ranks-per-node 4 --tokens 64 \
    --hidden 256 --experts-per-rank 2 --topk 2 | grep -q "HOST backend (no GPU)"; }
bench_host_two_nodes_runs() { "$H" bench --backend host --nodes 2 --ranks-per-node 2 \
    --tokens 32 --hidden 256 --experts-per-rank 2 --topk 2 | grep -q "2 node(s) x 2, loopback NIC"; }
bench_rejects_zero_nodes() { "$H" bench --nodes 0 >/tmp/hep_nodes_$$ 2>&1; rc=$?; grep -q "nodes must be >= 1" /tmp/hep_nodes_$$ && test $rc -eq 2; }
bench_rejects_bad_dtype() { "$H" bench --dtype int4; test $? -eq 2; }
check plan_ep64 plan_ep64
check plan_json_lists_14_rdma_buffers plan_json
check plan_rejects_fp8_hidden_not_multiple_of_128 plan_rejects_fp8_hidden
check unknown_argument_exits_2 unknown_argument_exits_2
check unknown_command_exits_2 unknown_command_exits_2
check doctor_text_exits_0 doctor_text_exits_0
check doctor_json_is_one_document doctor_json_is_one_document
check bench_host_runs_and_says_so bench_host_runs_and_says_so
check bench_rejects_bad_dtype bench_rejects_bad_dtype
check bench_host_two_nodes_runs bench_host_two_nodes_runs
check bench_rejects_zero_nodes bench_rejects_zero_nodes
rm -f /tmp/hep_cli_$$
echo "$pass passed, $fail failed"
test "$fail" -eq 0
