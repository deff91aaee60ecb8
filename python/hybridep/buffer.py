"""hybridep.Buffer: one EP group over a torch.distributed group, dispatch and combine on
torch tensors."""
import ctypes

import torch

from . import _lib
from ._bootstrap import TorchBootstrap

_FP8_DTYPES = tuple(d for d in (getattr(torch, "float8_e4m3fn", None), torch.uint8) if d is not None)


class Handle:
    """What combine needs from its dispatch. `num_tokens` is this rank's t, `num_recv` the
    rows received (an int; with no_sync a 1-element device tensor), `overflow` (no_sync
    only) a device bool tensor: more rows arrived than the receive budget. The routing is
    kept so that the same layout can be dispatched again (handle= of dispatch, and the
    autograd backward)."""

    __slots__ = ("buffer", "id", "num_tokens", "num_recv", "topk_idx", "topk_weights",
                 "overflow", "backward_handle", "__weakref__")

    def __init__(self, buffer, hid, t, num_recv, topk_idx, topk_weights, overflow=None):
        self.buffer = buffer
        self.id = hid
        self.num_tokens = t
        self.num_recv = num_recv
        self.topk_idx = topk_idx
        self.topk_weights = topk_weights
        self.overflow = overflow
        self.backward_handle = None

    def __repr__(self):
        return "hybridep.Handle(id=%d, num_tokens=%d, num_recv=%s)" % (
            self.id, self.num_tokens, self.num_recv)


class _CudaArray:
    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 2}


class Buffer:
    """A hybridep group over `group` (collective: every rank of the group constructs it,
    in the same order as its other Buffers).

    hidden_dim (H), max_num_of_tokens_per_rank (T), num_local_experts (E_l) and use_fp8 as
    in HybridEP; num_sms: SMs of each dispatch and combine kernel (default 16);
    ranks_per_node: ranks of one NVLink domain (default: the ranks of one host);
    backend: "gpu" (CUDA tensors on the current device and stream) or "host" (CPU
    tensors; the reference semantics, no GPU needed); max_topk: most experts per token
    (default min(8, E_l x W)); no_sync: dispatch and combine never wait on the host
    (CUDA graph capture; see dispatch); recv_budget: with no_sync, rows returned by
    dispatch (default: the capacity, which never overflows); timeout_ms: bound of the
    bootstrap's waits (default HEP_TIMEOUT_MS or 30000).

    Call close() on every rank when done (collective); errors are HybridEPError."""

    def __init__(self, group, hidden_dim, max_num_of_tokens_per_rank, num_local_experts,
                 use_fp8=False, num_sms=None, ranks_per_node=None, backend="gpu",
                 max_topk=None, no_sync=False, recv_budget=None, timeout_ms=None):
        if backend not in ("gpu", "host"):
            raise ValueError("hybridep.Buffer: backend must be 'gpu' or 'host', not %r" % (backend,))
        self.group = group
        self.backend = backend
        self.hidden_dim = int(hidden_dim)
        self.max_num_of_tokens_per_rank = int(max_num_of_tokens_per_rank)
        self.num_local_experts = int(num_local_experts)
        self.use_fp8 = bool(use_fp8)
        self.no_sync = bool(no_sync)
        self._g = ctypes.c_void_p()
        self._bs = TorchBootstrap(group, timeout_ms)
        self.rank, self.world = self._bs.rank, self._bs.size
        if self.no_sync and backend != "gpu":
            raise ValueError("hybridep.Buffer: no_sync needs backend='gpu'")
        self.device = torch.device("cpu")
        device_index = 0
        if backend == "gpu":
            if not torch.cuda.is_available():
                raise RuntimeError("hybridep.Buffer(backend='gpu'): torch sees no CUDA device; "
                                   "use backend='host' on a machine without a GPU")
            device_index = torch.cuda.current_device()
            self.device = torch.device("cuda", device_index)
        cfg = _lib.Config()
        _lib.lib.hep_config_default(ctypes.byref(cfg))
        cfg.hidden = self.hidden_dim
        cfg.max_tokens = self.max_num_of_tokens_per_rank
        cfg.experts_per_rank = self.num_local_experts
        cfg.max_topk = int(max_topk) if max_topk else min(8, self.num_local_experts * self.world)
        cfg.dtype = _lib.HEP_DTYPE_FP8_E4M3 if self.use_fp8 else _lib.HEP_DTYPE_BF16
        cfg.ranks_per_node = int(ranks_per_node or 0)
        if num_sms:
            cfg.dispatch_sms = cfg.combine_sms = int(num_sms)
        cfg.backend = _lib.HEP_BACKEND_GPU if backend == "gpu" else _lib.HEP_BACKEND_HOST
        self.max_topk = cfg.max_topk
        self._cfg = cfg
        rc = _lib.lib.hep_group_create(ctypes.byref(cfg), ctypes.byref(self._bs.table),
                                       device_index, ctypes.byref(self._g))
        _lib.check(rc, "hybridep.Buffer")
        info = _lib.GroupInfo()
        _lib.check(_lib.lib.hep_group_get_info(self._g, ctypes.byref(info)), "hep_group_get_info")
        self.num_nodes = info.nodes
        self.ranks_per_node = info.ranks_per_node
        self.local_rank = info.local_rank
        self.max_recv_rows = info.max_recv_rows
        self.transport = info.transport.decode()
        self.recv_budget = int(recv_budget) if recv_budget else self.max_recv_rows
        if not 0 < self.recv_budget <= self.max_recv_rows:
            raise ValueError("recv_budget = %d is not in 1..%d" % (self.recv_budget,
                                                                   self.max_recv_rows))
        self._args = _lib.DispatchArgs()
        self._res = _lib.DispatchResult()
        self._cargs = _lib.CombineArgs()
        self._views = None
        self._last = None

    # ------------------------------------------------------------------ helpers
    def _raw(self, ptr, nbytes, dtype, shape):
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype, device=self.device)
        if self.device.type == "cpu":
            buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
            t = torch.frombuffer(buf, dtype=torch.uint8)
        else:
            t = torch.as_tensor(_CudaArray(ptr, nbytes), device=self.device)
        return t.view(dtype).view(shape)

    def _make_views(self, res, tok_dtype):
        """Tensors over the group's fixed output buffers (valid until the next dispatch)."""
        H, El, n = self.hidden_dim, self.num_local_experts, self.max_recv_rows
        esz = 1 if self.use_fp8 else 2
        v = {
            "tokens": self._raw(res.tokens, n * H * esz, tok_dtype, (n, H)),
            "probs": self._raw(res.probs, n * El * 4, torch.float32, (n, El)),
            "combine_in": self._raw(_lib.lib.hep_combine_input(self._g), n * H * 2,
                                    torch.bfloat16, (n, H)),
            "host_counts": torch.frombuffer(
                (ctypes.c_int * (1 + El)).from_address(ctypes.addressof(res.host_counts.contents)),
                dtype=torch.int32),
            "key": (res.tokens, tok_dtype),
        }
        if res.scales:
            v["scales"] = self._raw(res.scales, n * (H // 128) * 4, torch.float32, (n, H // 128))
        if self.device.type == "cuda":
            v["num_recv"] = self._raw(res.num_recv_device, 4, torch.int32, (1,))
            v["tpe"] = self._raw(res.tokens_per_expert_device, El * 4, torch.int32, (El,))
        return v

    def _check_tensor(self, name, x, dtypes, shape):
        if not isinstance(x, torch.Tensor):
            raise ValueError("%s must be a torch.Tensor, not %s" % (name, type(x).__name__))
        if x.dtype not in dtypes:
            raise ValueError("%s has dtype %s; expected %s" % (
                name, x.dtype, " or ".join(str(d) for d in dtypes)))
        if x.dim() != len(shape) or any(s is not None and x.shape[i] != s
                                        for i, s in enumerate(shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError("%s has shape %s; expected %s" % (name, list(x.shape), want))
        if x.device != self.device:
            raise ValueError("%s is on %s; this Buffer (backend=%r) needs %s tensors" % (
                name, x.device, self.backend, self.device))
        return x.contiguous()

    def _stream(self):
        return torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else None

    def _alive(self):
        if not self._g:
            raise RuntimeError("hybridep.Buffer is closed")

    # ------------------------------------------------------------------ the calls
    def dispatch(self, hidden, topk_idx=None, topk_weights=None, scaling_factor=None, handle=None):
        """Send each of this rank's tokens to the ranks of its experts.

        hidden [t, H] (BF16; FP8 buffers: float8_e4m3fn or uint8 bytes), topk_idx [t, K]
        int32/int64 global expert ids (-1: unused), topk_weights [t, K] float32,
        scaling_factor [t, H / 128] float32 (FP8 only), t <= max_num_of_tokens_per_rank,
        K <= max_topk. handle: dispatch again with that handle's routing (the same
        layout; topk_idx / topk_weights may then be None).

        Returns (tokens [recv, H], probs [recv, E_l] float32, scaling_factor [recv, H/128]
        or None, tokens_per_expert, handle), rows ordered by [source rank][token]. The
        tensors are copies the caller owns. tokens_per_expert is an int64 CPU tensor; with
        no_sync every output has recv = recv_budget rows, tokens_per_expert is an int32
        device tensor, and handle.num_recv / handle.overflow are device tensors (nothing
        is read on the host, so it can be captured into a CUDA graph)."""
        self._alive()
        H = self.hidden_dim
        if handle is not None:
            if not isinstance(handle, Handle) or handle.buffer is not self:
                raise ValueError("handle is not a handle of this Buffer")
            topk_idx = handle.topk_idx if topk_idx is None else topk_idx
            topk_weights = handle.topk_weights if topk_weights is None else topk_weights
        if topk_idx is None or topk_weights is None:
            raise ValueError("dispatch needs topk_idx and topk_weights (or a handle)")
        tok_dtypes = _FP8_DTYPES if self.use_fp8 else (torch.bfloat16,)
        hidden = self._check_tensor("hidden", hidden, tok_dtypes, (None, H))
        t = hidden.shape[0]
        if t > self.max_num_of_tokens_per_rank:
            raise ValueError("hidden has %d tokens; this Buffer holds at most %d per rank "
                             "(max_num_of_tokens_per_rank)" % (t, self.max_num_of_tokens_per_rank))
        topk_idx = self._check_tensor("topk_idx", topk_idx, (torch.int32, torch.int64), (t, None))
        K = topk_idx.shape[1]
        if not 1 <= K <= self.max_topk:
            raise ValueError("topk_idx has %d columns; expected 1..%d (max_topk)" % (K, self.max_topk))
        topk_weights = self._check_tensor("topk_weights", topk_weights, (torch.float32,), (t, K))
        if self.use_fp8:
            if scaling_factor is None:
                raise ValueError("an FP8 Buffer needs scaling_factor [t, H / 128] float32")
            scaling_factor = self._check_tensor("scaling_factor", scaling_factor,
                                                (torch.float32,), (t, H // 128))
        elif scaling_factor is not None:
            raise ValueError("scaling_factor is only for FP8 Buffers (use_fp8=True)")
        a = self._args
        a.num_tokens = t
        a.tokens = hidden.data_ptr()
        a.scales = scaling_factor.data_ptr() if scaling_factor is not None else None
        a.topk_idx = topk_idx.data_ptr()
        a.index_type = _lib.HEP_INDEX_INT64 if topk_idx.dtype == torch.int64 else _lib.HEP_INDEX_INT32
        a.topk = K
        a.topk_weights = topk_weights.data_ptr()
        a.stream = self._stream()
        a.flags = _lib.HEP_ASYNC if self.no_sync else 0
        res = self._res
        _lib.check(_lib.lib.hep_dispatch(self._g, ctypes.byref(a), ctypes.byref(res)),
                   "hep_dispatch")
        v = self._views
        if v is None or v["key"] != (res.tokens, hidden.dtype):
            v = self._views = self._make_views(res, hidden.dtype)
        if self.no_sync:
            n = self.recv_budget
            num_recv = v["num_recv"].clone()
            h = Handle(self, res.handle, t, num_recv, topk_idx, topk_weights,
                       overflow=num_recv[0] > n)
            tpe = v["tpe"].clone()
        else:
            n = res.num_recv
            h = Handle(self, res.handle, t, n, topk_idx, topk_weights)
            tpe = v["host_counts"][1:].to(torch.int64)
        tokens = v["tokens"][:n].clone()
        probs = v["probs"][:n].clone()
        scales = v["scales"][:n].clone() if "scales" in v else None
        self._last = h
        return tokens, probs, scales, tpe, h

    def combine(self, hidden, handle):
        """Sum, for each of this rank's tokens of `handle`'s dispatch, the rows [recv, H]
        BF16 (`hidden`, in that dispatch's order) of every rank that received it (f32,
        ascending rank; probabilities not applied). Returns a new [t, H] BF16 tensor.
        Combine follows its dispatch, once (reusable handles: the training-API issue)."""
        self._alive()
        if not isinstance(handle, Handle) or handle.buffer is not self:
            raise ValueError("handle is not a handle of this Buffer")
        H = self.hidden_dim
        rows = self.recv_budget if self.no_sync else handle.num_recv
        hidden = self._check_tensor("hidden", hidden, (torch.bfloat16,), (rows, H))
        out = torch.empty((handle.num_tokens, H), dtype=torch.bfloat16, device=self.device)
        c = self._cargs
        c.handle = handle.id
        c.out = out.data_ptr() if handle.num_tokens else None
        c.stream = self._stream()
        c.flags = _lib.HEP_ASYNC if self.no_sync else 0
        if self.no_sync:
            # the device count may exceed the budget: the group's own input buffer holds
            # every row, so the combine never reads past the caller's tensor
            self._views["combine_in"][:rows].copy_(hidden)
            c.expert_out = self._views["combine_in"].data_ptr()
        else:
            # no rows: still a valid address (the library checks it whenever t > 0)
            c.expert_out = hidden.data_ptr() if rows else _lib.lib.hep_combine_input(self._g)
        _lib.check(_lib.lib.hep_combine(self._g, ctypes.byref(c)), "hep_combine")
        return out

    def sync(self):
        """Wait for the current stream and raise the first error of a no_sync call."""
        self._alive()
        _lib.check(_lib.lib.hep_group_sync(self._g, self._stream()), "hep_group_sync")

    def close(self):
        """Collective: release the group (every rank calls it)."""
        if self._g:
            g, self._g = self._g, ctypes.c_void_p()
            self._views = None
            _lib.check(_lib.lib.hep_group_destroy(g), "hep_group_destroy")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
