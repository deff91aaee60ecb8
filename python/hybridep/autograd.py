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

from .buffer import Buffer, Handle, PermuteHandle  # noqa: F401


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


# ------------------------------------------------------------------ the training API
# Reusable layouts (PermuteHandle): each layer's handle lives from its forward to its
# backward, any number of layers at once, in any order. The backward of
# dispatch_with_permute is combine_with_unpermute with the same handle (the probabilities'
# gradient comes back through combine as [t, E] and is read at the token's slots); the
# backward of combine_with_unpermute is dispatch_with_permute reusing the handle's layout
# (the gradient of the probabilities goes out as one value a row). BF16 Buffers only (the
# gradient rows are BF16).

def _slot_grads(grad_dense, topk_idx):
    """[t, E] -> [t, K]: each slot's gradient is its expert's (a row's probability is the
    sum of the token's weights on that expert)."""
    valid = topk_idx >= 0
    g = torch.gather(grad_dense, 1, topk_idx.clamp(min=0).long())
    return torch.where(valid, g, torch.zeros_like(g))


def _first_slot_weights(values_dense, topk_idx):
    """[t, E] -> [t, K] weights whose per-expert sums are values_dense at the chosen
    experts: the first slot of each expert carries it, repeated slots 0."""
    idx = topk_idx.long()
    K = idx.shape[1]
    first = idx >= 0
    for k in range(1, K):
        first[:, k] &= ~(idx[:, :k] == idx[:, k:k + 1]).any(dim=1)
    v = torch.gather(values_dense, 1, idx.clamp(min=0))
    return torch.where(first, v, torch.zeros_like(v)).float().contiguous()


class _DispatchPermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer, hidden, topk_idx, topk_weights, pad_multiple, num_permuted_tokens):
        if buffer.use_fp8:
            raise ValueError("hybridep.autograd.dispatch_with_permute: BF16 Buffers only")
        tokens, probs, _, tpe, h = buffer.dispatch_with_permute(
            hidden, topk_idx, topk_weights, pad_multiple=pad_multiple,
            num_permuted_tokens=num_permuted_tokens)
        ctx.buffer, ctx.handle = buffer, h
        ctx.mark_non_differentiable(tpe)
        return tokens, probs, tpe, h

    @staticmethod
    def backward(ctx, grad_tokens, grad_probs, grad_tpe, grad_handle):
        b, h = ctx.buffer, ctx.handle
        rows = h.budget if b.no_sync else h.num_permuted
        if grad_tokens is None:
            grad_tokens = torch.zeros((rows, b.hidden_dim), dtype=torch.bfloat16, device=b.device)
        want_w = ctx.needs_input_grad[3]
        if want_w and grad_probs is None:
            grad_probs = torch.zeros((rows,), dtype=torch.float32, device=b.device)
        gx, gdense = b.combine_with_unpermute(grad_tokens.to(torch.bfloat16).contiguous(), h,
                                              probs=grad_probs.float().contiguous() if want_w else None)
        gw = _slot_grads(gdense, h.topk_idx) if want_w else None
        return None, gx, None, gw, None, None


class _CombineUnpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer, hidden, handle, probs):
        ctx.buffer, ctx.handle = buffer, handle
        ctx.rows = hidden.shape[0]
        y, pout = buffer.combine_with_unpermute(hidden, handle, probs=probs)
        if pout is None:
            return y, None
        return y, pout

    @staticmethod
    def backward(ctx, grad_y, grad_pout):
        b, h = ctx.buffer, ctx.handle
        if grad_y is None:
            grad_y = torch.zeros((h.num_tokens, b.hidden_dim), dtype=torch.bfloat16, device=b.device)
        want_p = ctx.needs_input_grad[3] and grad_pout is not None
        w = _first_slot_weights(grad_pout, h.topk_idx) if want_p else None
        # the same layout again: every gradient row lands where its forward row was
        g_rows, g_probs, _, _, _ = b.dispatch_with_permute(grad_y.to(torch.bfloat16).contiguous(),
                                                           topk_weights=w, handle=h)
        if g_rows.shape[0] != ctx.rows:  # the forward took budget rows: the rest had no effect
            pad = torch.zeros((ctx.rows - g_rows.shape[0], b.hidden_dim), dtype=g_rows.dtype,
                              device=g_rows.device)
            g_rows = torch.cat([g_rows, pad])
            g_probs = torch.cat([g_probs, torch.zeros((pad.shape[0],), device=g_probs.device)])
        return None, g_rows, None, (g_probs if want_p else None)


def dispatch_with_permute(buffer: Buffer, hidden, topk_idx, topk_weights, pad_multiple=1,
                          num_permuted_tokens=None):
    """Differentiable in `hidden` and `topk_weights`: returns (tokens [rows, H], probs
    [rows], tokens_per_expert, handle) as Buffer.dispatch_with_permute."""
    return _DispatchPermute.apply(buffer, hidden, topk_idx, topk_weights, pad_multiple,
                                  num_permuted_tokens)


def combine_with_unpermute(buffer: Buffer, hidden, handle, probs=None):
    """Differentiable in `hidden` (the expert outputs) and `probs` ([rows]): returns
    (tokens [t, H] BF16, probs [t, E] float32 or None)."""
    return _CombineUnpermute.apply(buffer, hidden, handle, probs)
