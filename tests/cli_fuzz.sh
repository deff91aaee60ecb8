#!/usr/bin/env bash
# A bounded random-argument fuzz loop of the hybridep command line (plan and bench): each
# round takes a small valid command and corrupts it (an option's value replaced by a
# random integer, a huge, negative or empty one, garbage, an option repeated, dropped
# values, unknown options, --opt=value forms). Every run must end by itself with exit 0,
# 1 or 2 (never a signal or a hang), and every non-zero exit must say why in one line or
# more on stderr.
# Usage: cli_fuzz.sh path/to/hybridep   (HEP_FUZZ_SECONDS bounds it, default 5;
# HEP_FUZZ_SEED picks the sequence, default 1; scratch files in a private directory)
set -u
H=$(realpath "$1") || exit 1
T=$(mktemp -d "${HEP_TEST_TMP:-${TMPDIR:-/tmp}}/hep_fuzz.XXXXXX") || exit 1
trap 'rm -rf "$T"' EXIT
mkdir -p "$T/run"
RANDOM=${HEP_FUZZ_SEED:-1}
end=$(($(date +%s) + ${HEP_FUZZ_SECONDS:-5}))

PLAN=(plan --nodes 2 --ranks-per-node 4 --hidden 1024 --tokens 64 --experts-per-rank 2 --topk 2)
BENCH=(bench --backend host --ranks-per-node 2 --tokens 16 --hidden 64 --experts-per-rank 2
       --topk 2 --iters 1 --warmup 0)
VALUES=(0 1 -1 2 7 8 9 16 72 73 128 4097 65536 65537 2147483647 2147483648 -2147483649
        99999999999 18446744073709551616 "" " " " 5" "5 " abc 1e3 0x10 3.5 =1 -- bf16 fp8
        host gpu skewed "$T/x.json" /nonexistent/dir/x.json ",," "1,2" "8,,16")
OPTS_PLAN=(--nodes --ranks-per-node --hidden --tokens --experts-per-rank --topk --chunk --dtype)
OPTS_BENCH=(--nodes --ranks-per-node --hidden --tokens --experts-per-rank --topk --dtype
            --sms --sweep-sms --iters --warmup --backend --routing --gpus --seed
            --json-file --dump-routing)
pick() { local -n arr=$1; echo "${arr[RANDOM % ${#arr[@]}]}"; }

runs=0 bad=0
while [ "$(date +%s)" -lt "$end" ]; do
    if ((RANDOM % 3)); then args=("${PLAN[@]}") opts=OPTS_PLAN; else args=("${BENCH[@]}") opts=OPTS_BENCH; fi
    case $((RANDOM % 6)) in
        0) args+=("$(pick "$opts")" "$(pick VALUES)") ;;            # a value, last wins
        1) args+=("$(pick "$opts")=$(pick VALUES)") ;;               # --opt=value
        2) args+=("$(pick "$opts")") ;;                              # an option without value
        3) args+=("--no-such-option-$RANDOM") ;;
        4) args+=("$(pick VALUES)") ;;                               # a stray operand
        5) args+=("$(pick "$opts")" "$(pick VALUES)" "$(pick "$opts")=$(pick VALUES)") ;;
    esac
    ((RANDOM % 4 == 0)) && args+=(--json)
    # in the scratch directory: a stray operand or a value taken as a file name (bench's
    # --dump-routing, --json-file) writes there, removed at exit
    (cd "$T/run" && exec timeout -k 5 60 "$H" "${args[@]}") >"$T/o" 2>"$T/e"
    rc=$?
    runs=$((runs + 1))
    why=
    if [ "$rc" -gt 2 ]; then
        why="exit $rc (a signal, a hang or an unexpected code)"
    elif [ "$rc" -ne 0 ] && ! grep -q . "$T/e" && ! grep -q '"error"' "$T/o"; then
        why="exit $rc without a message"
    fi
    if [ -n "$why" ]; then
        bad=$((bad + 1))
        echo "FAILED: hybridep ${args[*]}: $why"
        sed 's/^/  | /' "$T/e" | head -5
    fi
done
echo "cli fuzz: $runs runs, $bad failed (seed ${HEP_FUZZ_SEED:-1})"
[ "$runs" -gt 0 ] && [ "$bad" -eq 0 ]
