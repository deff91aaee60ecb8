#!/usr/bin/env bash
# Builds the command and library of another revision (default: HEAD, the build before this
# change's uncommitted edits) as the variant .gpu/var/<NAME> (bench/gpu_variants.sh with
# VAR_SRC = a worktree of REV), so that bench/gpu_ab.sh compares it with the main build in
# the same GPU call (AB_VARIANTS="prev ..."). Run after bench/gpu_build.sh, which empties
# .gpu. Usage: bash bench/gpu_prev.sh [REV] [NAME (prev)]
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:-HEAD}
name=${2:-prev}
sha=$(git rev-parse --verify "$rev^{commit}")
tree=${TMPDIR:-/tmp}/hep-gpu-$name-$sha
[ -d "$tree" ] || git worktree add -f --detach "$tree" "$sha" >/dev/null
printf '%s\n' "$name" | VAR_SRC="$tree" bash bench/gpu_variants.sh >/dev/null
echo "$name: $(git log -1 --format='%h %s' "$sha")"
