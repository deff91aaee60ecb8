#!/usr/bin/env python3
"""Summarizes the BTRACE lines of a HEP_BLOCK_TRACE build's bench run (kernels/dispatch.cu:
one line a block and call, "BTRACE call rank block entry push first_warp last_warp end",
global timer ns). For each printed call from the third on (the first two warm up), the
times from the call's first block entry over all ranks; then the median over the calls, in
microseconds, of:
  - each rank's push end (its last warp done), and the spread of those ends over the ranks
    (the eight-rank phase ends with its last rank: a spread is time the others wait);
  - each rank's push start (its first block past the layout step);
  - the end barrier: the call's last block end after the latest push end.
Reads the bench's output on stdin."""
import statistics
import sys
from collections import defaultdict


def main():
    calls = defaultdict(list)  # call -> [(rank, block, entry, push, w0, w1, end)]
    for line in sys.stdin:
        f = line.split()
        if len(f) != 9 or f[0] != "BTRACE":
            continue
        v = [int(x) for x in f[1:]]
        calls[v[0]].append(tuple(v[1:]))
    keys = sorted(calls)[2:]
    if not keys:
        print("btrace: fewer than three calls printed BTRACE lines")
        return 1
    rank_end = defaultdict(list)
    rank_start = defaultdict(list)
    spread, last_end, barrier = [], [], []
    for c in keys:
        rows = calls[c]
        t0 = min(r[2] for r in rows)
        per_rank = defaultdict(list)
        for r in rows:
            per_rank[r[0]].append(r)
        ends = {}
        for rk, rr in per_rank.items():
            ends[rk] = (max(r[5] for r in rr) - t0) / 1e3
            rank_end[rk].append(ends[rk])
            rank_start[rk].append((min(r[3] for r in rr) - t0) / 1e3)
        spread.append(max(ends.values()) - min(ends.values()))
        last_end.append(max(ends.values()))
        barrier.append((max(r[6] for r in rows) - t0) / 1e3 - max(ends.values()))
    med = statistics.median
    print("btrace: %d calls, %d ranks, medians in us from the call's first block entry"
          % (len(keys), len(rank_end)))
    print("%-6s %12s %12s" % ("rank", "push start", "push end"))
    for rk in sorted(rank_end):
        print("%-6d %12.1f %12.1f" % (rk, med(rank_start[rk]), med(rank_end[rk])))
    print("push ends' spread over the ranks %.1f us; latest push end %.1f us; "
          "then to the last block's end %.1f us" % (med(spread), med(last_end), med(barrier)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
