#!/usr/bin/env python3
"""Summarizes the BTRACE lines of a HEP_BLOCK_TRACE build's bench run (kernels/dispatch.cu:
one line a block and call, "BTRACE call rank block entry push first_warp last_warp
pre_arrive end smid tokens", global timer ns; older builds print neither smid nor tokens).
For each printed call from the third on (the first two
warm up), the times from the call's first block entry over all ranks; then the median over
the calls, in microseconds, of:
  - each rank's push start (its first block past the layout step) and push end (its last
    warp done), and the spread of those ends over the ranks (the eight-rank phase ends
    with its last rank: a spread is time the others wait);
  - each rank's last arrival (the latest end of its blocks other than block 0, which end
    right after they arrive) and its block 0's end (once every node-mate's blocks arrived);
  - the tail after the latest push end, in its parts: a block's own push end to its
    arrivals (the counter's hand-back; block 0: its outputs too), the arrivals themselves
    (a fence and one atomic a destination), the latest arrival and the last block's end;
  - where the lines carry them, the tokens a block's warps took from its rank's counter
    (their share of the rank's rows: a measure of the block's push rate, as a rank's warps
    end together) against the SM it ran on: each rank's SMs, the tokens of blocks whose
    TPC mate (smid ^ 1) ran a block of the call too and of blocks alone on their TPC.
Reads the bench's output on stdin."""
import statistics
import sys
from collections import defaultdict

med = statistics.median


def main():
    calls = defaultdict(list)  # call -> [(rank, block, entry, push, w0, w1, pre, end)]
    sm = defaultdict(list)     # call -> [(rank, block, smid, tokens)]
    for line in sys.stdin:
        f = line.split()
        if len(f) not in (10, 12) or f[0] != "BTRACE":
            continue
        v = [int(x) for x in f[1:]]
        calls[v[0]].append(tuple(v[1:10]))
        if len(v) == 11:
            sm[v[0]].append((v[1], v[2], v[9], v[10]))
    keys = sorted(calls)[2:]
    if not keys:
        print("btrace: fewer than three calls printed BTRACE lines")
        return 1
    per = defaultdict(lambda: defaultdict(list))  # rank -> what -> [us per call]
    tot = defaultdict(list)                       # what -> [us per call]
    for c in keys:
        rows = calls[c]
        t0 = min(r[2] for r in rows)
        us = lambda t: (t - t0) / 1e3
        ranks = defaultdict(list)
        for r in rows:
            ranks[r[0]].append(r)
        ends = {}
        for rk, rr in ranks.items():
            ends[rk] = us(max(r[5] for r in rr))
            per[rk]["start"].append(us(min(r[3] for r in rr)))
            per[rk]["end"].append(ends[rk])
            others = [r for r in rr if r[1] != 0]
            if others:
                per[rk]["arrived"].append(us(max(r[7] for r in others)))
            for r in rr:
                if r[1] == 0:
                    per[rk]["b0_out"].append((r[6] - r[5]) / 1e3)
                    per[rk]["b0_end"].append(us(r[7]))
        latest = max(ends.values())
        tot["spread"].append(latest - min(ends.values()))
        tot["latest"].append(latest)
        tot["tail"].append(us(max(r[7] for r in rows)) - latest)
        nz = [r for r in rows if r[1] != 0]
        if nz:
            tot["to_arrive"].append(med((r[6] - r[5]) / 1e3 for r in nz))
            tot["arrive"].append(med((r[7] - r[6]) / 1e3 for r in nz))
            tot["arrive_max"].append(max((r[7] - r[6]) / 1e3 for r in nz))
            tot["last_arrival"].append(us(max(r[7] for r in nz)) - latest)
    print("btrace: %d calls, %d ranks, medians in us from the call's first block entry"
          % (len(keys), len(per)))
    print("%-6s %12s %12s %14s %14s %14s" % ("rank", "push start", "push end", "last arrival",
                                             "block 0 out", "block 0 end"))
    m = lambda rk, k: med(per[rk][k]) if per[rk][k] else float("nan")
    for rk in sorted(per):
        print("%-6d %12.1f %12.1f %14.1f %14.1f %14.1f" % (
            rk, m(rk, "start"), m(rk, "end"), m(rk, "arrived"), m(rk, "b0_out"), m(rk, "b0_end")))
    print("push ends' spread over the ranks %.1f us; latest push end %.1f us; "
          "then to the last block's end %.1f us" % (med(tot["spread"]), med(tot["latest"]),
                                                    med(tot["tail"])))
    if tot["arrive"]:
        print("blocks other than 0: own push end to arrivals %.1f us, the arrivals %.1f us "
              "(slowest %.1f); latest arrival %.1f us after the latest push end" % (
                  med(tot["to_arrive"]), med(tot["arrive"]), med(tot["arrive_max"]),
                  med(tot["last_arrival"])))
    sm_report([sm[c] for c in keys if sm[c]])
    return 0


def sm_report(calls):
    """The blocks' token shares against their SMs (see the module's text)."""
    if not calls:
        return
    first = calls[0]
    print("SMs of each rank's blocks (first call summarized):")
    for rk in sorted({r[0] for r in first}):
        mine = sorted((r[1], r[2]) for r in first if r[0] == rk)
        print("  rank %d: %s" % (rk, " ".join(str(s) for _, s in mine)))
    paired, alone, by_rank = [], [], defaultdict(list)
    for rows in calls:
        busy = {r[2] for r in rows}
        for rk, _, s, tok in rows:
            (paired if s ^ 1 in busy else alone).append(tok)
            by_rank[rk].append(tok)
    print("tokens a block took: median %s; by rank (median, min-max): %s" % (
        med(paired + alone), "; ".join("%d: %g (%d-%d)" % (rk, med(v), min(v), max(v))
                                       for rk, v in sorted(by_rank.items()))))
    for what, v in (("whose TPC mate ran a block", paired), ("alone on their TPC", alone)):
        if v:
            print("  blocks %s: %d, tokens median %g (%d-%d)" % (
                what, len(v), med(v), min(v), max(v)))



if __name__ == "__main__":
    sys.exit(main())
