"""Autograd through dispatch/combine against a plain-torch MoE layer, and the HybridEP
drop-in called the way a training framework calls it."""
import pytest
import torch

import hybridep
import hybridep.autograd as ha
import reference as ref
from hybridep.compat import HybridEPBuffer
from ranks import run_ranks

T, H, EL, K = 10, 32, 2, 2


def _weights(world):
    g = torch.Generator().manual_seed(5)
    return [torch.randn((H, H), generator=g) * 0.2 for _ in range(EL * world)]


def _local_moe(rank, tokens, probs, W):
    """Rows through this rank's experts, each weighted by its probability (bf16 out)."""
    y = torch.zeros(tokens.shape, dtype=torch.float32)
    for e in range(EL):
        y = y + probs[:, e:e + 1] * (tokens.float() @ W[rank * EL + e])
    return y.to(torch.bfloat16)


def _autograd_layer(rank, world):
    buf = hybridep.Buffer(None, H, T, EL, backend="host", max_topk=K)
    W = [w.clone().requires_grad_(True) for w in _weights(world)]
    all_in = [ref.inputs(21, r, T, H, EL * world, K) for r in range(world)]
    results = []
    for layer_round in range(2):  # two forward/backward passes: handles stay consistent
        hidden, idx, w, _ = all_in[rank]
        x = hidden.clone().requires_grad_(True)
        tokens, probs, tpe, handle = ha.dispatch(buf, x, idx, w)
        y = ha.combine(buf, _local_moe(rank, tokens, probs, W), handle)
        loss = (y.float() * torch.linspace(-1, 1, H)).sum()
        loss.backward()
        # the plain-torch reference of this rank's tokens: every expert that any of its
        # slots chose, weighted by the summed slot weights, rounded like the layer
        xr = hidden.clone().requires_grad_(True)
        Wr = [w0.clone().requires_grad_(True) for w0 in _weights(world)]
        acc = torch.zeros((xr.shape[0], H))
        for d in range(world):
            lo = d * EL
            mine = (idx >= lo) & (idx < lo + EL)
            p = torch.zeros((xr.shape[0], EL))
            for e in range(EL):
                p[:, e] = (w * (idx == lo + e)).sum(1)
            part = torch.zeros((xr.shape[0], H))
            for e in range(EL):
                part = part + p[:, e:e + 1] * (xr.float() @ Wr[lo + e])
            acc = acc + torch.where(mine.any(1, keepdim=True), part.to(torch.bfloat16).float(),
                                    torch.zeros_like(part))
        yr = acc.to(torch.bfloat16)
        assert torch.equal(y, yr), "forward differs from the plain-torch layer"
        (yr.float() * torch.linspace(-1, 1, H)).sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape
        torch.testing.assert_close(x.grad.float(), xr.grad.float(), rtol=2e-2, atol=2e-2)
        results.append(float(x.grad.float().abs().sum()))
    # the experts' weight gradients: this rank's experts saw every rank's tokens; the
    # reference on this rank saw only its own, so sum the reference over ranks
    import torch.distributed as dist
    gw = torch.stack([W[rank * EL + e].grad for e in range(EL)])
    ref_gw = torch.stack([Wr[d * EL + e].grad for d in range(world) for e in range(EL)])
    dist.all_reduce(ref_gw)
    ref_mine = ref_gw.view(world, EL, H, H)[rank] * 2  # two passes accumulated
    torch.testing.assert_close(gw, ref_mine, rtol=3e-2, atol=3e-2)
    buf.close()
    return results


def test_autograd_gradients_match_a_plain_torch_moe_layer():
    out = run_ranks(_autograd_layer, 3)
    assert all(v[0] > 0 for v in out.values()), out


def _backward_without_combine(rank, world):
    buf = hybridep.Buffer(None, H, T, EL, backend="host", max_topk=K)
    hidden, idx, w, _ = ref.inputs(3, rank, T, H, EL * world, K, ragged=False)
    x = hidden.clone().requires_grad_(True)
    tokens, probs, tpe, h = ha.dispatch(buf, x, idx, w)
    buf.combine(tokens.detach(), h)  # combine outside autograd
    with pytest.raises(RuntimeError, match="no combine-backward re-dispatched"):
        tokens.float().sum().backward()
    buf.close()
    return True


def test_dispatch_backward_without_autograd_combine_says_why():
    run_ranks(_backward_without_combine, 2)


def _compat(rank, world):
    # the host backend, named: on a GPU machine the default would be the GPU backend, and
    # this test's tensors are CPU tensors
    b = HybridEPBuffer(None, hidden_dim=H, max_num_of_tokens_per_rank=T, num_local_experts=EL,
                       use_fp8=False, num_sms_dispatch_api=16, num_sms_combine_api=16,
                       backend="host")
    assert b.num_of_nodes == 1 and b.num_of_ranks_per_node == world
    E = EL * world
    all_in = [ref.inputs(31, r, T, H, E, K) for r in range(world)]
    hidden, idx, w, _ = all_in[rank]
    # routing as a dense map + probs, as frameworks pass it
    t = hidden.shape[0]
    routing_map = torch.zeros((t, E), dtype=torch.bool)
    dense = torch.zeros((t, E))
    for i in range(t):
        for k in range(K):
            if idx[i, k] >= 0:
                routing_map[i, idx[i, k]] = True
                dense[i, idx[i, k]] += w[i, k]
    tokens, probs, sf, handle = b.dispatch(hidden=hidden, routing_map=routing_map, probs=dense,
                                           num_of_experts=E)
    exp_rows, exp_probs, _, origin, _ = ref.dispatch(all_in, rank, EL)
    assert torch.equal(tokens, exp_rows) and sf is None
    torch.testing.assert_close(probs, exp_probs)
    combined, cprobs = b.combine(hidden=tokens, handle=handle)
    assert cprobs is None and combined.shape == hidden.shape
    # with the cached handle: the same layout again (Megatron's combine-backward pattern)
    tokens2, _, _, handle2 = b.dispatch(hidden=hidden, handle=handle)
    assert torch.equal(tokens2, tokens)
    b.combine(hidden=tokens2, handle=handle2)
    # the expert-major layout across processes: the rank-major rows grouped by local expert
    # (receive order), each block padded with zero rows to 16
    ptok, pprob, _, ptpe, _ = b.dispatch_with_permute(hidden=hidden, routing_map=routing_map,
                                                      probs=dense, num_of_experts=E,
                                                      pad_multiple=16)
    etok, etpe = [], []
    for e in range(EL):
        rows = [exp_rows[j] for j, (s, i) in enumerate(origin)
                if bool((all_in[s][1][i].long() == rank * EL + e).any())]
        n = (len(rows) + 15) // 16 * 16
        etok += rows + [torch.zeros(H, dtype=torch.bfloat16)] * (n - len(rows))
        etpe.append(n)
    assert ptpe.tolist() == etpe, (ptpe.tolist(), etpe)
    assert torch.equal(ptok, torch.stack(etok) if etok else ptok[:0])
    assert pprob.shape[0] == ptok.shape[0]
    with pytest.raises(ValueError, match="handle of a dispatch_with_permute"):
        b.combine_with_unpermute(hidden=tokens, handle=handle)
    with pytest.raises(NotImplementedError, match="combine_with_unpermute carry them"):
        b.combine(hidden=tokens, probs=probs, handle=handle)
    b.close()
    return True


def test_hybridep_compat_buffer_takes_hybridep_calls():
    run_ranks(_compat, 2)


def test_compat_default_staging_holds_every_row_a_rank_can_receive_on_one_node():
    """HybridEPBuffer's default max_permuted_rows for processes on the GPU: every token of
    every node-mate on min(top-k, E_l) local experts, plus a pad of up to 128 rows per local
    expert, in whole pads; and dispatch_with_permute's largest default budget fits in it."""
    from hybridep.compat import STAGING_PAD, default_staging_rows
    for T, R, El, K in [(4096, 8, 32, 8), (9, 3, 3, 3), (1, 2, 4, 8), (128, 4, 1, 2)]:
        rows = default_staging_rows(T, R, El, K)
        assert rows % STAGING_PAD == 0
        need = T * R * min(K, El) + El * (STAGING_PAD - 1)
        assert need <= rows < need + STAGING_PAD
    # the bench shape: 262,144 rows + 32 x 127 padding = 266,208, in whole pads of 128
    assert default_staging_rows(4096, 8, 32, 8) == 266240
