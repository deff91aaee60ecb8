"""The training API from Python: dispatch_with_permute / combine_with_unpermute (expert-major
rows, padding, a row budget, probabilities through combine), reusable handles, their
autograd pairing and the HybridEP drop-in's permute calls, against plain torch.

The host backend implements the expert-major layout and the probabilities through combine
for the ranks of one node, threads of one process (hybridep.ThreadWorld) or processes
(gloo, the group's node-shared memory): the same cases run both ways, bit for bit against
plain torch."""
import os
import threading
import traceback

import pytest
import torch

import hybridep
import hybridep.autograd as ha
import reference as ref
from hybridep.compat import HybridEPBuffer
from ranks import run_ranks

T, H, EL, K = 9, 32, 3, 3
os.environ.setdefault("HEP_TIMEOUT_MS", "20000")  # read once, at this process's first call


def run_threads(fn, world, timeout=120):
    """fn(rank, world, thread_rank) on `world` threads over one ThreadWorld."""
    w = hybridep.ThreadWorld(world)
    out, errs = {}, []

    def body(r):
        try:
            out[r] = fn(r, world, w.rank(r))
        except BaseException:
            errs.append("rank %d:\n%s" % (r, traceback.format_exc()))

    ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    if any(t.is_alive() for t in ts):
        raise AssertionError("threads did not finish within %d s" % timeout)
    w.close()
    if errs:
        raise AssertionError("\n".join(errs))
    return out


def expected_permute(all_in, d, pad, budget):
    """Rank d's expert-major rows: per local expert, in receive order, padded; the row
    probabilities; the padded (clipped) tokens per expert; each row's (source, token)."""
    lo = d * EL
    blocks = []
    for e in range(EL):
        rows, probs, origin = [], [], []
        for s, (hidden, idx, w, _) in enumerate(all_in):
            for i in range(hidden.shape[0]):
                hit = idx[i].long() == lo + e
                if bool(hit.any()):
                    rows.append(hidden[i])
                    probs.append(float(w[i][hit].sum()))
                    origin.append((s, i))
        n = len(rows)
        padded = (n + pad - 1) // pad * pad
        blocks.append((rows, probs, origin, padded))
    tok = torch.zeros((budget, H), dtype=torch.bfloat16)
    pr = torch.zeros((budget,))
    where, tpe, pos = {}, [], 0
    for e, (rows, probs, origin, padded) in enumerate(blocks):
        start = pos
        for j in range(len(rows)):
            if pos + j < budget:
                tok[pos + j], pr[pos + j] = rows[j], probs[j]
                where[(origin[j][0], origin[j][1], e)] = pos + j
        pos += padded
        tpe.append(max(0, min(pos, budget) - start))
    n = min(pos, budget)
    return tok[:n], pr[:n], torch.tensor(tpe, dtype=torch.int64), where


def _expert(d, rows, tpe):
    """Expert outputs of rank d's expert-major rows: row x of global expert g is
    x * (2^24, -2^24, 1)[g % 3] + 0.5, so that a token's sum cancels or rounds away its small
    terms depending on the order: any order but the documented one (node-mate, then local
    expert: ascending global expert) gives other bits."""
    e = torch.repeat_interleave(torch.arange(EL), tpe)[: rows.shape[0]]
    scale = torch.tensor([2.0 ** 24, -(2.0 ** 24), 1.0])[(d * EL + e) % 3]
    return (rows.float() * scale[:, None] + 0.5).to(torch.bfloat16)


def _case(rank, world, tr, pad, budget, seed, ranks_per_node=None, max_permuted_rows=None):
    """One dispatch_with_permute + combine_with_unpermute (with probabilities) against the
    plain-torch reference; returns the rank's overflow flag (and the rows written)."""
    buf = hybridep.Buffer(tr, H, T, EL, backend="host", max_topk=K, ranks_per_node=ranks_per_node,
                          max_permuted_rows=max_permuted_rows)
    try:
        E = EL * world
        all_in = [ref.inputs(seed, r, T, H, E, K) for r in range(world)]
        hidden, idx, w, _ = all_in[rank]
        tok, pr, sf, tpe, h = buf.dispatch_with_permute(hidden, idx, w, pad_multiple=pad,
                                                        num_permuted_tokens=budget)
        b = budget or buf._budget(pad)
        etok, epr, etpe, _ = expected_permute(all_in, rank, pad, b)
        assert sf is None
        assert torch.equal(tpe, etpe), "tokens per expert %s, expected %s" % (tpe.tolist(), etpe.tolist())
        assert tok.shape[0] == h.num_permuted == int(etpe.sum())
        assert torch.equal(tok, etok), "expert-major rows differ"
        assert torch.equal(pr, epr), "row probabilities differ"
        # the expert outputs of every rank; padding rows hold junk that must not count
        outs, wheres = [], []
        for d in range(world):
            t_d, _, tpe_d, where_d = expected_permute(all_in, d, pad, b)
            o = _expert(d, t_d, tpe_d)
            o[t_d.float().abs().sum(1) == 0] = 7.0
            outs.append(o)
            wheres.append(where_d)
        y, pout = buf.combine_with_unpermute(outs[rank], h, probs=pr * 10 + rank)
        t = hidden.shape[0]
        ey = torch.zeros((t, H))
        ep = torch.zeros((t, E))
        # the documented order: one node, ascending destination then local expert in f32;
        # across nodes the own node's rows so, then each other node's sum (the same order
        # within it) rounded to BF16, in node order
        rpn = ranks_per_node or world
        me = rank // rpn
        for i in range(t):
            acc = torch.full((H,), -0.0)
            for node in [me] + [n for n in range(world // rpn) if n != me]:
                part = torch.full((H,), -0.0)
                for d in range(node * rpn, (node + 1) * rpn):
                    for e in range(EL):
                        p = wheres[d].get((rank, i, e))
                        if p is not None:
                            part = part + outs[d][p].float()
                            epr_d = expected_permute(all_in, d, pad, b)[1]
                            ep[i, d * EL + e] = epr_d[p] * 10 + d
                # (a node with no row adds -0.0: nothing)
                acc = acc + (part if node == me else part.to(torch.bfloat16).float())
            ey[i] = acc
        assert torch.equal(y, ey.to(torch.bfloat16)), "combined tokens differ"
        assert torch.allclose(pout, ep), "probabilities through combine differ"
        return h.overflow, h.overflow_rows, h.num_permuted, buf.max_recv_rows
    finally:
        buf.close()


@pytest.mark.parametrize("pad", [1, 16])
def test_expert_major_rows_and_combine_match_plain_torch(pad):
    run_threads(lambda r, w, tr: _case(r, w, tr, pad, None, 61 + pad), 3)


@pytest.mark.parametrize("pad", [1, 16])
def test_expert_major_across_virtual_nodes_matches_plain_torch(pad):
    """2 nodes x 2 ranks as threads (the host backend's inter-node rings over the loopback
    NIC): the same rows, counts, sums and probabilities as plain torch."""
    run_threads(lambda r, w, tr: _case(r, w, tr, pad, None, 81 + pad, ranks_per_node=2), 4)


def test_a_small_row_budget_drops_the_highest_experts_rows_and_says_so():
    out = run_threads(lambda r, w, tr: _case(r, w, tr, 4, 8, 71), 3)
    assert any(v[0] for v in out.values()), out
    assert all((v[1] > 0) == v[0] for v in out.values()), out


def _interleaved(rank, world, tr):
    buf = hybridep.Buffer(tr, H, T, EL, backend="host", max_topk=K)
    E = EL * world
    ins = {s: [ref.inputs(s, r, T, H, E, K) for r in range(world)] for s in (81, 82)}
    hs, toks = {}, {}
    for s in (81, 82):  # two layouts alive at once
        x, i, w, _ = ins[s][rank]
        toks[s], _, _, _, hs[s] = buf.dispatch_with_permute(x, i, w, pad_multiple=8)
    ys = {}
    for s in (82, 81, 81):  # any order, more than once
        ys.setdefault(s, []).append(buf.combine_with_unpermute(toks[s], hs[s])[0])
    assert torch.equal(ys[81][0], ys[81][1])
    # a layout reused: the same rows again, without the routing
    x, i, w, _ = ins[81][rank]
    t2, p2, _, _, h2 = buf.dispatch_with_permute(x, handle=hs[81])
    assert h2 is hs[81] and torch.equal(t2, toks[81])
    other = hybridep.Buffer(tr, H, T, EL, backend="host", max_topk=K)
    with pytest.raises(ValueError, match="not a PermuteHandle of this Buffer"):
        other.combine_with_unpermute(toks[81], hs[81])
    other.close()
    buf.close()
    return True


def test_handles_stay_alive_and_combine_in_any_order():
    run_threads(_interleaved, 2)


def _grad(rank, world, tr):
    """An MoE layer through the autograd pair against plain torch: gradients of the tokens,
    of the expert weights and of the router's weights (through combine's probabilities)."""
    buf = hybridep.Buffer(tr, H, T, EL, backend="host", max_topk=K)
    E = EL * world
    g = torch.Generator().manual_seed(9)
    Wall = [torch.randn((H, H), generator=g) * 0.2 for _ in range(E)]
    W = [Wall[rank * EL + e].clone().requires_grad_(True) for e in range(EL)]
    hidden, idx, w0, _ = ref.inputs(91, rank, T, H, E, K)
    x = hidden.clone().requires_grad_(True)
    w = w0.clone().requires_grad_(True)
    tok, pr, tpe, h = ha.dispatch_with_permute(buf, x, idx, w, pad_multiple=4)
    outs, start = [], 0
    for e in range(EL):  # grouped GEMM over contiguous blocks, the probability applied
        n = int(tpe[e])
        blk = tok[start:start + n].float() @ W[e]
        outs.append(blk * pr[start:start + n, None])
        start += n
    y, _ = ha.combine_with_unpermute(buf, torch.cat(outs).to(torch.bfloat16), h)
    lin = torch.linspace(-1, 1, H)
    (y.float() * lin).sum().backward()
    # plain torch: every chosen expert of each own token, weighted by its summed weight
    xr = hidden.clone().requires_grad_(True)
    wr = w0.clone().requires_grad_(True)
    Wr = [Wi.clone().requires_grad_(True) for Wi in Wall]
    acc = torch.zeros((xr.shape[0], H))
    for x_e in range(E):
        p = (wr * (idx == x_e)).sum(1, keepdim=True)
        chosen = (idx == x_e).any(1, keepdim=True)
        part = (xr.to(torch.bfloat16).float() @ Wr[x_e]) * p
        acc = acc + torch.where(chosen, part.to(torch.bfloat16).float(), torch.zeros_like(part))
    (acc.to(torch.bfloat16).float() * lin).sum().backward()
    torch.testing.assert_close(y.float(), acc.to(torch.bfloat16).float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x.grad, xr.grad.to(x.grad.dtype), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(w.grad, wr.grad, rtol=3e-2, atol=3e-2)
    buf.close()
    return [Wi.grad for Wi in W], [Wr[rank * EL + e].grad for e in range(EL)], \
        [Wr[x_e].grad for x_e in range(E)]


def test_autograd_pair_gradients_match_plain_torch():
    out = run_threads(_grad, 3)
    E = EL * 3
    for r, (mine, _, _) in out.items():  # this rank's experts saw every rank's tokens
        for e in range(EL):
            ref_sum = sum(out[s][2][r * EL + e] for s in out)
            torch.testing.assert_close(mine[e], ref_sum, rtol=3e-2, atol=3e-2)
    assert E == 9


def _megatron_style(rank, world, tr):
    """Two MoE layers through the HybridEP drop-in, as Megatron's HybridEP wrappers call it:
    autograd functions whose backward is the other permute call with the same handle,
    both layers' handles alive from their forward to their backward."""
    b = HybridEPBuffer(tr, hidden_dim=H, max_num_of_tokens_per_rank=T, num_local_experts=EL,
                       num_sms_dispatch_api=16, num_sms_combine_api=16, backend="host")
    E = EL * world

    class Dispatch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, routing_map, probs):
            tok, p, sf, tpe, handle = b.dispatch_with_permute(
                hidden=x, routing_map=routing_map, probs=probs, num_of_experts_per_rank=EL,
                num_of_experts=E, pad_multiple=8)
            ctx.handle = handle
            return tok, p, tpe, handle

        @staticmethod
        def backward(ctx, g_tok, g_p, g_tpe, g_h):
            gx, gp = b.combine_with_unpermute(hidden=g_tok.to(torch.bfloat16), probs=g_p.float(),
                                              handle=ctx.handle, pad_multiple=8)
            return gx, None, gp

    class Combine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, handle):
            ctx.handle = handle
            y, _ = b.combine_with_unpermute(hidden=x, handle=handle, pad_multiple=8)
            return y

        @staticmethod
        def backward(ctx, g):
            gx, _, _, _, _ = b.dispatch_with_permute(hidden=g.to(torch.bfloat16), handle=ctx.handle,
                                                     pad_multiple=8)
            return gx, None

    hidden, idx, w, _ = ref.inputs(95, rank, T, H, E, K)
    t = hidden.shape[0]
    routing_map = torch.zeros((t, E), dtype=torch.bool)
    dense = torch.zeros((t, E))
    for i in range(t):
        for k in range(K):
            if idx[i, k] >= 0:
                routing_map[i, idx[i, k]] = True
                dense[i, idx[i, k]] += w[i, k]
    x = hidden.clone().requires_grad_(True)
    probs = dense.clone().requires_grad_(True)
    h = x
    for layer in range(2):  # two layers: two handles live until the backward
        tok, p, tpe, handle = Dispatch.apply(h, routing_map, probs)
        h = Combine.apply((tok.float() * p[:, None] * (layer + 2)).to(torch.bfloat16), handle)
    h.float().sum().backward()
    # plain torch: y = sum over chosen experts of p * (2) then again * 3, per token
    xr = hidden.clone().requires_grad_(True)
    pr = dense.clone().requires_grad_(True)
    hr = xr
    for layer in range(2):
        s = (pr * routing_map).sum(1, keepdim=True)
        hr = (hr.float() * s * (layer + 2)).to(torch.bfloat16)
    hr.float().sum().backward()
    torch.testing.assert_close(h.float(), hr.float(), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(x.grad.float(), xr.grad.float(), rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(probs.grad * routing_map, pr.grad * routing_map, rtol=5e-2, atol=5e-2)
    b.close()
    return True


def test_hybridep_compat_permute_calls_in_a_megatron_style_forward_and_backward():
    run_threads(_megatron_style, 2)


def _case_across_processes(rank, world, pad, budget, seed):
    return _case(rank, world, None, pad, budget, seed)


@pytest.mark.parametrize("pad", [1, 16])
def test_expert_major_across_processes_matches_plain_torch(pad):
    # 3 processes of one host (gloo): the group's node-shared memory; with pad 16 the
    # expert-major rows outnumber the receive capacity, so combine takes several rounds
    run_ranks(_case_across_processes, 3, pad, None, 61 + pad)


def test_a_small_row_budget_across_processes_drops_as_in_one_process():
    out = run_ranks(_case_across_processes, 3, 4, 8, 71)
    assert any(v[0] for v in out.values()), out
    assert all((v[1] > 0) == v[0] for v in out.values()), out


def _case_nodes_across_processes(rank, world, pad, budget, seed, em_rows=None):
    return _case(rank, world, None, pad, budget, seed, ranks_per_node=2,
                 max_permuted_rows=em_rows)


@pytest.mark.parametrize("pad", [1, 4])
def test_expert_major_across_virtual_nodes_of_processes_matches_plain_torch(pad):
    """2 nodes x 2 processes (gloo; the inter-node rings over the loopback NIC across
    processes): rows, counts, sums and probabilities as plain torch, with a budget of the
    receive capacity (W x T rows: there a rank's expert-major rows pass to its node-mates
    at once)."""
    out = run_ranks(_case_nodes_across_processes, 4, pad, 4 * T // pad * pad, 91 + pad,
                    env={"HEP_NIC": "loopback"})
    assert len(out) == 4


def test_expert_major_past_the_receive_capacity_across_nodes_of_processes_uses_the_staging():
    """The default budget (every row on min(K, E_l) experts, padded to 16) is more rows than
    the receive capacity: with max_permuted_rows they go through the segment's staging."""
    out = run_ranks(_case_nodes_across_processes, 4, 16, None, 95, 4 * T * 3 + EL * 16,
                    env={"HEP_NIC": "loopback"})
    assert any(rows > cap for _, _, rows, cap in out.values()), out


def _budget_above_capacity(rank, world):
    buf = hybridep.Buffer(None, H, T, EL, backend="host", max_topk=K, ranks_per_node=2)
    try:
        assert buf.transport == "loopback" and buf.num_nodes == 2
        hidden, idx, w, _ = ref.inputs(5, rank, T, H, EL * world, K)
        with pytest.raises(hybridep.HybridEPError) as e:
            buf.dispatch_with_permute(hidden, idx, w, num_permuted_tokens=buf.max_recv_rows + 1)
        assert e.value.status_name == "HEP_ERR_INVALID" and "max_recv_rows" in e.value.message
        return e.value.message
    finally:
        buf.close()


def test_an_expert_major_budget_above_the_receive_capacity_across_nodes_of_processes_is_refused():
    out = run_ranks(_budget_above_capacity, 4, env={"HEP_NIC": "loopback"})
    assert all("num_permuted_tokens" in m for m in out.values()), out


def test_max_permuted_rows_caps_the_default_budget():
    """Buffer(max_permuted_rows=N) sets config.max_permuted_rows (the GPU's expert-major
    staging across processes) and caps the default budget at it, rounded down to the pad."""
    def f(rank, world, tr):
        buf = hybridep.Buffer(tr, H, T, EL, backend="host", max_topk=K, max_permuted_rows=20)
        try:
            assert buf.max_permuted_rows == 20 and buf._cfg.max_permuted_rows == 20
            assert (buf._budget(1), buf._budget(4), buf._budget(16)) == (20, 20, 16)
        finally:
            buf.close()
        return True
    assert all(run_threads(f, 3).values())
