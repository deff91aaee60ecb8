"""The C bootstrap table (hybridep/bootstrap.h) over a torch.distributed group.

allgather and barrier go through the key-value store of the default process group: each
rank writes its bytes under its own key and waits for every other rank's key with a
timeout (HEP_TIMEOUT_MS, as the C bootstraps), so a rank that never arrives is named on
every rank that waited. Keys of a call are deleted two calls later (by then every rank
has read them). Without a reachable store (a torch without the private accessor) the
group's own collectives are used, bounded only by the group's timeout."""
import ctypes
import datetime
import itertools
import os
import threading

import torch.distributed as dist

from . import _lib

_prefix_counter = {}
_prefix_lock = threading.Lock()


def default_timeout_ms():
    try:
        v = int(os.environ.get("HEP_TIMEOUT_MS", "30000"))
        return v if v > 0 else 30000
    except ValueError:
        return 30000  # the C library warns about the value itself


def _group_ranks(group):
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    if hasattr(dist, "get_process_group_ranks"):
        return list(dist.get_process_group_ranks(group))
    return sorted(dist.distributed_c10d._pg_group_ranks[group].keys())


def _default_store():
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return get() if get else None
    except Exception:
        return None


class TorchBootstrap:
    """Owns the ctypes callbacks and the hep_bootstrap table; keep it alive as long as the
    C group that uses it."""

    def __init__(self, group, timeout_ms=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("hybridep: torch.distributed is not initialized "
                               "(call torch.distributed.init_process_group first)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.global_ranks = _group_ranks(group)
        self.timeout_ms = timeout_ms or default_timeout_ms()
        self.store = _default_store()
        key = ",".join(map(str, self.global_ranks))
        with _prefix_lock:  # every member creates its buffers in the same order
            n = _prefix_counter.get(key, 0)
            _prefix_counter[key] = n + 1
        self.prefix = "hybridep/%s/%d" % (key, n)
        self.seq = itertools.count(1)
        self.broken = None
        self.error = ""
        self._ag = _lib.ALLGATHER_FN(self._allgather)
        self._bar = _lib.BARRIER_FN(self._barrier)
        self.table = _lib.Bootstrap(self.rank, self.size, None, self._ag, self._bar)

    def _name(self, r):
        g = self.global_ranks[r]
        return "rank %d" % r if g == r else "rank %d (global rank %d)" % (r, g)

    def _fail(self, status, text):
        self.error = text
        _lib.set_error(text, status)
        return status

    def _allgather(self, ctx, send, recv, nbytes):
        try:
            if self.broken:
                return self._fail(_lib.HEP_ERR_BOOTSTRAP, self.broken)
            data = ctypes.string_at(send, nbytes) if nbytes else b""
            parts = self._gather_store(data) if self.store else self._gather_group(data)
            if isinstance(parts, int):
                return parts
            for r, p in enumerate(parts):
                if len(p) != nbytes:
                    return self._fail(_lib.HEP_ERR_BOOTSTRAP,
                                      "bootstrap allgather: %s sent %d bytes, this rank %d"
                                      % (self._name(r), len(p), nbytes))
                if nbytes:
                    ctypes.memmove(recv + r * nbytes, p, nbytes)
            return 0
        except BaseException as e:  # never let an exception cross into C
            self.broken = "bootstrap allgather on %s failed: %s: %s" % (
                self._name(self.rank), type(e).__name__, e)
            return self._fail(_lib.HEP_ERR_BOOTSTRAP, self.broken)

    def _gather_store(self, data):
        seq = next(self.seq)
        keys = ["%s/%d/%d" % (self.prefix, seq, r) for r in range(self.size)]
        self.store.set(keys[self.rank], data)
        try:
            self.store.wait(keys, datetime.timedelta(milliseconds=self.timeout_ms))
        except Exception:
            missing = [r for r in range(self.size) if not self._present(keys[r])]
            names = ", ".join(self._name(r) for r in missing) or "a rank (store error)"
            self.broken = ("bootstrap allgather #%d timed out on %s after %d ms (HEP_TIMEOUT_MS): "
                           "%s did not arrive" % (seq, self._name(self.rank), self.timeout_ms,
                                                  names))
            return self._fail(_lib.HEP_ERR_TIMEOUT, self.broken)
        parts = [self.store.get(k) for k in keys]
        if seq > 2 and hasattr(self.store, "delete_key"):
            try:
                self.store.delete_key("%s/%d/%d" % (self.prefix, seq - 2, self.rank))
            except Exception:
                pass  # a store without deletion keeps a few bytes per call
        return parts

    def _present(self, key):
        try:
            self.store.wait([key], datetime.timedelta(milliseconds=1))
            return True
        except Exception:
            return False

    def _gather_group(self, data):
        out = [None] * self.size
        dist.all_gather_object(out, data, group=self.group)
        return out

    def _barrier(self, ctx):
        buf = ctypes.create_string_buffer(self.size)
        one = ctypes.create_string_buffer(b"\x01", 1)
        return self._allgather(ctx, ctypes.addressof(one), ctypes.addressof(buf), 1)
