"""HybridEPBuffer: HybridEP's constructor and call signatures over hybridep.Buffer, so code
written against deep_ep.HybridEPBuffer runs by changing the import.

Differences, where our contents cannot be HybridEP's: the handle tuples hold our Handle
(dispatch) or PermuteHandle (dispatch_with_permute) and the tokens of this rank; combine
(rank-major) takes no probs (use the permute pair for the router gradient);
dispatch_with_permute and combine_with_unpermute go through the C training API
(hep_dispatch_ex with HEP_LAYOUT_EXPERT_MAJOR, hep_combine_ex with the probabilities),
which raises HybridEPError (the library's message) where a backend lacks it (the GPU
kernels across nodes, for one).

One process per rank on the GPU (torchrun): the GPU kernels write expert-major rows into a
group-owned staging (config.max_permuted_rows) there, since a node-mate's caller memory
is in another process. Unless max_permuted_rows is given, the staging is sized as HybridEP
sizes its non-blocking output: every row a rank can receive on one node, max tokens x
ranks x min(top-k, local experts), plus the padding of a pad_multiple up to 128 per local
expert, at 2 x hidden + 4 bytes a row (more with FP8 scales). Pass a smaller
max_permuted_rows to spend less; a dispatch_with_permute whose num_permuted_tokens
exceeds it is refused with a message that says so. The host backend with one process per
rank across nodes stages the rows that do not fit its receive capacity there too, and
gets the same default."""
import torch

from .buffer import Buffer, Handle, PermuteHandle, _ThreadRank

STAGING_PAD = 128  # the largest pad_multiple the default staging leaves room for


def default_staging_rows(max_tokens, ranks_per_node, num_local_experts, max_topk):
    """The staging rows that never refuse a dispatch_with_permute on one node: every token
    of every node-mate on min(top-k, local experts) of this rank's experts, each local
    expert's block padded to a multiple of up to STAGING_PAD rows."""
    rows = (max_tokens * ranks_per_node * min(max_topk, num_local_experts)
            + num_local_experts * (STAGING_PAD - 1))
    return (rows + STAGING_PAD - 1) // STAGING_PAD * STAGING_PAD


def _routing_to_topk(routing_map, probs):
    """[t, E] bool map (+ [t, E] probs) -> topk_idx [t, K] int64 (-1 padded), weights."""
    t, E = routing_map.shape
    K = max(1, int(routing_map.sum(dim=1).max())) if t else 1
    order = torch.sort((~routing_map).to(torch.int8), dim=1, stable=True).indices[:, :K]
    hit = torch.gather(routing_map, 1, order)
    idx = torch.where(hit, order, torch.full_like(order, -1))
    w = torch.gather(probs.float(), 1, order) if probs is not None else hit.float()
    return idx, torch.where(hit, w, torch.zeros_like(w))


class HybridEPBuffer:
    def __init__(self, group, hidden_dim, max_num_of_tokens_per_rank, num_local_experts,
                 use_fp8=False, num_sms_dispatch_api=32, num_sms_combine_api=32,
                 num_sms_preprocessing_api=128, nvlink_domain_size=None, backend=None,
                 max_topk=None, max_permuted_rows=None):
        import torch.distributed as dist
        self.group = group
        if isinstance(group, _ThreadRank):  # ranks as threads of one process
            self.group_size, self.rank = group.size, group.rank
        else:
            self.group_size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
        if backend is None:
            backend = "gpu" if torch.cuda.is_available() else "host"
        # one SM count for both kernels in hybridep (the preprocessing is fused)
        sms = max(num_sms_dispatch_api, num_sms_combine_api) if backend == "gpu" else None
        ranks_per_node = min(nvlink_domain_size, self.group_size) if nvlink_domain_size else None
        self.num_of_experts_per_rank = num_local_experts
        self.use_fp8 = use_fp8
        max_topk = max_topk or min(32, num_local_experts * self.group_size)
        one_node = ranks_per_node is None or ranks_per_node >= self.group_size
        if (max_permuted_rows is None and not isinstance(group, _ThreadRank)
                and (backend == "gpu") == one_node):
            # processes of one node (GPU), or of several nodes (host backend): the permute
            # pair needs the staging (see above)
            max_permuted_rows = default_staging_rows(max_num_of_tokens_per_rank,
                                                     self.group_size, num_local_experts,
                                                     max_topk)
        self._buf = Buffer(group, hidden_dim, max_num_of_tokens_per_rank, num_local_experts,
                           use_fp8=use_fp8, num_sms=sms, ranks_per_node=ranks_per_node,
                           backend=backend, max_topk=max_topk,
                           max_permuted_rows=max_permuted_rows)
        self.num_of_ranks_per_node = self._buf.ranks_per_node
        self.num_of_nodes = self._buf.num_nodes
        self.local_rank = self._buf.local_rank
        self.node_rank = self.rank // self.num_of_ranks_per_node

    @property
    def buffer(self):
        return self._buf

    def dispatch(self, hidden, scaling_factor=None, topk_idx=None, topk_weights=None,
                 num_of_experts=None, probs=None, routing_map=None,
                 num_dispatched_tokens_tensor=None, num_dispatched_tokens=None, handle=None):
        """-> (dispatched_token, dispatched_probs [recv, E_l], dispatched_scaling_factor,
        handle). Routing by topk_idx/topk_weights or by routing_map/probs [t, E]; with a
        handle, that dispatch's routing again."""
        h = handle[0] if handle is not None else None
        if h is None and topk_idx is None:
            if routing_map is None:
                raise ValueError("dispatch needs topk_idx, routing_map or a handle")
            topk_idx, topk_weights = _routing_to_topk(routing_map, probs)
        elif topk_idx is not None and topk_weights is None:
            topk_weights = torch.ones(topk_idx.shape, dtype=torch.float32, device=topk_idx.device)
        tokens, p, sf, tpe, hh = self._buf.dispatch(hidden, topk_idx, topk_weights,
                                                    scaling_factor=scaling_factor, handle=h)
        return tokens, p, sf, (hh, hidden.shape[0], tpe)

    def combine(self, hidden, probs=None, handle=None):
        """-> (combined_token, combined_probs); combined_probs is None (see the module)."""
        if handle is None:
            raise ValueError("combine needs the handle of its dispatch")
        if probs is not None:
            raise NotImplementedError("combine with probs: the rank-major combine carries no "
                                      "probabilities here; dispatch_with_permute and "
                                      "combine_with_unpermute carry them")
        return self._buf.combine(hidden, handle[0]), None

    def dispatch_with_permute(self, *, hidden, topk_idx=None, topk_weights=None,
                              num_of_experts_per_rank=None, num_of_experts=None, use_fp8=None,
                              routing_map=None, probs=None, scaling_factor=None,
                              num_dispatched_tokens=None, num_permuted_tokens=None,
                              pad_multiple=None, handle=None, use_host_meta=True):
        """-> (dispatched_token [rows, H], dispatched_probs [rows] float32 (one a row),
        dispatched_scaling_factor, tokens_per_expert int64 [E_l] (padded), handle). Routing
        by topk_idx/topk_weights or routing_map/probs [t, E]; with a handle and no routing,
        that layout again (the backward of combine_with_unpermute)."""
        if num_of_experts_per_rank not in (None, self.num_of_experts_per_rank):
            raise ValueError("num_of_experts_per_rank = %s, but this buffer has %d" % (
                num_of_experts_per_rank, self.num_of_experts_per_rank))
        ph = handle[0] if handle is not None else None
        if ph is not None and topk_idx is None and routing_map is None:
            tok, p, sf, tpe, ph = self._buf.dispatch_with_permute(hidden, handle=ph)
            return tok, p, sf, tpe, (ph, hidden.shape[0])
        if topk_idx is None:
            if routing_map is None:
                raise ValueError("dispatch_with_permute needs topk_idx, routing_map or a handle")
            topk_idx, topk_weights = _routing_to_topk(routing_map, probs)
        elif topk_weights is None:
            topk_weights = torch.ones(topk_idx.shape, dtype=torch.float32, device=topk_idx.device)
        tok, p, sf, tpe, ph = self._buf.dispatch_with_permute(
            hidden, topk_idx, topk_weights.float().contiguous(), scaling_factor=scaling_factor,
            pad_multiple=pad_multiple or 1, num_permuted_tokens=num_permuted_tokens, handle=ph)
        return tok, p, sf, tpe, (ph, hidden.shape[0])

    def combine_with_unpermute(self, *, hidden, probs=None, handle=None, pad_multiple=None,
                               num_dispatched_tokens=None, **kwargs):
        """-> (combined_token [t, H], combined_probs [t, E] float32 or None)."""
        if handle is None or not isinstance(handle[0], PermuteHandle):
            raise ValueError("combine_with_unpermute needs the handle of a dispatch_with_permute")
        return self._buf.combine_with_unpermute(hidden, handle[0], probs=probs)

    def close(self):
        self._buf.close()
