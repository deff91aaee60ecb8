"""The bench through the package on the GPU (torchrun, one process per rank): dispatch and
combine phase times measured as the C bench across processes (`test_gpu_mpi bench`)
measures them: from the last rank's call to the last rank's return of its (synchronous)
call, CLOCK_MONOTONIC, which the processes of one host share; median over the iterations.
At the bench's default shape, with the zero-copy outputs (copy=False) as the C bench uses
them. The events and the synchronize that read them lie outside each call's window. gpu_run.sh prints them beside the C bench's.
Prints `PYBENCH dispatch_ms=... combine_ms=...` on rank 0."""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import hybridep


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts-per-rank", type=int, default=32)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--sms", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--side-stream", action="store_true",
                    help="run the calls on a stream of their own (torch.cuda.Stream) instead "
                         "of the current (default) stream")
    ap.add_argument("--bind-cpu", action="store_true",
                    help="pin each process to one CPU core (local rank x ncores / nproc), as "
                         "mpirun binds its ranks; torchrun does not")
    a = ap.parse_args()
    if a.bind_cpu:
        ncpu = len(os.sched_getaffinity(0))
        lr, nlr = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        core = sorted(os.sched_getaffinity(0))[lr * max(1, ncpu // max(1, nlr)) % ncpu]
        os.sched_setaffinity(0, {core})
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    E = a.experts_per_rank * world
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(a.tokens, a.hidden, generator=g).to(torch.bfloat16).cuda()
    idx = torch.stack([torch.randperm(E, generator=g)[:a.topk] for _ in range(a.tokens)]).cuda()
    w = torch.rand(a.tokens, a.topk, generator=g).cuda()
    buf = hybridep.Buffer(None, a.hidden, a.tokens, a.experts_per_rank, backend="gpu",
                          num_sms=a.sms, max_topk=a.topk)
    out = torch.empty_like(x)
    if a.side_stream:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        torch.cuda.set_stream(side)
    now = lambda: time.clock_gettime(time.CLOCK_MONOTONIC)
    marks, split = [], []
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    for it in range(a.iters + a.warmup):
        dist.barrier()
        ev[0].record()  # the events bracket each call on the stream, outside its host time
        t0 = now()
        tok, pr, _, tpe, h = buf.dispatch(x, idx, w, copy=False)  # synchronous: waits
        t1 = now()
        ev[1].record()
        dist.barrier()
        ev[2].record()
        t2 = now()
        buf.combine(tok, h, out=out)  # rows in the group's combine input: no copy
        t3 = now()  # the call is synchronous: its stream is done when it returns
        ev[3].record()
        torch.cuda.current_stream().synchronize()  # the events, outside the call's window
        t3b = now()
        if it >= a.warmup:
            marks.append((t0, t1, t2, t3))
            # where a call's time goes: the combine call itself (the C call blocks until
            # its stream is done), the bench's own synchronize after it (an event record
            # included; not part of the call), and each phase's stream time between events
            # recorded around the call
            split.append((t3 - t2, t3b - t3, ev[0].elapsed_time(ev[1]) / 1e3,
                          ev[2].elapsed_time(ev[3]) / 1e3))
    rows = h.num_recv
    buf.close()
    allm, alls = [None] * world, [None] * world
    dist.all_gather_object(allm, (marks, rows))
    dist.all_gather_object(alls, split)
    if rank == 0:
        d = [max(m[0][i][1] for m in allm) - max(m[0][i][0] for m in allm) for i in range(a.iters)]
        c = [max(m[0][i][3] for m in allm) - max(m[0][i][2] for m in allm) for i in range(a.iters)]
        md, mc = statistics.median(d) * 1e3, statistics.median(c) * 1e3
        # each rank's own call (its start to its end), median; the slowest rank's
        od = max(statistics.median(m[0][i][1] - m[0][i][0] for i in range(a.iters)) for m in allm)
        oc = max(statistics.median(m[0][i][3] - m[0][i][2] for i in range(a.iters)) for m in allm)
        per_rank = sum(m[1] for m in allm) / world
        rb = a.hidden * 2
        print("hybridep Python bench: %d processes, T=%d H=%d E_l=%d K=%d BF16, %d SMs, %d "
              "iterations (median; last rank's start to last rank's end)"
              % (world, a.tokens, a.hidden, a.experts_per_rank, a.topk, a.sms, a.iters))
        print("  stream: %s; %s" % ("a side stream of its own" if a.side_stream
                                    else "the current (default) stream",
                                    "each process pinned to one core" if a.bind_cpu
                                    else "processes not pinned"))
        print("  dispatch %8.3f ms  (slowest rank's own call %8.3f ms)  %7.1f GB/s algbw per "
              "rank  (%.0f rows per rank)" % (md, od * 1e3, per_rank * rb / md * 1e-6, per_rank))
        print("  combine  %8.3f ms  (slowest rank's own call %8.3f ms)  %7.1f GB/s algbw per "
              "rank" % (mc, oc * 1e3, per_rank * rb / mc * 1e-6))
        worst = [max(statistics.median(sp[i][j] for i in range(a.iters)) for sp in alls)
                 for j in range(4)]
        print("  split (slowest rank's medians): combine call %.3f ms + synchronize after it "
              "%.3f ms; stream time between events: dispatch %.3f ms, combine %.3f ms"
              % tuple(v * 1e3 for v in worst))
        print("PYBENCH dispatch_ms=%.4f combine_ms=%.4f" % (md, mc))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
