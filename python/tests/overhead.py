"""Per-call Python overhead of Buffer.dispatch / Buffer.combine: the host time of the
package's call minus the host time of the bare C call (hep_dispatch / hep_combine through
ctypes, with the same prepared arguments), medians over many calls.

Host backend (default; one process, or several with torchrun): both calls do the same C
work, so the difference is the Python around it. GPU (--backend gpu, torchrun, one process
per rank): a no_sync Buffer, so neither call waits for the GPU; the stream is synchronized
(outside the timed regions) every few calls so the launch queue never fills.

  /usr/bin/python3 python/tests/overhead.py                       # here, host backend
  torchrun --nproc-per-node 8 python/tests/overhead.py --backend gpu
Prints one line per phase; --json FILE writes the numbers."""
import argparse
import ctypes
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import hybridep
from hybridep import _lib


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="host", choices=("host", "gpu"))
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts-per-rank", type=int, default=4)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--target-us", type=float, default=15.0)
    a = ap.parse_args()
    if "RANK" not in os.environ:  # one process on its own
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(29000 + os.getpid() % 1000))
    gpu = a.backend == "gpu"
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = "cuda" if gpu else "cpu"
    E = a.experts_per_rank * world
    g = torch.Generator().manual_seed(rank + 1)
    x = torch.randn(a.tokens, a.hidden, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.stack([torch.randperm(E, generator=g)[:a.topk] for _ in range(a.tokens)]).to(dev)
    w = torch.rand(a.tokens, a.topk, generator=g).to(dev)
    buf = hybridep.Buffer(None, a.hidden, a.tokens, a.experts_per_rank, backend=a.backend,
                          max_topk=a.topk, num_sms=4 if gpu else None, no_sync=gpu)
    # the first call sets up the views; then the bare C arguments are what the package built
    tok, _, _, _, h = buf.dispatch(x, idx, w, copy=False)
    out = buf.combine(tok, h)
    da, dr, ca = buf._args, buf._res, buf._cargs
    p_da, p_dr, p_ca = ctypes.byref(da), ctypes.byref(dr), ctypes.byref(ca)
    c_dispatch, c_combine, G = _lib.lib.hep_dispatch, _lib.lib.hep_combine, buf._g
    keep = (x, idx, w)
    py_d, py_c, c_d, c_c = [], [], [], []
    clock = time.perf_counter_ns

    def package():
        t0 = clock()
        tok, _, _, _, h = buf.dispatch(x, idx, w, copy=False)
        t1 = clock()
        buf.combine(tok, h, out=out)
        t2 = clock()
        return t1 - t0, t2 - t1

    def bare():
        t0 = clock()
        rc = c_dispatch(G, p_da, p_dr)
        t1 = clock()
        ca.handle = dr.handle  # what any caller of hep_combine sets
        rc |= c_combine(G, p_ca)
        t2 = clock()
        if rc:
            _lib.check(rc, "bare C call")
        return t1 - t0, t2 - t1

    for it in range(a.calls):
        if gpu and it % 16 == 0:
            torch.cuda.synchronize()
            buf.sync()
        # alternate the order: neither side always runs on a warmer cache
        if it % 2 == 0:
            p, c = package(), bare()
        else:
            c, p = bare(), package()
        if it >= a.calls // 10:
            py_d.append(p[0]), py_c.append(p[1]), c_d.append(c[0]), c_c.append(c[1])
    if gpu:
        torch.cuda.synchronize()
        buf.sync()
    del keep
    med = lambda v: statistics.median(v) / 1e3  # us
    res = {"backend": a.backend, "world": world, "calls": len(py_d),
           "py_dispatch_us": med(py_d), "c_dispatch_us": med(c_d),
           "py_combine_us": med(py_c), "c_combine_us": med(c_c)}
    res["overhead_dispatch_us"] = res["py_dispatch_us"] - res["c_dispatch_us"]
    res["overhead_combine_us"] = res["py_combine_us"] - res["c_combine_us"]
    buf.close()
    allr = [None] * world
    dist.all_gather_object(allr, res)
    if rank == 0:
        print("hybridep per-call Python overhead (%s backend, %d rank(s), torch %s, %d calls, "
              "T=%d H=%d): median host time of the package's call minus the bare C call's"
              % (a.backend, world, torch.__version__, len(py_d), a.tokens, a.hidden))
        worst = {}
        for ph in ("dispatch", "combine"):
            o = max(r["overhead_%s_us" % ph] for r in allr)
            worst[ph] = o
            print("  %-8s package %7.2f us   C %7.2f us   overhead %6.2f us (max over ranks)  "
                  "target <= %.0f us: %s" % (ph, statistics.median(r["py_%s_us" % ph] for r in allr),
                                             statistics.median(r["c_%s_us" % ph] for r in allr), o,
                                             a.target_us, "met" if o <= a.target_us else "NOT met"))
        print("OVERHEAD dispatch_us=%.2f combine_us=%.2f" % (worst["dispatch"], worst["combine"]))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(allr, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
