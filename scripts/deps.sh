#!/usr/bin/env bash
# What building hybridep needs on Debian/Ubuntu: checks, and installs as root what is
# missing (as another user it names the apt-get command). Sourced by scripts/main.sh
# (profile "main": build and run only) and scripts/test.sh (profile "test": also cmocka,
# Open MPI, python3 with Debian's torch, pytest and numpy for the tests).
set -euo pipefail

# $1 = main|test. Prints the Debian packages of the missing required pieces.
hep_missing_pkgs() {
    local miss=()
    command -v cmake >/dev/null 2>&1 || miss+=(cmake)
    command -v cc >/dev/null 2>&1 || miss+=(gcc)
    command -v make >/dev/null 2>&1 || miss+=(make)
    # the verbs NIC's headers: required for the tests; for the main job wanted (installed as
    # root), else left out with one line (hep_report_optional)
    if [ "$1" = test ] || [ "$(id -u)" = 0 ]; then
        [ -f /usr/include/infiniband/verbs.h ] || miss+=(libibverbs-dev)
    fi
    if [ "$1" = test ]; then
        [ -f /usr/include/cmocka.h ] || miss+=(libcmocka-dev)
        command -v mpicc >/dev/null 2>&1 || miss+=(libopenmpi-dev openmpi-bin)
        command -v python3 >/dev/null 2>&1 || miss+=(python3)
        command -v pkg-config >/dev/null 2>&1 || miss+=(pkg-config)
        # the Python package's tests: Debian's CPU torch, pytest, numpy; offline install
        python3 -c "import torch" >/dev/null 2>&1 || miss+=(python3-torch)
        python3 -c "import pytest, numpy" >/dev/null 2>&1 || miss+=(python3-pytest python3-numpy)
        python3 -c "import setuptools" >/dev/null 2>&1 || miss+=(python3-setuptools)
        python3 -m pip --version >/dev/null 2>&1 || miss+=(python3-pip)
    fi
    echo "${miss[@]:-}"
}

# One line for each optional piece that will be left out (nothing is installed for it).
hep_report_optional() {
    if [ "$1" = main ] && ! command -v mpicc >/dev/null 2>&1; then
        echo "== optional: no MPI (mpicc): libhybridep_mpi is left out (apt-get install libopenmpi-dev)"
    fi
    if [ ! -f /usr/include/infiniband/verbs.h ]; then
        echo "== optional: no libibverbs headers: the verbs NIC is left out, the loopback NIC is built (apt-get install libibverbs-dev)"
    fi
    # the dynamic loader's own list (an `ls` of several paths fails when any one is absent;
    # grep -q would end the pipe early, which pipefail counts as a failure)
    if ! /sbin/ldconfig -p 2>/dev/null | grep "libibverbs\.so\.1 " >/dev/null; then
        echo "== optional: no libibverbs.so.1 at run time: only the loopback NIC works (apt-get install libibverbs1)"
    fi
    if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
        echo "== optional: no nvcc (CUDA toolkit 12.8+): the GPU kernels are left out, the host backend is built"
    fi
}

hep_ensure_deps() {
    local profile=${1:-test} miss
    miss=$(hep_missing_pkgs "$profile")
    if [ -n "$miss" ]; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            echo "== installing: $miss"
            export DEBIAN_FRONTEND=noninteractive
            apt-get update -qq
            # shellcheck disable=SC2086
            apt-get install -y -qq --no-install-recommends $miss >/dev/null
        else
            echo "missing: $miss" >&2
            echo "install them with: sudo apt-get install -y $miss" >&2
            exit 1
        fi
    fi
    hep_report_optional "$profile"
    if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
        export PATH=/usr/local/cuda/bin:$PATH
    fi
}
