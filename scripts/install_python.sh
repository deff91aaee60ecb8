#!/usr/bin/env bash
# Builds libhybridep.so (CMake, release), copies it into python/hybridep/ and pip-installs
# the package offline (no build isolation: setuptools from the system). Extra arguments go
# to pip, e.g. `--user`, `--target DIR`, or `--break-system-packages` for Debian's Python.
#   HEP_BUILD_DIR  build directory (default build/python); an existing build is reused
#   HEP_PYTHON     the Python whose pip installs it (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${HEP_BUILD_DIR:-build/python}
py=${HEP_PYTHON:-python3}
if [ ! -f "$build/CMakeCache.txt" ]; then
    [ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH
    cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DBUILD_TESTING=OFF >/dev/null
fi
cmake --build "$build" -j"${HEP_JOBS:-2}" --target hybridep
lib=$(readlink -f "$build/src/libhybridep.so")
install -m 0644 "$lib" python/hybridep/libhybridep.so
echo "== installing the hybridep package with $py ($lib)"
"$py" -m pip install --no-build-isolation --no-deps --no-index "$@" ./python
