"""A small MoE layer over hybridep: router, top-k, dispatch, two local expert MLPs per
rank, combine. Run one process per rank:

    torchrun --nproc-per-node 4 examples/moe_layer.py --backend host      # no GPU
    torchrun --nproc-per-node 4 examples/moe_layer.py --backend host --ranks-per-node 2
                                        # 2 x 2 virtual nodes: the inter-node path, no NIC
    torchrun --nproc-per-node 8 examples/moe_layer.py --backend gpu       # one or more GPUs

Checks the layer against the same layer computed with plain torch on each rank's tokens
(every expert's weights are on every rank for the check), then times forward and
forward + backward and prints the medians and the per-call Python overhead."""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import hybridep
import hybridep.autograd as ha


class MoE(torch.nn.Module):
    def __init__(self, buf, hidden, ffn, experts_per_rank, topk, world, rank):
        super().__init__()
        E = experts_per_rank * world
        g = torch.Generator().manual_seed(0)  # same weights on every rank
        self.router = torch.nn.Parameter(torch.randn(hidden, E, generator=g) * 0.1)
        self.w1 = torch.nn.Parameter(torch.randn(E, hidden, ffn, generator=g) * hidden ** -0.5)
        self.w2 = torch.nn.Parameter(torch.randn(E, ffn, hidden, generator=g) * ffn ** -0.5)
        self.buf, self.El, self.K, self.rank = buf, experts_per_rank, topk, rank

    def route(self, x):
        scores = torch.softmax(x.float() @ self.router, dim=-1)
        w, idx = torch.topk(scores, self.K, dim=-1)
        return idx, (w / w.sum(-1, keepdim=True)).detach()

    def experts(self, rows, probs, first):
        y = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
        for e in range(self.El):
            h = torch.relu(rows.float() @ self.w1[first + e]) @ self.w2[first + e]
            y = y + probs[:, e:e + 1] * h
        return y.to(torch.bfloat16)

    def forward(self, x):
        idx, w = self.route(x)
        tokens, probs, tpe, handle = ha.dispatch(self.buf, x, idx, w)
        return ha.combine(self.buf, self.experts(tokens, probs, self.rank * self.El), handle)

    def reference(self, x):
        """The same layer without communication: every expert applied where routed."""
        idx, w = self.route(x)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for d in range(self.buf.world):
            part = torch.zeros_like(y)
            hit = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
            for e in range(self.El):
                ge = d * self.El + e
                p = (w * (idx == ge)).sum(-1, keepdim=True)
                hit |= (idx == ge).any(-1)
                h = torch.relu(x.float() @ self.w1[ge]) @ self.w2[ge]
                part = part + p * h
            y = y + torch.where(hit[:, None], part.to(torch.bfloat16).float(), torch.zeros_like(part))
        return y.to(torch.bfloat16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["gpu", "host"], default="gpu" if torch.cuda.is_available() else "host")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--experts-per-rank", type=int, default=2)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--sms", type=int, default=None)
    ap.add_argument("--ranks-per-node", type=int, default=None,
                    help="ranks of one node (default: those of one host); fewer make virtual "
                         "nodes, joined by the loopback NIC on one host")
    a = ap.parse_args()
    gpu = a.backend == "gpu"
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda") if gpu else torch.device("cpu")
    buf = hybridep.Buffer(None, a.hidden, a.tokens, a.experts_per_rank, backend=a.backend,
                          num_sms=a.sms, max_topk=a.topk, ranks_per_node=a.ranks_per_node)
    layer = MoE(buf, a.hidden, a.ffn, a.experts_per_rank, a.topk, world, rank).to(dev)
    g = torch.Generator().manual_seed(100 + rank)
    x = (torch.randn(a.tokens, a.hidden, generator=g)).to(torch.bfloat16).to(dev)
    y = layer(x)
    yr = layer.reference(x)
    err = (y.float() - yr.float()).abs().max().item()
    ok = torch.allclose(y.float(), yr.float(), rtol=2e-2, atol=2e-2)

    def timed(fn):
        ts = []
        for _ in range(a.iters):
            if gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if gpu:
                torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3

    fwd = timed(lambda: layer(x))
    xg = x.clone().requires_grad_(True)
    fb = timed(lambda: layer(xg).float().sum().backward())
    rows = [torch.zeros(1) for _ in range(world)]
    n = torch.tensor([float(buf._last.num_recv)])
    dist.all_gather(rows, n)
    res = torch.tensor([float(ok), err, fwd, fb])
    allres = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(allres, res)
    if rank == 0:
        print("hybridep MoE layer: %d ranks (%d nodes x %d, transport %s), backend %s, %d "
              "tokens x %d hidden per rank, %d experts per rank, top-%d"
              % (world, buf.num_nodes, buf.ranks_per_node, buf.transport, a.backend, a.tokens,
                 a.hidden, a.experts_per_rank, a.topk))
        for r, v in enumerate(allres):
            print("  rank %d: received %d rows; matches plain torch: %s (max |diff| %.3g); "
                  "forward %.3f ms, forward+backward %.3f ms (medians of %d)"
                  % (r, int(rows[r]), bool(v[0]), v[1], v[2], v[3], a.iters))
    buf.close()
    dist.destroy_process_group()
    if not all(bool(v[0]) for v in allres):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
