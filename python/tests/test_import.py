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


def test_config_mirrors_the_c_struct_to_its_last_field():
    # a field out of place in the ctypes struct would make the check name another field
    from hybridep import _lib
    cfg = _lib.Config()
    _lib.lib.hep_config_default(cfg)
    cfg.hidden, cfg.max_tokens, cfg.experts_per_rank = 256, 16, 2
    cfg.backend = _lib.HEP_BACKEND_HOST
    assert cfg.max_recv_rows == 0  # hep_config_default: the worst case
    assert _lib.lib.hep_config_check(cfg, 4) == 0
    cfg.max_recv_rows = 65  # 4 ranks x 16 tokens = 64 rows at most
    rc = _lib.lib.hep_config_check(cfg, 4)
    assert _lib.STATUS_NAMES[rc] == "HEP_ERR_INVALID"
    assert "config.max_recv_rows = 65 is out of range 0..64" in _lib.lib.hep_last_error().decode()
    assert _lib.STATUS_NAMES[12] == "HEP_ERR_OVERFLOW"
    assert _lib.lib.hep_status_name(12).decode() == "HEP_ERR_OVERFLOW"


def test_every_struct_of_the_binding_has_the_library_size():
    """The import checks these; here they are listed, so that a struct left out of the check
    (or a size the library does not know, 0) fails by name."""
    from hybridep import _lib
    for name, cls in _lib.STRUCTS.items():
        assert _lib.lib.hep_struct_size(name.encode()) == ctypes.sizeof(cls), name
    assert _lib.lib.hep_struct_size(b"hep_no_such_struct") == 0
