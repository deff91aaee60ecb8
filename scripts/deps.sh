#!/usr/bin/env bash
# Installs (as root) or names (otherwise) what building hybridep needs on Debian/Ubuntu.
# Sourced by scripts/test.sh and scripts/main.sh.
set -euo pipefail

hep_missing_pkgs() {
    local miss=()
    command -v cmake >/dev/null 2>&1 || miss+=(cmake)
    command -v gcc >/dev/null 2>&1 || miss+=(gcc)
    command -v g++ >/dev/null 2>&1 || miss+=(g++)
    command -v make >/dev/null 2>&1 || miss+=(make)
    [ -f /usr/include/infiniband/verbs.h ] || miss+=(libibverbs-dev)
    ls /usr/lib/*/libibverbs.so.1 >/dev/null 2>&1 || miss+=(libibverbs1)
    [ -f /usr/include/cmocka.h ] || miss+=(libcmocka-dev)
    command -v mpirun >/dev/null 2>&1 || miss+=(openmpi-bin)
    command -v mpicc >/dev/null 2>&1 || miss+=(libopenmpi-dev)
    command -v python3 >/dev/null 2>&1 || miss+=(python3)
    echo "${miss[@]:-}"
}

hep_ensure_deps() {
    local miss
    miss=$(hep_missing_pkgs)
    if [ -n "$miss" ]; then
        if [ "$(id -u)" = 0 ]; then
            echo "== installing: $miss"
            export DEBIAN_FRONTEND=noninteractive
            apt-get update -qq
            # shellcheck disable=SC2086
            apt-get install -y -qq --no-install-recommends $miss >/dev/null
        else
            echo "missing packages: $miss" >&2
            echo "install them with: sudo apt-get install -y $miss" >&2
            exit 1
        fi
    fi
    if ! command -v nvcc >/dev/null 2>&1; then
        if [ -x /usr/local/cuda/bin/nvcc ]; then
            export PATH=/usr/local/cuda/bin:$PATH
        else
            echo "nvcc (CUDA toolkit 12.8 or newer, for sm_90 and sm_100) is not installed:" >&2
            echo "install NVIDIA's cuda-toolkit package, or put its bin/ on PATH" >&2
            exit 1
        fi
    fi
}
