"""Bench through the package on the GPU (run with torchrun, one process per rank):
dispatch and combine phase times (median wall time of a synchronous call, all ranks
between barriers), and the per-call Python overhead: the host time of Buffer.dispatch /
Buffer.combine minus the host time of the bare ctypes call with the same arguments, both
with no_sync (nothing waits for the GPU)."""
import argparse
import ctypes
import os
import statistics
import time

import torch
import torch.distributed as dist

import hybridep
from hybridep import _lib


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts-per-rank", type=int, default=32)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--sms", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    E = a.experts_per_rank * world
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(a.tokens, a.hidden, generator=g).to(torch.bfloat16).cuda()
    idx = torch.stack([torch.randperm(E, generator=g)[:a.topk] for _ in range(a.tokens)]).cuda()
    w = torch.rand(a.tokens, a.topk, generator=g).cuda()
    res = {}
    buf = hybridep.Buffer(None, a.hidden, a.tokens, a.experts_per_rank, backend="gpu",
                          num_sms=a.sms, max_topk=a.topk)
    td, tc = [], []
    for it in range(a.iters + 3):
        dist.barrier()
        t0 = time.perf_counter()
        tok, pr, _, tpe, h = buf.dispatch(x, idx, w)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        dist.barrier()
        t2 = time.perf_counter()
        buf.combine(tok, h)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        if it >= 3:
            td.append(t1 - t0)
            tc.append(t3 - t2)
    res["dispatch_ms"] = statistics.median(td) * 1e3
    res["combine_ms"] = statistics.median(tc) * 1e3
    res["recv_rows"] = h.num_recv
    buf.close()
    # Python overhead: no_sync buffer, the wrapper against the bare ctypes call
    nb = hybridep.Buffer(None, a.hidden, a.tokens, a.experts_per_rank, backend="gpu",
                         num_sms=a.sms, max_topk=a.topk, no_sync=True)
    out = torch.empty_like(x)
    py_d, py_c, c_d, c_c = [], [], [], []
    for it in range(a.iters + 3):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        tok, _, _, _, h = nb.dispatch(x, idx, w)
        t1 = time.perf_counter()
        nb.combine(tok, h)
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        dist.barrier()
        da = nb._args  # the same arguments, through ctypes only
        t3 = time.perf_counter()
        _lib.check(_lib.lib.hep_dispatch(nb._g, ctypes.byref(da), ctypes.byref(nb._res)))
        t4 = time.perf_counter()
        ca = _lib.CombineArgs(nb._res.handle, _lib.lib.hep_combine_input(nb._g), out.data_ptr(),
                              torch.cuda.current_stream().cuda_stream, _lib.HEP_ASYNC)
        t5 = time.perf_counter()
        _lib.check(_lib.lib.hep_combine(nb._g, ctypes.byref(ca)))
        t6 = time.perf_counter()
        if it >= 3:
            py_d.append(t1 - t0), py_c.append(t2 - t1), c_d.append(t4 - t3), c_c.append(t6 - t5)
    torch.cuda.synchronize()
    nb.sync()
    med = lambda v: statistics.median(v) * 1e6
    res["py_overhead_dispatch_us"] = med(py_d) - med(c_d)
    res["py_overhead_combine_us"] = med(py_c) - med(c_c)
    res["c_call_dispatch_us"], res["c_call_combine_us"] = med(c_d), med(c_c)
    nb.close()
    allr = [None] * world
    dist.all_gather_object(allr, res)
    if rank == 0:
        print("hybridep Python bench: %d ranks, T=%d H=%d E_l=%d K=%d, %d SMs, %d iterations"
              % (world, a.tokens, a.hidden, a.experts_per_rank, a.topk, a.sms, a.iters))
        for k in ("dispatch_ms", "combine_ms", "py_overhead_dispatch_us", "py_overhead_combine_us",
                  "c_call_dispatch_us", "c_call_combine_us", "recv_rows"):
            vals = [r[k] for r in allr]
            print("  %-26s max %10.3f  median %10.3f" % (k, max(vals), statistics.median(vals)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
