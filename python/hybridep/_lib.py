"""The C library through ctypes: lookup, the public structs of include/hybridep/*.h, the
argument and return types of every call used, and the error type."""
import ctypes
import ctypes.util
import os

_HERE = os.path.dirname(os.path.abspath(__file__))
_BUILD_HINT = (
    "build it and install it into the package with `bash scripts/install_python.sh` from the "
    "hybridep repository, or point HYBRIDEP_LIBRARY at a built libhybridep.so "
    "(cmake -S . -B build && cmake --build build: build/src/libhybridep.so)"
)

# hybridep/status.h
HEP_OK = 0
STATUS_NAMES = {
    0: "HEP_OK", 1: "HEP_ERR_INVALID", 2: "HEP_ERR_NOMEM", 3: "HEP_ERR_UNAVAILABLE",
    4: "HEP_ERR_CUDA", 5: "HEP_ERR_VERBS", 6: "HEP_ERR_TIMEOUT", 7: "HEP_ERR_MISMATCH",
    8: "HEP_ERR_BOOTSTRAP", 9: "HEP_ERR_REMOTE", 10: "HEP_ERR_INTERNAL",
    11: "HEP_WARN_IGNORED", 12: "HEP_ERR_OVERFLOW",
}
globals().update({v: k for k, v in STATUS_NAMES.items()})

# hybridep/hybridep.h
HEP_DTYPE_BF16, HEP_DTYPE_FP8_E4M3 = 0, 1
HEP_BACKEND_GPU, HEP_BACKEND_HOST = 0, 1
HEP_INDEX_INT32, HEP_INDEX_INT64 = 0, 1
HEP_ASYNC = 1
HEP_REUSE_LAYOUT = 2
HEP_LAYOUT_RANK_MAJOR, HEP_LAYOUT_EXPERT_MAJOR = 0, 1
HEP_MAX_PAD_MULTIPLE = 1024
HEP_FP8_BLOCK = 128


class HybridEPError(RuntimeError):
    """A hybridep call failed: `status` (an int), `status_name` and `message` (the C
    library's hep_last_error() text, which names a missing rank on a timeout)."""

    def __init__(self, status, message, call=""):
        self.status = int(status)
        self.status_name = STATUS_NAMES.get(self.status, "status %d" % self.status)
        self.message = message
        prefix = "%s: " % call if call else ""
        super().__init__("%s%s: %s" % (prefix, self.status_name, message))


class HybridEPWarning(UserWarning):
    """A hybridep call completed but ignored part of its input (HEP_WARN_IGNORED: an expert
    id out of range, its slot ignored); the message names it. The call's outputs are valid
    and the collective step happened: combine follows as usual."""


class Config(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int) for n in (
        "hidden", "max_tokens", "experts_per_rank", "max_topk", "dtype", "ranks_per_node",
        "dispatch_sms", "combine_sms", "chunk_tokens", "backend", "max_recv_rows",
        "max_permuted_rows")]


ALLGATHER_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_size_t)
BARRIER_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class Bootstrap(ctypes.Structure):
    _fields_ = [("rank", ctypes.c_int), ("size", ctypes.c_int), ("ctx", ctypes.c_void_p),
                ("allgather", ALLGATHER_FN), ("barrier", BARRIER_FN)]


class GroupInfo(ctypes.Structure):
    _fields_ = [("rank", ctypes.c_int), ("world", ctypes.c_int), ("nodes", ctypes.c_int),
                ("ranks_per_node", ctypes.c_int), ("node", ctypes.c_int),
                ("local_rank", ctypes.c_int), ("max_recv_rows", ctypes.c_size_t),
                ("device_bytes", ctypes.c_size_t), ("host_bytes", ctypes.c_size_t),
                ("registrations", ctypes.c_int), ("dmabuf_registrations", ctypes.c_int),
                ("transport", ctypes.c_char_p)]


class DispatchArgs(ctypes.Structure):
    _fields_ = [("num_tokens", ctypes.c_int), ("tokens", ctypes.c_void_p),
                ("scales", ctypes.c_void_p), ("topk_idx", ctypes.c_void_p),
                ("index_type", ctypes.c_int), ("topk", ctypes.c_int),
                ("topk_weights", ctypes.c_void_p), ("stream", ctypes.c_void_p),
                ("flags", ctypes.c_uint)]


class DispatchResult(ctypes.Structure):
    _fields_ = [("tokens", ctypes.c_void_p), ("probs", ctypes.c_void_p),
                ("scales", ctypes.c_void_p), ("num_recv_device", ctypes.c_void_p),
                ("tokens_per_expert_device", ctypes.c_void_p),
                ("host_counts", ctypes.POINTER(ctypes.c_int)), ("num_recv", ctypes.c_int),
                ("max_recv_rows", ctypes.c_size_t), ("handle", ctypes.c_uint64),
                ("overflow_device", ctypes.POINTER(ctypes.c_int))]


class CombineArgs(ctypes.Structure):
    _fields_ = [("handle", ctypes.c_uint64), ("expert_out", ctypes.c_void_p),
                ("out", ctypes.c_void_p), ("stream", ctypes.c_void_p), ("flags", ctypes.c_uint)]


class DispatchOpts(ctypes.Structure):
    """hep_dispatch_opts (hybridep.h, the training API)."""
    _fields_ = [("handle", ctypes.c_void_p), ("layout", ctypes.c_int),
                ("pad_multiple", ctypes.c_int), ("num_permuted_tokens", ctypes.c_int),
                ("recv_tokens", ctypes.c_void_p), ("recv_probs", ctypes.c_void_p),
                ("recv_scales", ctypes.c_void_p), ("num_permuted", ctypes.c_int),
                ("overflow", ctypes.c_int), ("overflow_rows", ctypes.c_int),
                ("copy_bytes", ctypes.c_size_t),
                ("tokens_per_expert", ctypes.POINTER(ctypes.c_int64)),
                ("permuted_device", ctypes.POINTER(ctypes.c_int)),
                ("tokens_per_expert_device", ctypes.POINTER(ctypes.c_int64))]


class CombineOpts(ctypes.Structure):
    """hep_combine_opts."""
    _fields_ = [("handle", ctypes.c_void_p), ("probs_in", ctypes.c_void_p),
                ("probs_out", ctypes.c_void_p)]


def _candidates():
    for name in ("libhybridep.so", "libhybridep.so.0"):
        p = os.path.join(_HERE, name)
        if os.path.exists(p):
            yield p
    env = os.environ.get("HYBRIDEP_LIBRARY")
    if env:
        yield env
    found = ctypes.util.find_library("hybridep")
    yield found or "libhybridep.so.0"


def _load():
    tried = []
    for path in _candidates():
        try:
            return ctypes.CDLL(path), path
        except OSError as e:
            tried.append("%s (%s)" % (path, e))
    raise ImportError("hybridep: the C library libhybridep.so was not found; tried: %s. To fix: %s"
                      % ("; ".join(tried), _BUILD_HINT))


lib, path = _load()


def _declare(name, restype, *argtypes):
    f = getattr(lib, name)
    f.restype = restype
    f.argtypes = list(argtypes)
    return f


P = ctypes.POINTER
_declare("hep_last_error", ctypes.c_char_p)
_declare("hep_status_name", ctypes.c_char_p, ctypes.c_int)
_declare("hep_config_default", None, P(Config))
_declare("hep_config_check", ctypes.c_int, P(Config), ctypes.c_int)
_declare("hep_group_create", ctypes.c_int, P(Config), P(Bootstrap), ctypes.c_int,
         P(ctypes.c_void_p))
_declare("hep_group_destroy", ctypes.c_int, ctypes.c_void_p)
_declare("hep_group_get_info", ctypes.c_int, ctypes.c_void_p, P(GroupInfo))
_declare("hep_dispatch", ctypes.c_int, ctypes.c_void_p, P(DispatchArgs), P(DispatchResult))
_declare("hep_combine", ctypes.c_int, ctypes.c_void_p, P(CombineArgs))
_declare("hep_combine_input", ctypes.c_void_p, ctypes.c_void_p)
_declare("hep_handle_create", ctypes.c_int, ctypes.c_void_p, P(ctypes.c_void_p))
_declare("hep_handle_destroy", None, ctypes.c_void_p)
_declare("hep_dispatch_ex", ctypes.c_int, ctypes.c_void_p, P(DispatchArgs), P(DispatchOpts),
         P(DispatchResult))
_declare("hep_combine_ex", ctypes.c_int, ctypes.c_void_p, P(CombineArgs), P(CombineOpts))
_declare("hep_inproc_world_create", ctypes.c_int, ctypes.c_int, P(ctypes.c_void_p))
_declare("hep_inproc_bootstrap", ctypes.c_int, ctypes.c_void_p, ctypes.c_int, P(Bootstrap))
_declare("hep_inproc_world_destroy", None, ctypes.c_void_p)
_declare("hep_inproc_stream", ctypes.c_int, ctypes.c_int, ctypes.c_int, P(ctypes.c_void_p))
_declare("hep_group_sync", ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)

# Each struct laid out here must be the library's: a field the C side gained would be
# written past the end of this copy (it was, once: a crash in a later call).
_declare("hep_struct_size", ctypes.c_size_t, ctypes.c_char_p)
STRUCTS = {"hep_config": Config, "hep_bootstrap": Bootstrap, "hep_group_info": GroupInfo,
           "hep_dispatch_args": DispatchArgs, "hep_dispatch_result": DispatchResult,
           "hep_combine_args": CombineArgs, "hep_dispatch_opts": DispatchOpts,
           "hep_combine_opts": CombineOpts}
for _name, _cls in STRUCTS.items():
    _c = lib.hep_struct_size(_name.encode())
    if _c != ctypes.sizeof(_cls):
        raise ImportError("hybridep: %s is %d bytes in %s but %d in this package's binding: "
                          "the package and the library are of different versions (rebuild "
                          "and reinstall both from one checkout)"
                          % (_name, _c, path, ctypes.sizeof(_cls)))

# Setting the error message from a bootstrap callback: hep_set_last_error(status, fmt, ...)
# (hybridep/status.h), called with the format "%s" so that the text is never a format.
_set_text = getattr(lib, "hep_set_last_error", None)
if _set_text is not None:
    _set_text.restype = ctypes.c_int


def last_error():
    return (lib.hep_last_error() or b"").decode("utf-8", "replace")


def set_error(text, status=8):
    """Make `text` this thread's hep_last_error() (inside a bootstrap callback)."""
    if _set_text is not None:
        _set_text(ctypes.c_int(status), ctypes.c_char_p(b"%s"),
                  ctypes.c_char_p(text.encode("utf-8", "replace")[:2000]))


def check(rc, call=""):
    """HEP_OK: nothing. HEP_WARN_IGNORED: a HybridEPWarning (the call completed). Any
    HEP_ERR_*: a HybridEPError (the call did nothing)."""
    if rc == HEP_WARN_IGNORED:
        import warnings
        warnings.warn(HybridEPWarning("%s: %s" % (call, last_error()) if call else last_error()),
                      stacklevel=3)
    elif rc != HEP_OK:
        raise HybridEPError(rc, last_error(), call)
