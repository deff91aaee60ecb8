"""dispatch and combine as torch.autograd functions, each the other's backward.

The C library's handles are one-shot today (a combine follows its dispatch, once), so the
backward pass does not reuse the forward handle. The rule, per layer and Buffer:
  forward:  dispatch (handle h)  ->  experts  ->  combine (h)
  backward: combine's backward dispatches the output gradient [t, H] again with h's
            routing: the same layout, so its rows are the gradient of the expert outputs
            (handle h'); dispatch's backward then combines the gradient of the received
            rows with h' (the sum over a token's destinations is dispatch's adjoint).
Autograd runs a layer's combine-backward before its dispatch-backward, so every rank
issues, as in the forward, a dispatch then a combine; layers unwind in reverse order.
Between a layer's combine-backward and its dispatch-backward no other hybridep call may
run on the same Buffer (true of ordinary backward passes: only the experts run there).
The probabilities have no gradient yet (they need probabilities through combine: the
training-API issue); tokens_per_expert is not differentiable."""
import torch

from .buffer import Buffer, Handle


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer, hidden, topk_idx, topk_weights):
        tokens, probs, scales, tpe, handle = buffer.dispatch(hidden, topk_idx, topk_weights)
        ctx.buffer = buffer
        ctx.handle = handle
        ctx.t = hidden.shape[0]
        ctx.mark_non_differentiable(probs, tpe)
        return tokens, probs, tpe, handle

    @staticmethod
    def backward(ctx, grad_tokens, grad_probs, grad_tpe, grad_handle):
        bh = ctx.handle.backward_handle
        if bh is None:
            raise RuntimeError(
                "hybridep.autograd.dispatch backward: no combine-backward re-dispatched this "
                "layer's gradient (its combine must go through hybridep.autograd.combine, "
                "and the handles are one-shot until the training-API issue lands)")
        ctx.handle.backward_handle = None
        if grad_tokens is None:
            grad_tokens = torch.zeros((bh.num_recv, ctx.buffer.hidden_dim),
                                      dtype=torch.bfloat16, device=ctx.buffer.device)
        grad_hidden = ctx.buffer.combine(grad_tokens.to(torch.bfloat16).contiguous(), bh)
        return None, grad_hidden, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer, hidden, handle):
        ctx.buffer = buffer
        ctx.handle = handle
        return buffer.combine(hidden, handle)

    @staticmethod
    def backward(ctx, grad_out):
        h = ctx.handle
        g = grad_out.to(torch.bfloat16).contiguous()
        grad_rows, _, _, _, h2 = ctx.buffer.dispatch(g, h.topk_idx, h.topk_weights)
        h.backward_handle = h2
        return None, grad_rows, None


def dispatch(buffer: Buffer, hidden, topk_idx, topk_weights):
    """Differentiable in `hidden`: returns (tokens, probs, tokens_per_expert, handle)."""
    return _Dispatch.apply(buffer, hidden, topk_idx, topk_weights)


def combine(buffer: Buffer, hidden, handle: Handle):
    """Differentiable in `hidden` (the expert outputs): returns [t, H] BF16."""
    return _Combine.apply(buffer, hidden, handle)
