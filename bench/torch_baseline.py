#!/usr/bin/env python3
"""The same routing through plain PyTorch on one GPU: dispatch as one index_select
permutation of all ranks' tokens, combine as index_add_ in f32 back to the source rows.
Timed like `hybridep bench` (CUDA events, warm-up, median), against the same fewest-bytes
count. Reads the routing that `hybridep bench --dump-routing FILE` wrote."""
import argparse
import statistics
import struct
import sys

import torch


def load(path):
    with open(path, "rb") as f:
        W, T, H, El, K, esize = struct.unpack("6i", f.read(24))
        idx, w = [], []
        for _ in range(W):
            (t,) = struct.unpack("i", f.read(4))
            idx.append(torch.frombuffer(bytearray(f.read(4 * t * K)), dtype=torch.int32).view(t, K))
            w.append(torch.frombuffer(bytearray(f.read(4 * t * K)), dtype=torch.float32).view(t, K))
    return W, T, H, El, K, esize, idx, w


def median_ms(fn, iters, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("routing")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--ours", help="hybridep bench --json output, for the ratio")
    a = ap.parse_args()
    W, T, H, El, K, esize, idx, w = load(a.routing)
    dev = torch.device("cuda")
    dt = torch.bfloat16 if esize == 2 else torch.float8_e4m3fn
    ids = torch.cat(idx).to(dev).long()                       # [W*T, K] global expert ids
    src_rows = ids.shape[0]
    dest = torch.where(ids >= 0, ids // El, torch.full_like(ids, -1))
    onehot = torch.zeros(src_rows, W, dtype=torch.bool, device=dev)
    onehot.scatter_(1, dest.clamp(min=0), dest >= 0)
    # receive order: destination rank, then source rank, then token (as hybridep)
    perm = torch.cat([torch.nonzero(onehot[:, d]).flatten() for d in range(W)])
    recv = perm.numel()
    tokens = (torch.randn(src_rows, H, device=dev)).to(dt)
    expert_out = torch.randn(recv, H, device=dev).to(torch.bfloat16)
    out = torch.empty(src_rows, H, device=dev, dtype=torch.float32)

    def dispatch():
        return tokens.index_select(0, perm)

    def combine():
        out.zero_()
        out.index_add_(0, perm, expert_out.float())
        return out.to(torch.bfloat16)

    td = median_ms(dispatch, a.iters, a.warmup)
    tc = median_ms(combine, a.iters, a.warmup)
    disp_bytes = src_rows * H * esize + recv * H * esize
    comb_bytes = recv * H * 2 + src_rows * H * 2
    print(f"torch baseline (index_select / index_add_ f32, one GPU): {W} ranks x {T} tokens, "
          f"H={H}, {recv} received rows")
    print(f"{'phase':<10} {'median':>10} {'GB/s (fewest bytes)':>20}")
    print(f"{'dispatch':<10} {td:8.3f} ms {disp_bytes / td / 1e6:20.0f}")
    print(f"{'combine':<10} {tc:8.3f} ms {comb_bytes / tc / 1e6:20.0f}")
    if a.ours:
        import json
        try:
            ours = json.load(open(a.ours))
        except (OSError, ValueError) as e:
            print(f"no hybridep figures to compare with ({a.ours}: {e})")
            return 0
        ph = {p["phase"]: p for p in ours["phases"]}
        print(f"hybridep speed-up over torch (torch time / hybridep time; below 1 = slower): "
              f"dispatch {td / ph['dispatch']['median_ms']:.2f}x, "
              f"combine {tc / ph['combine']['median_ms']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
