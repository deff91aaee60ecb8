"""hybridep.Buffer on the host backend, one process per rank (gloo), against plain torch."""
import os

import pytest
import torch

import hybridep
import reference as ref
from ranks import run_ranks

T, H, EL, K = 12, 64, 2, 3


def _expert(rank, rows):
    """A stand-in expert computation on the received BF16 rows."""
    return (rows.float() * (rank + 1) + 0.5).to(torch.bfloat16)


def _matches_reference(rank, world, R, seeds):
    """Dispatch and combine against plain torch: one node (R None), or virtual nodes of R
    ranks over the loopback NIC across processes (the inter-node path: rings, proxy)."""
    if R is None:
        buf = hybridep.Buffer(None, H, T, EL, backend="host", max_topk=K)
        assert buf.transport == "none" and buf.num_nodes == 1 and buf.ranks_per_node == world
    else:
        buf = hybridep.Buffer(None, H, T, EL, backend="host", max_topk=K, ranks_per_node=R)
        assert buf.transport == "loopback", buf.transport
        assert buf.num_nodes == world // R and buf.ranks_per_node == R
    E = EL * world
    prev = None
    for n, seed in enumerate(seeds):
        index_dtype = torch.int64 if n % 2 == 0 else torch.int32
        all_in = [ref.inputs(seed, r, T, H, E, K, index_dtype) for r in range(world)]
        hidden, idx, w, _ = all_in[rank]
        tokens, probs, scales, tpe, handle = buf.dispatch(hidden, idx, w)
        # the returned tokens are the caller's: this dispatch left the last round's alone
        if prev is not None:
            assert torch.equal(prev[0], prev[1]), "round %d changed round %d's tokens" % (n, n - 1)
        prev = (tokens, tokens.clone())
        exp_rows, exp_probs, exp_tpe, origin, _ = ref.dispatch(all_in, rank, EL)
        assert scales is None
        assert torch.equal(tokens, exp_rows), "round %d: received rows differ" % n
        assert torch.equal(probs, exp_probs), "round %d: probabilities differ" % n
        assert torch.equal(tpe, exp_tpe), "round %d: tokens per expert %s, expected %s" % (
            n, tpe.tolist(), exp_tpe.tolist())
        assert handle.num_recv == tokens.shape[0] and handle.num_tokens == hidden.shape[0]
        out = buf.combine(_expert(rank, tokens), handle)
        # every rank's expert outputs and origins, from the reference alone
        outs, origins = [], []
        for d in range(world):
            rows_d, _, _, origin_d, _ = ref.dispatch(all_in, d, EL)
            outs.append(_expert(d, rows_d))
            origins.append(origin_d)
        if R is None:
            expected = ref.combine(outs, origins, rank, hidden.shape[0], H)
        else:
            expected = ref.combine_nodes(outs, origins, rank, hidden.shape[0], H, R)
        assert torch.equal(out, expected), "round %d: combined tokens differ" % n
    buf.close()
    return True


def test_dispatch_combine_match_plain_torch_on_four_processes():
    run_ranks(_matches_reference, 4, None, [1, 2, 3, 4])


def test_two_nodes_of_two_processes_match_plain_torch_over_the_loopback_nic():
    """2 x 2 virtual nodes, one process per rank: the inter-node path (rings, proxy) over
    the loopback NIC across processes, no GPU and no RDMA device."""
    run_ranks(_matches_reference, 4, 2, [5, 6, 7], env={"HEP_NIC": "loopback"})


def _fp8_dispatch(rank, world):
    HF = 256
    buf = hybridep.Buffer(None, HF, T, EL, use_fp8=True, backend="host", max_topk=K)
    all_in = [ref.inputs(9, r, T, HF, EL * world, K, fp8=True) for r in range(world)]
    hidden, idx, w, sc = all_in[rank]
    tokens, probs, scales, tpe, handle = buf.dispatch(hidden, idx, w, scaling_factor=sc)
    exp_rows, exp_probs, exp_tpe, origin, exp_scales = ref.dispatch(all_in, rank, EL)
    assert tokens.dtype == torch.uint8 and torch.equal(tokens, exp_rows)
    assert torch.equal(probs, exp_probs) and torch.equal(tpe, exp_tpe)
    if exp_scales is None:
        assert scales.shape[0] == 0
    else:
        assert torch.equal(scales, exp_scales)
    out = buf.combine(torch.zeros((handle.num_recv, HF), dtype=torch.bfloat16), handle)
    assert out.shape == (hidden.shape[0], HF) and not out.float().any()
    buf.close()
    return True


def test_fp8_dispatch_carries_rows_and_scales_intact():
    run_ranks(_fp8_dispatch, 2)


def _never_joins(rank, world):
    if rank == world - 1:
        import time
        time.sleep(6)  # never constructs the Buffer; stays alive past the others' timeout
        return "absent"
    t0 = __import__("time").monotonic()
    with pytest.raises(hybridep.HybridEPError) as e:
        hybridep.Buffer(None, H, T, EL, backend="host", max_topk=K)
    waited = __import__("time").monotonic() - t0
    assert e.value.status == 6 and e.value.status_name == "HEP_ERR_TIMEOUT", str(e.value)
    assert "rank %d did not arrive" % (world - 1) in str(e.value), str(e.value)
    assert isinstance(e.value, RuntimeError)
    assert waited < 10, "waited %.1f s" % waited
    return str(e.value)


def test_a_rank_that_never_joins_is_named_within_the_timeout():
    out = run_ranks(_never_joins, 3, env={"HEP_TIMEOUT_MS": "2000"}, timeout=60)
    assert out[2] == "absent"
    for r in (0, 1):
        assert "rank 2 did not arrive" in out[r], out[r]


def _bad_inputs(rank, world):
    buf = hybridep.Buffer(None, H, T, EL, backend="host", max_topk=K)
    ok_h = torch.zeros((4, H), dtype=torch.bfloat16)
    ok_i = torch.zeros((4, K), dtype=torch.int64)
    ok_w = torch.zeros((4, K), dtype=torch.float32)
    cases = [
        ((ok_h.float(), ok_i, ok_w), "hidden has dtype torch.float32"),
        ((ok_h[:, :32], ok_i, ok_w), "hidden has shape [4, 32]; expected [*, 64]"),
        ((torch.zeros((T + 1, H), dtype=torch.bfloat16), torch.zeros((T + 1, K), dtype=torch.int64),
          torch.zeros((T + 1, K))), "at most 12 per rank"),
        ((ok_h, ok_i.to(torch.int16), ok_w), "topk_idx has dtype torch.int16"),
        ((ok_h, ok_i[:3], ok_w), "topk_idx has shape [3, 3]; expected [4, *]"),
        ((ok_h, torch.zeros((4, K + 1), dtype=torch.int64), torch.zeros((4, K + 1))),
         "expected 1..3 (max_topk)"),
        ((ok_h, ok_i, ok_w.double()), "topk_weights has dtype torch.float64"),
        ((ok_h, ok_i, ok_w[:, :2]), "topk_weights has shape [4, 2]; expected [4, 3]"),
    ]
    for args, text in cases:
        with pytest.raises(ValueError) as e:
            buf.dispatch(*args)
        assert text in str(e.value), "%r not in %r" % (text, str(e.value))
    with pytest.raises(ValueError, match="only for FP8"):
        buf.dispatch(ok_h, ok_i, ok_w, scaling_factor=torch.zeros((4, 1)))
    # the group still works after refused calls
    tokens, probs, _, tpe, h = buf.dispatch(ok_h, ok_i, ok_w)
    with pytest.raises(ValueError, match=r"hidden has shape \[%d, 8\]" % h.num_recv):
        buf.combine(torch.zeros((h.num_recv, 8), dtype=torch.bfloat16), h)
    out = buf.combine(tokens, h)
    assert out.shape == (4, H)
    # an expert id out of range is the C library's warning (HEP_WARN_IGNORED), on the rank
    # that passed it: that slot is ignored, the dispatch happened, combine follows
    bad_i = ok_i.clone()
    if rank == 0:
        bad_i[1, 2] = EL * world
    if rank == 0:
        with pytest.warns(hybridep.HybridEPWarning) as rec:
            tokens, probs, _, tpe, h = buf.dispatch(ok_h, bad_i, ok_w)
        text = str(rec[0].message)
        assert "topk_idx[1][2] = %d" % (EL * world) in text, text
    else:
        tokens, probs, _, tpe, h = buf.dispatch(ok_h, bad_i, ok_w)
    buf.combine(tokens, h)
    # a handle is one-shot: combining the same dispatch twice is refused by the library
    tokens, _, _, _, h = buf.dispatch(ok_h, ok_i, ok_w)
    buf.combine(tokens, h)
    with pytest.raises(hybridep.HybridEPError, match="combine follows its dispatch, once"):
        buf.combine(tokens, h)
    buf.close()
    with pytest.raises(RuntimeError, match="closed"):
        buf.dispatch(ok_h, ok_i, ok_w)
    return True


def test_bad_shapes_and_dtypes_are_value_errors_naming_the_argument():
    run_ranks(_bad_inputs, 2)


def test_gpu_backend_without_a_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal without one cannot be seen here")
    run_ranks(_gpu_refused, 2)


def _gpu_refused(rank, world):
    with pytest.raises(RuntimeError, match="torch sees no CUDA device; use backend='host'"):
        hybridep.Buffer(None, H, T, EL, backend="gpu")
    return True


def test_a_thread_rank_stream_on_a_bad_device_is_refused_by_name():
    w = hybridep.ThreadWorld(2)
    try:
        with pytest.raises(hybridep.HybridEPError, match="CUDA device -1 is not a device") as info:
            w.rank(1).stream(-1)
        assert info.value.status_name == "HEP_ERR_INVALID"
    finally:
        w.close()


def test_a_thread_rank_stream_without_a_gpu_says_why():
    if torch.cuda.is_available() or os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has a GPU: the refusal without one cannot be seen here")
    w = hybridep.ThreadWorld(2)
    try:
        with pytest.raises(hybridep.HybridEPError, match="hep_inproc_stream") as info:
            w.rank(0).stream(0)
        assert info.value.status_name == "HEP_ERR_UNAVAILABLE", str(info.value)
    finally:
        w.close()
