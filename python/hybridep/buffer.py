"""hybridep.Buffer: one EP group over a torch.distributed group, dispatch and combine on
torch tensors."""
import ctypes

import torch

from . import _lib
from ._bootstrap import TorchBootstrap

_FP8_DTYPES = tuple(d for d in (getattr(torch, "float8_e4m3fn", None), torch.uint8) if d is not None)
_INDEX_TYPES = {torch.int32: _lib.HEP_INDEX_INT32, torch.int64: _lib.HEP_INDEX_INT64}
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # the pointer, no object


class ThreadWorld:
    """`size` ranks as threads of this process (the C library's in-process bootstrap):
    `Buffer(world.rank(r), ...)` in thread r, on a GPU under
    `with torch.cuda.stream(world.rank(r).stream()):` (a stream of its own, kept for the
    process). What one process driving several virtual ranks needs (one GPU, whose kernels
    have the expert-major layout and the probabilities through combine for ranks of one
    process; the host backend has them across the processes of one node too). Every
    collective waits at most HEP_TIMEOUT_MS and names the ranks that did not come."""

    def __init__(self, size):
        self._w = ctypes.c_void_p()
        _lib.check(_lib.lib.hep_inproc_world_create(int(size), ctypes.byref(self._w)),
                   "hep_inproc_world_create")
        self.size = int(size)

    def rank(self, r):
        return _ThreadRank(self, int(r))

    def close(self):
        """After every Buffer over this world was closed."""
        if self._w:
            _lib.lib.hep_inproc_world_destroy(self._w)
            self._w = ctypes.c_void_p()


class _ThreadRank:
    def __init__(self, world, r):
        self.world = world
        self.rank, self.size = r, world.size
        self.table = _lib.Bootstrap()
        _lib.check(_lib.lib.hep_inproc_bootstrap(world._w, r, ctypes.byref(self.table)),
                   "hep_inproc_bootstrap")

    def stream(self, device=None):
        """This rank's CUDA stream on `device` (an index, "cuda:N" or a torch.device;
        default: torch's current device) as a torch.cuda.ExternalStream, for
        `with torch.cuda.stream(rank.stream()):` around this rank's calls. Made at the
        first call for (device, rank) and the same one for the rest of the process (the C
        library's hep_inproc_stream): virtual ranks on one GPU need a stream each, and
        streams made and dropped per Buffer would soon share a hardware queue with a live
        rank's, whose kernel then waits behind one that waits for it."""
        if device is None:
            index = torch.cuda.current_device()
        elif isinstance(device, int):
            index = device
        else:
            d = torch.device(device)
            index = d.index if d.index is not None else torch.cuda.current_device()
        ptr = ctypes.c_void_p()
        _lib.check(_lib.lib.hep_inproc_stream(int(index), self.rank, ctypes.byref(ptr)),
                   "hep_inproc_stream")
        return torch.cuda.ExternalStream(ptr.value, device=torch.device("cuda", int(index)))


class Handle:
    """What combine needs from its dispatch. `num_tokens` is this rank's t, `num_recv` the
    rows received (an int; with no_sync a 1-element device tensor), `overflow` (no_sync
    only) a device bool tensor: more rows arrived than the receive budget. The routing is
    kept so that the same layout can be dispatched again (handle= of dispatch, and the
    autograd backward)."""

    __slots__ = ("buffer", "id", "num_tokens", "num_recv", "topk_idx", "topk_weights",
                 "backward_handle", "__weakref__")

    def __init__(self, buffer, hid, t, num_recv, topk_idx, topk_weights):
        self.buffer = buffer
        self.id = hid
        self.num_tokens = t
        self.num_recv = num_recv
        self.topk_idx = topk_idx
        self.topk_weights = topk_weights
        self.backward_handle = None

    @property
    def overflow(self):
        """no_sync: a device bool tensor (more rows arrived than recv_budget), computed when
        read (no device work in the call itself); None otherwise."""
        if not isinstance(self.num_recv, torch.Tensor):
            return None
        return self.num_recv[0] > self.buffer.recv_budget


class PermuteHandle:
    """A reusable layout (hep_handle: library-owned, any number alive at once) of an
    expert-major dispatch: combine_with_unpermute takes it any number of times, in any order,
    and dispatch_with_permute(handle=...) dispatches again with its layout (no routing
    needed: the backward of a combine). `num_tokens` (t), `num_permuted` (rows written,
    padding included), `budget` (num_permuted_tokens), `pad_multiple`, `topk_idx` (the
    routing it was laid out with), `overflow` and `overflow_rows` (rows past the budget,
    dropped). Freed when garbage-collected or by close(); it may outlive its Buffer."""

    __slots__ = ("buffer", "_h", "num_tokens", "num_permuted", "budget", "pad_multiple",
                 "topk_idx", "overflow", "overflow_rows", "tokens_per_expert", "__weakref__")

    def __init__(self, buffer):
        self.buffer = buffer
        self._h = ctypes.c_void_p()
        _lib.check(_lib.lib.hep_handle_create(buffer._g, ctypes.byref(self._h)),
                   "hep_handle_create")
        self.num_tokens = self.num_permuted = self.budget = 0
        self.pad_multiple = 1
        self.topk_idx = None
        self.overflow = False
        self.overflow_rows = 0
        self.tokens_per_expert = None

    def close(self):
        h, self._h = self._h, None
        if h:
            _lib.lib.hep_handle_destroy(h)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        return "hybridep.PermuteHandle(num_tokens=%d, num_permuted=%d, budget=%d)" % (
            self.num_tokens, self.num_permuted, self.budget)

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

    group: a torch.distributed process group (None: the default one), or a rank of a
    ThreadWorld (ranks as threads of this process). hidden_dim (H),
    max_num_of_tokens_per_rank (T), num_local_experts (E_l) and use_fp8 as in HybridEP;
    num_sms: SMs of each dispatch and combine kernel (default 16); ranks_per_node: ranks of
    one NVLink domain (default: the ranks of one host); backend: "gpu" (CUDA tensors on the
    current device and stream) or "host" (CPU tensors; the reference semantics, no GPU
    needed); max_topk: most experts per token (default min(8, E_l x W)); no_sync: dispatch
    and combine never wait on the host (CUDA graph capture; see dispatch); recv_budget:
    with no_sync, rows returned by dispatch (default: the capacity, which never overflows);
    timeout_ms: bound of the bootstrap's waits (default HEP_TIMEOUT_MS or 30000);
    max_permuted_rows: rows of the group's expert-major staging (config.max_permuted_rows,
    default 0 = none), which dispatch_with_permute needs on the GPU when the node's ranks
    are processes (torchrun: one process per GPU), and on the host backend across nodes
    with one process per rank for budgets above the receive capacity; it bounds
    num_permuted_tokens (the host backend's: the larger of it and the capacity), and the
    default budget is capped at it (rounded down to pad_multiple).

    Call close() on every rank when done (collective); errors are HybridEPError."""

    def __init__(self, group, hidden_dim, max_num_of_tokens_per_rank, num_local_experts,
                 use_fp8=False, num_sms=None, ranks_per_node=None, backend="gpu",
                 max_topk=None, no_sync=False, recv_budget=None, timeout_ms=None,
                 max_permuted_rows=None):
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
        self._bs = group if isinstance(group, _ThreadRank) else TorchBootstrap(group, timeout_ms)
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
        self._device_index = device_index
        self._cuda = backend == "gpu"
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
        cfg.max_permuted_rows = int(max_permuted_rows or 0)
        self.max_permuted_rows = cfg.max_permuted_rows
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
        # Built once and reused by every call (the per-call cost is the Python around the
        # C call): the argument structs, their byref()s, the bound C functions.
        self._args = _lib.DispatchArgs()
        self._res = _lib.DispatchResult()
        self._cargs = _lib.CombineArgs()
        self._xopts = _lib.DispatchOpts()
        self._copts = _lib.CombineOpts()
        self._p_args, self._p_res = ctypes.byref(self._args), ctypes.byref(self._res)
        self._p_cargs = ctypes.byref(self._cargs)
        self._p_xopts, self._p_copts = ctypes.byref(self._xopts), ctypes.byref(self._copts)
        self._c_dispatch, self._c_combine = _lib.lib.hep_dispatch, _lib.lib.hep_combine
        self._c_dispatch_ex, self._c_combine_ex = _lib.lib.hep_dispatch_ex, _lib.lib.hep_combine_ex
        self._combine_in_ptr = _lib.lib.hep_combine_input(self._g)
        self._flags = _lib.HEP_ASYNC if self.no_sync else 0
        self._tok_dtypes = _FP8_DTYPES if self.use_fp8 else (torch.bfloat16,)
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
            "combine_in": self._raw(self._combine_in_ptr, n * H * 2, torch.bfloat16, (n, H)),
            "host_counts": torch.frombuffer(
                (ctypes.c_int * (1 + El)).from_address(ctypes.addressof(res.host_counts.contents)),
                dtype=torch.int32),
            "key": (res.tokens, tok_dtype),
            "cut": (-1, None),  # (rows, the views of that many rows): reused while rows repeat
        }
        if res.scales:
            v["scales"] = self._raw(res.scales, n * (H // 128) * 4, torch.float32, (n, H // 128))
        v["tpe_host"] = v["host_counts"][1:]
        if self.device.type == "cuda":
            v["num_recv"] = self._raw(res.num_recv_device, 4, torch.int32, (1,))
            v["tpe"] = self._raw(res.tokens_per_expert_device, El * 4, torch.int32, (El,))
        return v

    def _bad(self, name, x, dtypes, shape):
        """The ValueError of a tensor argument that failed the fast check in _arg."""
        if not isinstance(x, torch.Tensor):
            return ValueError("%s must be a torch.Tensor, not %s" % (name, type(x).__name__))
        if x.dtype not in dtypes:
            return ValueError("%s has dtype %s; expected %s" % (
                name, x.dtype, " or ".join(str(d) for d in dtypes)))
        if x.device != self.device:
            return ValueError("%s is on %s; this Buffer (backend=%r) needs %s tensors" % (
                name, x.device, self.backend, self.device))
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        return ValueError("%s has shape %s; expected %s" % (name, list(x.shape), want))

    def _arg(self, name, x, dtypes, d0, d1):
        """x if it is a 2-D tensor [d0, d1] (None: any) of one of `dtypes` on this Buffer's
        device (made contiguous), else a ValueError naming the argument. Written for the
        common case: a few attribute reads, no generator, no device object built."""
        try:
            ok = (x.dtype in dtypes and x.dim() == 2 and (d0 is None or x.shape[0] == d0)
                  and (d1 is None or x.shape[1] == d1)
                  and (x.is_cuda == self._cuda) and (not self._cuda or x.get_device() == self._device_index))
        except AttributeError:
            ok = False
        if not ok:
            raise self._bad(name, x, dtypes, (d0, d1))
        return x if x.is_contiguous() else x.contiguous()

    def _stream(self):
        if self.backend != "gpu":
            return None
        if _raw_stream is not None:
            return _raw_stream(self._device_index)
        return torch.cuda.current_stream(self.device).cuda_stream

    def _alive(self):
        if not self._g:
            raise RuntimeError("hybridep.Buffer is closed")

    def _fill_args(self, hidden, topk_idx, topk_weights, scaling_factor, flags):
        """Checks the dispatch inputs and writes them into the reused hep_dispatch_args.
        topk_idx None: a layout reuse (the handle's routing). Returns t."""
        H = self.hidden_dim
        hidden = self._arg("hidden", hidden, self._tok_dtypes, None, H)
        t = hidden.shape[0]
        if t > self.max_num_of_tokens_per_rank:
            raise ValueError("hidden has %d tokens; this Buffer holds at most %d per rank "
                             "(max_num_of_tokens_per_rank)" % (t, self.max_num_of_tokens_per_rank))
        a = self._args
        if topk_idx is not None:
            topk_idx = self._arg("topk_idx", topk_idx, _INDEX_TYPES, t, None)
            K = topk_idx.shape[1]
            if not 1 <= K <= self.max_topk:
                raise ValueError("topk_idx has %d columns; expected 1..%d (max_topk)" % (K, self.max_topk))
            a.topk_idx = topk_idx.data_ptr()
            a.index_type = _INDEX_TYPES[topk_idx.dtype]
            a.topk = K
        else:
            a.topk_idx = None
            a.topk = 0
            K = None
        if topk_weights is not None:
            topk_weights = self._arg("topk_weights", topk_weights, (torch.float32,), t, K)
            a.topk_weights = topk_weights.data_ptr()
        else:
            a.topk_weights = None
        if self.use_fp8:
            if scaling_factor is None:
                raise ValueError("an FP8 Buffer needs scaling_factor [t, H / 128] float32")
            scaling_factor = self._arg("scaling_factor", scaling_factor, (torch.float32,), t, H // 128)
            a.scales = scaling_factor.data_ptr()
        elif scaling_factor is not None:
            raise ValueError("scaling_factor is only for FP8 Buffers (use_fp8=True)")
        else:
            a.scales = None
        a.num_tokens = t
        a.tokens = hidden.data_ptr()
        a.stream = self._stream()
        a.flags = flags
        # keep the tensors alive (and their storage unchanged) until the call returned
        self._keep = (hidden, topk_idx, topk_weights, scaling_factor)
        return t, topk_idx, topk_weights

    # ------------------------------------------------------------------ the calls
    def dispatch(self, hidden, topk_idx=None, topk_weights=None, scaling_factor=None, handle=None,
                 copy=True):
        """Send each of this rank's tokens to the ranks of its experts.

        hidden [t, H] (BF16; FP8 buffers: float8_e4m3fn or uint8 bytes), topk_idx [t, K]
        int32/int64 global expert ids (-1: unused), topk_weights [t, K] float32,
        scaling_factor [t, H / 128] float32 (FP8 only), t <= max_num_of_tokens_per_rank,
        K <= max_topk. handle: dispatch again with that handle's routing (the same
        layout; topk_idx / topk_weights may then be None).

        Returns (tokens [recv, H], probs [recv, E_l] float32, scaling_factor [recv, H/128]
        or None, tokens_per_expert, handle), rows ordered by [source rank][token]. With
        copy=True (default) the tensors are copies the caller owns; copy=False returns views
        of the group's memory (no pass over the rows: inference), valid until the next
        dispatch or combine on this Buffer (tokens_per_expert then an int32 view of the
        pinned counts). tokens_per_expert is an int64 CPU tensor; with
        no_sync every output has recv = recv_budget rows, tokens_per_expert is an int32
        device tensor, and handle.num_recv / handle.overflow are device tensors (nothing
        is read on the host, so it can be captured into a CUDA graph)."""
        if not self._g:
            self._alive()
        if handle is not None:
            if handle.__class__ is not Handle or handle.buffer is not self:
                raise ValueError("handle is not a handle of this Buffer")
            topk_idx = handle.topk_idx if topk_idx is None else topk_idx
            topk_weights = handle.topk_weights if topk_weights is None else topk_weights
        if topk_idx is None or topk_weights is None:
            raise ValueError("dispatch needs topk_idx and topk_weights (or a handle)")
        t, topk_idx, topk_weights = self._fill_args(hidden, topk_idx, topk_weights,
                                                    scaling_factor, self._flags)
        res = self._res
        rc = self._c_dispatch(self._g, self._p_args, self._p_res)
        self._keep = None
        if rc:
            _lib.check(rc, "hep_dispatch")
        v = self._views
        if v is None or v["key"] != (res.tokens, hidden.dtype):
            v = self._views = self._make_views(res, hidden.dtype)
        if self.no_sync:
            n = self.recv_budget
            num_recv = v["num_recv"].clone() if copy else v["num_recv"]
            h = Handle(self, res.handle, t, num_recv, topk_idx, topk_weights)
            tpe = v["tpe"].clone() if copy else v["tpe"]
        else:
            n = res.num_recv
            h = Handle(self, res.handle, t, n, topk_idx, topk_weights)
            tpe = v["tpe_host"].to(torch.int64) if copy else v["tpe_host"]
        cut = v["cut"]
        if cut[0] == n:
            tokens, probs, scales = cut[1]
        else:
            tokens = v["tokens"][:n]
            probs = v["probs"][:n]
            scales = v["scales"][:n] if "scales" in v else None
            v["cut"] = (n, (tokens, probs, scales))
        if copy:
            tokens, probs = tokens.clone(), probs.clone()
            scales = scales.clone() if scales is not None else None
        self._last = h
        return tokens, probs, scales, tpe, h

    def combine(self, hidden, handle, out=None):
        """Sum, for each of this rank's tokens of `handle`'s dispatch, the rows [recv, H]
        BF16 (`hidden`, in that dispatch's order) of every rank that received it (f32,
        ascending rank; probabilities not applied). Returns out (a new [t, H] BF16 tensor
        unless given). Rows already in the group's combine input (a copy=False dispatch's
        tokens with BF16, or an expert that wrote there) are not copied. Combine follows
        its dispatch, once (reusable layouts: dispatch_with_permute)."""
        if not self._g:
            self._alive()
        if handle.__class__ is not Handle or handle.buffer is not self:
            raise ValueError("handle is not a handle of this Buffer")
        H = self.hidden_dim
        rows = self.recv_budget if self.no_sync else handle.num_recv
        hidden = self._arg("hidden", hidden, (torch.bfloat16,), rows, H)
        t = handle.num_tokens
        if out is None:
            out = torch.empty((t, H), dtype=torch.bfloat16, device=self.device)
        else:
            out = self._arg("out", out, (torch.bfloat16,), t, H)
        c = self._cargs
        c.handle = handle.id
        c.out = out.data_ptr() if t else None
        c.stream = self._stream()
        c.flags = self._flags
        ptr = hidden.data_ptr()
        if self.no_sync and ptr != self._combine_in_ptr:
            # the device count may exceed the budget: the group's own input buffer holds
            # every row, so the combine never reads past the caller's tensor
            self._views["combine_in"][:rows].copy_(hidden)
            ptr = self._combine_in_ptr
        # no rows: still a valid address (the library checks it whenever t > 0)
        c.expert_out = ptr if rows else self._combine_in_ptr
        rc = self._c_combine(self._g, self._p_cargs)
        if rc:
            _lib.check(rc, "hep_combine")
        return out

    # ------------------------------------------------------------- the training API
    def _budget(self, pad):
        """The row budget that never overflows: every received row on min(K, E_l) local
        experts, each block padded."""
        El = self.num_local_experts
        rows = self.max_recv_rows * min(self.max_topk, El) + El * (pad - 1)
        rows = (rows + pad - 1) // pad * pad
        if self.max_permuted_rows:  # the staging's rows bound the budget
            rows = min(rows, max(pad, self.max_permuted_rows // pad * pad))
        return rows

    def dispatch_with_permute(self, hidden, topk_idx=None, topk_weights=None,
                              scaling_factor=None, pad_multiple=1, num_permuted_tokens=None,
                              handle=None):
        """Dispatch into the expert-major layout (hep_dispatch_ex, HEP_LAYOUT_EXPERT_MAJOR):
        each local expert's rows contiguous (a token routed to two local experts appears
        twice), in receive order, each expert's block padded with zero rows to a multiple of
        pad_multiple, one float32 probability a row (the token's weights on that expert).

        num_permuted_tokens: the row budget (a multiple of pad_multiple; default: the count
        that never overflows, max_recv_rows x min(max_topk, E_l) plus padding, which can be
        large: pass your own; with max_permuted_rows, at most that); rows past it are dropped, the highest experts' first, and
        handle.overflow / overflow_rows say so. handle: a PermuteHandle to record the layout
        into (default: a new one), or, with topk_idx None, one whose layout to dispatch
        again (HEP_REUSE_LAYOUT: no routing pass; topk_weights [t, K] or None for the
        recorded weights; pad_multiple and the budget are the handle's).

        Returns (tokens [rows, H], probs [rows] float32, scaling_factor [rows, H/128] or None,
        tokens_per_expert int64 CPU [E_l] (padded block sizes), handle) with rows = the rows
        written (handle.num_permuted; no_sync: the budget). Tensors are the caller's (what
        a training framework saves for its backward). Raises HybridEPError with the
        library's message where the backend lacks it (HEP_ERR_UNAVAILABLE: the GPU kernels
        across nodes, or across processes without max_permuted_rows) or refuses the budget
        (HEP_ERR_INVALID: above max_permuted_rows there; the host backend across nodes with
        a node's ranks in several processes above both max_recv_rows and
        max_permuted_rows)."""
        if not self._g:
            self._alive()
        reuse = handle is not None and topk_idx is None
        if handle is not None and (handle.__class__ is not PermuteHandle or handle.buffer is not self):
            raise ValueError("handle is not a PermuteHandle of this Buffer")
        if handle is None and topk_idx is None:
            raise ValueError("dispatch_with_permute needs topk_idx (or a handle whose layout "
                             "to reuse)")
        if reuse:
            if handle.topk_idx is None:
                raise ValueError("handle holds no layout yet (no dispatch_with_permute recorded one)")
            pad, budget = handle.pad_multiple, handle.budget
        else:
            pad = int(pad_multiple or 1)
            if not 1 <= pad <= _lib.HEP_MAX_PAD_MULTIPLE:
                raise ValueError("pad_multiple = %d is not in 1..%d" % (pad, _lib.HEP_MAX_PAD_MULTIPLE))
            budget = int(num_permuted_tokens) if num_permuted_tokens else self._budget(pad)
            if budget <= 0 or budget % pad:
                raise ValueError("num_permuted_tokens = %d is not a positive multiple of "
                                 "pad_multiple %d" % (budget, pad))
            if topk_weights is None:
                raise ValueError("dispatch_with_permute needs topk_weights with topk_idx")
        flags = self._flags | (_lib.HEP_REUSE_LAYOUT if reuse else 0)
        t, topk_idx, topk_weights = self._fill_args(hidden, None if reuse else topk_idx,
                                                    topk_weights, scaling_factor, flags)
        if reuse and t != handle.num_tokens:
            raise ValueError("hidden has %d tokens; the handle's layout is of %d" % (
                t, handle.num_tokens))
        if handle is None:
            handle = PermuteHandle(self)
        H = self.hidden_dim
        tokens = torch.empty((budget, H), dtype=hidden.dtype, device=self.device)
        probs = torch.empty((budget,), dtype=torch.float32, device=self.device)
        scales = (torch.empty((budget, H // 128), dtype=torch.float32, device=self.device)
                  if self.use_fp8 else None)
        x = self._xopts
        x.handle = handle._h
        x.layout = _lib.HEP_LAYOUT_EXPERT_MAJOR
        x.pad_multiple = pad
        x.num_permuted_tokens = budget
        x.recv_tokens = tokens.data_ptr()
        x.recv_probs = probs.data_ptr()
        x.recv_scales = scales.data_ptr() if scales is not None else None
        rc = self._c_dispatch_ex(self._g, self._p_args, self._p_xopts, self._p_res)
        self._keep = None
        if rc:
            _lib.check(rc, "hep_dispatch_ex")
        El = self.num_local_experts
        tpe = torch.tensor([x.tokens_per_expert[e] for e in range(El)], dtype=torch.int64) \
            if x.tokens_per_expert else torch.zeros((El,), dtype=torch.int64)
        if not reuse:
            handle.num_tokens, handle.budget, handle.pad_multiple = t, budget, pad
            handle.topk_idx = topk_idx
        handle.num_permuted = x.num_permuted
        handle.overflow, handle.overflow_rows = bool(x.overflow), x.overflow_rows
        handle.tokens_per_expert = tpe
        n = budget if self.no_sync else x.num_permuted
        return (tokens[:n], probs[:n], scales[:n] if scales is not None else None, tpe, handle)

    def combine_with_unpermute(self, hidden, handle, probs=None):
        """Combine expert-major rows (hep_combine_ex with the handle's layout): for each of
        this rank's tokens, the f32 sum over its rows (ascending destination rank, then
        ascending local expert), BF16. hidden [rows, H] BF16 with rows between
        handle.num_permuted and handle.budget, in the positions dispatch_with_permute gave.
        probs: None, or [rows] float32, one a row (the gradient of dispatch's probs),
        carried back to each token's expert slot.

        Returns (tokens [t, H] BF16, probs [t, E] float32 or None: for each token and global
        expert its slots chose, the value of that expert's row; 0 elsewhere and for a dropped
        row). Any live handle, any order, any number of times."""
        if not self._g:
            self._alive()
        if handle.__class__ is not PermuteHandle or handle.buffer is not self:
            raise ValueError("handle is not a PermuteHandle of this Buffer")
        if handle.topk_idx is None or not handle._h:
            raise ValueError("handle holds no layout (no dispatch_with_permute recorded one, "
                             "or it was closed)")
        H = self.hidden_dim
        hidden = self._arg("hidden", hidden, (torch.bfloat16,), None, H)
        rows = hidden.shape[0]
        if not handle.num_permuted <= rows <= handle.budget:
            raise ValueError("hidden has %d rows; this handle's layout has %d (budget %d)" % (
                rows, handle.num_permuted, handle.budget))
        t = handle.num_tokens
        out = torch.empty((t, H), dtype=torch.bfloat16, device=self.device)
        co = self._copts
        co.handle = handle._h
        pout = None
        if probs is not None:
            if not isinstance(probs, torch.Tensor) or probs.dtype != torch.float32 or \
                    probs.dim() != 1 or probs.shape[0] != rows or probs.device != self.device:
                raise ValueError("probs must be a float32 [%d] tensor on %s (one a row), not %s" % (
                    rows, self.device, _describe(probs)))
            probs = probs.contiguous()
            pout = torch.empty((t, self.num_local_experts * self.world), dtype=torch.float32,
                               device=self.device)
            # no rows or no tokens: still valid addresses (NULL means "no probabilities")
            self._pdummy = torch.zeros((1,), dtype=torch.float32, device=self.device)
            co.probs_in = probs.data_ptr() if rows else self._pdummy.data_ptr()
            co.probs_out = pout.data_ptr() if t else self._pdummy.data_ptr()
        else:
            co.probs_in = co.probs_out = None
        c = self._cargs
        c.handle = 0
        c.out = out.data_ptr() if t else None
        c.expert_out = hidden.data_ptr() if rows else self._combine_in_ptr
        c.stream = self._stream()
        c.flags = self._flags
        rc = self._c_combine_ex(self._g, self._p_cargs, self._p_copts)
        if rc:
            _lib.check(rc, "hep_combine_ex")
        return out, pout

    def sync(self):
        """Wait for the current stream and raise the first error of a no_sync call."""
        self._alive()
        _lib.check(_lib.lib.hep_group_sync(self._g, self._stream()), "hep_group_sync")

    def close(self):
        """Collective: release the group (every rank calls it). Live PermuteHandles stay
        valid objects (refused by any group) and are freed with them."""
        if self._g:
            g, self._g = self._g, ctypes.c_void_p()
            self._views = None
            _lib.check(_lib.lib.hep_group_destroy(g), "hep_group_destroy")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _describe(x):
    if isinstance(x, torch.Tensor):
        return "%s %s on %s" % (x.dtype, list(x.shape), x.device)
    return type(x).__name__
