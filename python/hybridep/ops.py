"""dispatch and combine as torch custom ops (torch >= 2.4: torch.library.custom_op) with
fake implementations, so torch.compile traces through them without a graph break on the
ops themselves. A Buffer is named by an integer id (register_buffer); the handle travels
as a 1-element int64 CPU tensor.

    bid = hybridep.ops.register_buffer(buf)
    tokens, probs, tpe, handle = torch.ops.hybridep.dispatch(bid, x, topk_idx, topk_weights)
    y = torch.ops.hybridep.combine(bid, expert_out, handle, x)

The received row count is data-dependent (an unbacked size in the fake implementation);
with a no_sync Buffer every output has recv_budget rows."""
import torch

_buffers = {}
AVAILABLE = hasattr(torch, "library") and hasattr(torch.library, "custom_op")
WHY_NOT = "" if AVAILABLE else (
    "torch %s has no torch.library.custom_op (needs torch >= 2.4)" % torch.__version__)


def register_buffer(buf):
    bid = id(buf)
    _buffers[bid] = buf
    buf._op_handles = {}
    return bid


def unregister_buffer(buf):
    _buffers.pop(id(buf), None)


if AVAILABLE:
    from typing import Tuple

    @torch.library.custom_op("hybridep::dispatch", mutates_args=())
    def dispatch(buffer_id: int, hidden: torch.Tensor, topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                      torch.Tensor]:
        b = _buffers[buffer_id]
        tokens, probs, _, tpe, h = b.dispatch(hidden, topk_idx, topk_weights)
        b._op_handles = {h.id: h}  # one-shot: only the last dispatch's handle is live
        return tokens, probs, tpe, torch.tensor([h.id], dtype=torch.int64)

    @dispatch.register_fake
    def _(buffer_id, hidden, topk_idx, topk_weights):
        b = _buffers[buffer_id]
        if b.no_sync:
            n = b.recv_budget
        else:
            n = torch.library.get_ctx().new_dynamic_size()
        tpe_dtype, tpe_dev = (torch.int32, hidden.device) if b.no_sync else (torch.int64, "cpu")
        return (hidden.new_empty((n, b.hidden_dim)),
                hidden.new_empty((n, b.num_local_experts), dtype=torch.float32),
                torch.empty((b.num_local_experts,), dtype=tpe_dtype, device=tpe_dev),
                torch.empty((1,), dtype=torch.int64))

    @torch.library.custom_op("hybridep::combine", mutates_args=())
    def combine(buffer_id: int, hidden: torch.Tensor, handle: torch.Tensor,
                like: torch.Tensor) -> torch.Tensor:
        b = _buffers[buffer_id]
        h = b._op_handles.pop(int(handle[0]), None)
        if h is None:
            raise RuntimeError("hybridep::combine: handle %d is not the last dispatch's "
                               "(one-shot handles: the training-API issue)" % int(handle[0]))
        return b.combine(hidden, h)

    @combine.register_fake
    def _(buffer_id, hidden, handle, like):
        return hidden.new_empty((like.shape[0], hidden.shape[1]), dtype=torch.bfloat16)
