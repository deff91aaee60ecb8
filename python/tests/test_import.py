"""Loading the package: a missing library is an ImportError that says how to build it."""
import ctypes.util
import os
import shutil
import subprocess
import sys

import pytest

import hybridep


def test_missing_library_is_an_import_error_saying_how_to_build(tmp_path):
    if ctypes.util.find_library("hybridep"):
        pytest.skip("a system-wide libhybridep is installed: the fallback would find it")
    pkg = tmp_path / "hybridep"
    pkg.mkdir()
    src = os.path.dirname(hybridep.__file__)
    for f in os.listdir(src):
        if f.endswith(".py"):
            shutil.copy(os.path.join(src, f), pkg / f)
    env = dict(os.environ, HYBRIDEP_LIBRARY="/nonexistent/libhybridep.so",
               PYTHONPATH=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", "import hybridep"], env=env, cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "ImportError" in p.stderr and "scripts/install_python.sh" in p.stderr, p.stderr
    assert "/nonexistent/libhybridep.so" in p.stderr, p.stderr


def test_errors_carry_the_status_and_the_library_text():
    from hybridep import _lib
    e = _lib.HybridEPError(6, "rank 3 did not arrive", "hep_dispatch")
    assert isinstance(e, RuntimeError) and e.status == 6 and e.status_name == "HEP_ERR_TIMEOUT"
    assert str(e) == "hep_dispatch: HEP_ERR_TIMEOUT: rank 3 did not arrive"
    cfg = _lib.Config()
    _lib.lib.hep_config_default(cfg)
    rc = _lib.lib.hep_config_check(cfg, 1)  # hidden etc. unset
    with pytest.raises(hybridep.HybridEPError) as info:
        _lib.check(rc, "hep_config_check")
    assert info.value.status_name == "HEP_ERR_INVALID" and "hidden" in info.value.message
