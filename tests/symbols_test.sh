#!/usr/bin/env bash
# The shared library exports exactly the functions its public headers declare: nothing of
# the internals (they would become ABI by accident) and nothing declared but missing.
# Usage: symbols_test.sh path/to/libhybridep.so include/hybridep
set -euo pipefail
lib=$1
inc=$2
exported=$(nm -D --defined-only "$lib" | awk '$2 ~ /^[TW]$/ {print $3}' | sed 's/@.*//' | sort -u)
# a declaration: "type hep_name(" at the start of a line (possibly after "*")
declared=$(cat "$inc"/*.h | grep -oE '^[a-z_ ]+[ *]hep_[a-z0-9_]+\(' | grep -oE 'hep_[a-z0-9_]+\($' | tr -d '(' |
    sort -u)
# libhybridep_mpi's calls are declared in bootstrap_mpi.h but live in their own library
declared=$(comm -23 <(echo "$declared") <(grep -oE 'hep_bootstrap_mpi_[a-z_]+' "$inc/bootstrap_mpi.h" | sort -u))
extra=$(comm -23 <(echo "$exported") <(echo "$declared"))
missing=$(comm -13 <(echo "$exported") <(echo "$declared"))
[ -z "$extra" ] || echo "exported but not in the public headers: $extra"
[ -z "$missing" ] || echo "declared in the public headers but not exported: $missing"
[ -z "$extra$missing" ] && echo "$(echo "$exported" | wc -l) exported symbols, all public"
test -z "$extra$missing"
