"""GPU-only: CUDA graph capture of a no_sync Buffer and torch.compile through the custom
ops. Each skips, with its reason, without a GPU or a new enough torch."""
import os

import pytest
import torch

import hybridep
import reference as ref
from ranks import run_ranks

T, H, EL, K = 64, 256, 2, 2
WORLD = int(os.environ.get("HEP_PY_GPU_WORLD", "2"))
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="no CUDA device visible to torch (GPU-only test)")


def _expected(all_in, rank, world):
    rows, probs, tpe, origin, _ = ref.dispatch(all_in, rank, EL)
    outs, origins = [], []
    for d in range(world):
        r_d, _, _, o_d, _ = ref.dispatch(all_in, d, EL)
        outs.append((r_d.float() * 2).to(torch.bfloat16))
        origins.append(o_d)
    return rows, probs, tpe, ref.combine(outs, origins, rank, all_in[rank][0].shape[0], H)


def _graph(rank, world):
    torch.cuda.set_device(0)
    buf = hybridep.Buffer(None, H, T, EL, backend="gpu", no_sync=True, num_sms=4, max_topk=K)
    n = buf.recv_budget
    sx = torch.zeros((T, H), dtype=torch.bfloat16, device="cuda")
    si = torch.zeros((T, K), dtype=torch.int64, device="cuda")
    sw = torch.zeros((T, K), dtype=torch.float32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up once outside the graph
        tok, pr, _, tpe, h = buf.dispatch(sx, si, sw)
        buf.combine((tok.float() * 2).to(torch.bfloat16), h)
        buf.sync()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tok, pr, _, tpe, h = buf.dispatch(sx, si, sw)
        out = buf.combine((tok.float() * 2).to(torch.bfloat16), h)
    for seed in (41, 42, 43):
        all_in = [ref.inputs(seed, r, T, H, EL * world, K, ragged=False) for r in range(world)]
        x, i, w, _ = all_in[rank]
        sx.copy_(x), si.copy_(i), sw.copy_(w)
        g.replay()
        torch.cuda.synchronize()
        buf.sync()
        rows, probs, etpe, eout = _expected(all_in, rank, world)
        m = rows.shape[0]
        assert int(h.num_recv[0]) == m and not bool(h.overflow)
        assert torch.equal(tok[:m].cpu(), rows) and torch.equal(pr[:m].cpu(), probs)
        assert torch.equal(tpe.cpu().long(), etpe)
        assert torch.equal(out.cpu(), eout), "replay %d: combined tokens differ" % seed
    buf.close()
    return True


@needs_gpu
def test_cuda_graph_capture_and_replay_of_a_no_sync_buffer():
    if not hasattr(torch.cuda, "CUDAGraph"):
        pytest.skip("torch %s has no torch.cuda.CUDAGraph" % torch.__version__)
    run_ranks(_graph, WORLD, timeout=300)


def _compiled(rank, world):
    import hybridep.ops as ops
    torch.cuda.set_device(0)
    buf = hybridep.Buffer(None, H, T, EL, backend="gpu", num_sms=4, max_topk=K)
    bid = ops.register_buffer(buf)
    Wt = torch.randn((EL, H, H), generator=torch.Generator().manual_seed(1)).cuda() * 0.05

    def layer(x, idx, w):
        tokens, probs, tpe, handle = torch.ops.hybridep.dispatch(bid, x, idx, w)
        y = torch.zeros(tokens.shape, dtype=torch.float32, device=x.device)
        for e in range(EL):
            y = y + probs[:, e:e + 1] * (tokens.float() @ Wt[e])
        return torch.ops.hybridep.combine(bid, y.to(torch.bfloat16), handle, x)

    compiled = torch.compile(layer)
    for seed in (51, 52):
        all_in = [ref.inputs(seed, r, T, H, EL * world, K, ragged=False) for r in range(world)]
        x, i, w, _ = (a.cuda() if a is not None else None for a in all_in[rank])
        eager = layer(x, i, w)
        got = compiled(x, i, w)
        torch.testing.assert_close(got.float(), eager.float(), rtol=2e-2, atol=2e-2)
    ops.unregister_buffer(buf)
    buf.close()
    return True


@needs_gpu
def test_torch_compile_of_a_moe_layer_through_the_custom_ops():
    import hybridep.ops as ops
    if not ops.AVAILABLE:
        pytest.skip(ops.WHY_NOT)
    run_ranks(_compiled, WORLD, timeout=300)


def test_custom_ops_need_torch_2_4():
    import hybridep.ops as ops
    if ops.AVAILABLE:
        assert hasattr(torch.ops.hybridep, "dispatch") and hasattr(torch.ops.hybridep, "combine")
    else:
        pytest.skip(ops.WHY_NOT + ": the custom ops are not registered (tested on the GPU "
                    "machine's torch)")


def _permute_on_gpu(rank, world):
    """The permute pair on the GPU with one process per rank (through the group's
    expert-major staging, max_permuted_rows) against the plain-torch reference of
    test_permute: rows, probabilities, tokens per expert, combined tokens and the
    probabilities through combine, for the budget that never overflows (pad 16), a budget
    that drops rows (pad 4), and the first layout dispatched again (HEP_REUSE_LAYOUT)."""
    from test_permute import expected_permute, _expert, EL as PEL, H as PH, K as PK, T as PT
    torch.cuda.set_device(0)
    buf = hybridep.Buffer(None, PH, PT, PEL, backend="gpu", num_sms=4, max_topk=PK,
                          max_permuted_rows=4096)
    E = PEL * world
    said = []
    try:
        for seed, pad, budget in ((61, 16, None), (71, 4, 8)):
            all_in = [ref.inputs(seed, r, PT, PH, E, PK) for r in range(world)]
            x, i, w, _ = all_in[rank]
            tok, pr, _, tpe, h = buf.dispatch_with_permute(x.cuda(), i.cuda(), w.cuda(),
                                                            pad_multiple=pad,
                                                            num_permuted_tokens=budget)
            b = h.budget
            assert b == (budget or buf._budget(pad)) and b <= 4096, b
            etok, epr, etpe, _ = expected_permute(all_in, rank, pad, b)
            assert torch.equal(tpe, etpe), "rank %d: tokens per expert %s, expected %s" % (
                rank, tpe.tolist(), etpe.tolist())
            assert torch.equal(tok.cpu(), etok), "rank %d: expert-major rows differ" % rank
            assert torch.equal(pr.cpu(), epr), "rank %d: row probabilities differ" % rank
            if pad == 16:  # the same layout again, no routing pass: the same rows
                tok2, pr2, _, tpe2, h2 = buf.dispatch_with_permute(x.cuda(), handle=h)
                assert h2 is h and torch.equal(tok2.cpu(), etok) and torch.equal(pr2.cpu(), epr)
            outs, wheres, eprs = [], [], []
            for d in range(world):
                t_d, p_d, tpe_d, where_d = expected_permute(all_in, d, pad, b)
                o = _expert(d, t_d, tpe_d)
                o[t_d.float().abs().sum(1) == 0] = 7.0  # padding rows: junk that must not count
                outs.append(o)
                wheres.append(where_d)
                eprs.append(p_d)
            y, pout = buf.combine_with_unpermute(outs[rank].cuda(), h, probs=pr * 10 + rank)
            t = x.shape[0]
            ey = torch.zeros((t, PH))
            ep = torch.zeros((t, E))
            for tok_i in range(t):
                acc = torch.full((PH,), -0.0)
                for d in range(world):
                    for e in range(PEL):
                        p = wheres[d].get((rank, tok_i, e))
                        if p is not None:
                            acc = acc + outs[d][p].float()
                            ep[tok_i, d * PEL + e] = eprs[d][p] * 10 + d
                ey[tok_i] = acc
            assert torch.equal(y.cpu(), ey.to(torch.bfloat16)), "rank %d: combined tokens differ" % rank
            assert torch.allclose(pout.cpu(), ep), "rank %d: probabilities through combine differ" % rank
            said.append("pad %d budget %d: %d rows%s" % (pad, b, h.num_permuted,
                                                          ", dropped %d" % h.overflow_rows
                                                          if h.overflow else ""))
    finally:
        buf.close()
    return "ran (%s)" % "; ".join(said)


def _permute_needs_the_staging(rank, world):
    """Across processes without max_permuted_rows the library refuses, naming the field."""
    from test_permute import EL as PEL, H as PH, K as PK, T as PT
    torch.cuda.set_device(0)
    buf = hybridep.Buffer(None, PH, PT, PEL, backend="gpu", num_sms=4, max_topk=PK)
    try:
        x, i, w, _ = ref.inputs(61, rank, PT, PH, PEL * world, PK)
        with pytest.raises(hybridep.HybridEPError) as e:
            buf.dispatch_with_permute(x.cuda(), i.cuda(), w.cuda(), pad_multiple=16)
        assert e.value.status_name == "HEP_ERR_UNAVAILABLE", e.value
        assert "config.max_permuted_rows" in e.value.message, e.value.message
    finally:
        buf.close()
    return True


def _compat_permute_default(rank, world):
    """HybridEPBuffer with no max_permuted_rows, one process per rank: the staging is sized
    by itself (compat.default_staging_rows) and the permute pair runs, as code written for
    HybridEP calls it, with the rows plain torch expects."""
    from hybridep.compat import HybridEPBuffer, default_staging_rows
    from test_permute import expected_permute, EL as PEL, H as PH, K as PK, T as PT
    torch.cuda.set_device(0)
    buf = HybridEPBuffer(None, PH, PT, PEL, num_sms_dispatch_api=4, num_sms_combine_api=4,
                         backend="gpu", max_topk=PK)
    try:
        assert buf.buffer.max_permuted_rows == default_staging_rows(PT, world, PEL, PK)
        all_in = [ref.inputs(91, r, PT, PH, PEL * world, PK) for r in range(world)]
        x, i, w, _ = all_in[rank]
        tok, pr, _, tpe, h = buf.dispatch_with_permute(hidden=x.cuda(), topk_idx=i.cuda(),
                                                       topk_weights=w.cuda(), pad_multiple=16)
        etok, epr, etpe, _ = expected_permute(all_in, rank, 16, h[0].budget)
        assert torch.equal(tpe.cpu(), etpe) and torch.equal(tok.cpu(), etok), \
            "rank %d: the compat permute rows differ" % rank
        assert torch.equal(pr.cpu(), epr), "rank %d: the compat row probabilities differ" % rank
    finally:
        buf.close()
    return True


@needs_gpu
def test_dispatch_with_permute_on_the_gpu_runs_or_raises_the_library_message():
    """(The name is kept for bench/gpu_run.sh.) The permute pair runs across processes and
    matches plain torch; only without max_permuted_rows is it refused, by name."""
    out = run_ranks(_permute_on_gpu, WORLD, timeout=300)
    print("dispatch_with_permute on the GPU:", out[0])
    assert all(v.startswith("ran") for v in out.values()), out
    run_ranks(_permute_needs_the_staging, WORLD, timeout=300)
    run_ranks(_compat_permute_default, WORLD, timeout=300)


@needs_gpu
def test_thread_ranks_keep_one_stream_each_for_the_process():
    """ThreadWorld ranks' streams: one per rank, the same from a later world, usable by torch."""
    w, w2 = hybridep.ThreadWorld(2), hybridep.ThreadWorld(2)
    try:
        a, b = w.rank(0).stream(0), w.rank(1).stream("cuda:0")
        assert a.cuda_stream and b.cuda_stream and a.cuda_stream != b.cuda_stream
        assert w2.rank(0).stream(torch.device("cuda", 0)).cuda_stream == a.cuda_stream
        with torch.cuda.stream(a):
            x = torch.ones(4, device="cuda:0") * 2
        a.synchronize()
        assert float(x.sum()) == 8.0
    finally:
        w.close()
        w2.close()
