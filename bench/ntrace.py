#!/usr/bin/env python3
"""Summarizes the NTRACE lines of a HEP_NODE_TRACE build's bench run (kernels/ring.cuh):
per phase and event, the median over the printed calls (the first two left out; a call
that printed is not among them) of the event's time
from the call's first kernel start over all ranks, in microseconds: the earliest and the
latest rank, and the median rank. Reads the bench's output on stdin."""
import statistics
import sys
from collections import defaultdict

EVENTS = {  # kernels/ring.cuh, HEP_NODE_TRACE: the words of a line (chunk 1: 1 and later)
    "D": ["start (first block)", "start (last block)",
          "chunk 0 staged (first block)", "chunk 1 staged (first block)",
          "chunk 0 staged (last block)", "chunk 1 staged (last block)", "layout released",
          "own tokens pushed (first warp)", "own tokens pushed (last warp)",
          "chunk 0 landed (first seen)", "chunk 1 landed (first seen)",
          "chunk 0 forwarded (last block)", "chunk 1 forwarded (last block)",
          "end (first block)", "end (last block)"],
    "C": ["start (first block)", "start (last block)",
          "chunk 0 published", "chunk 1 published",
          "reduction done (first warp)", "reduction done (last warp)",
          "chunk 0 landed (first seen)", "chunk 1 landed (first seen)",
          "end (first warp)", "end (last warp)"],
}


def main():
    calls = defaultdict(dict)  # (phase, call) -> rank -> words
    for line in sys.stdin:
        f = line.split()
        if len(f) < 20 or f[0] != "NTRACE":
            continue
        calls[(f[1], int(f[2]))][int(f[3])] = [int(x) for x in f[4:20]]
    for phase in ("D", "C"):
        keys = sorted(c for p, c in calls if p == phase)[2:]
        if not keys:
            continue
        # per (event, rank): the times of the calls
        per = defaultdict(list)
        ranks = set()
        for c in keys:
            ranks_words = calls[(phase, c)]
            t0 = min(w[0] for w in ranks_words.values() if w[0])
            for r, w in ranks_words.items():
                ranks.add(r)
                for i, v in enumerate(w):
                    if v:
                        per[(i, r)].append((v - t0) / 1e3)
        print(f"{'dispatch' if phase == 'D' else 'combine'}: {len(keys)} calls, "
              f"{len(ranks)} ranks, us from the call's first start (median over calls)")
        print(f"  {'event':34s} {'first rank':>10s} {'median':>8s} {'last rank':>10s}")
        for i, name in enumerate(EVENTS[phase]):
            meds = [statistics.median(per[(i, r)]) for r in sorted(ranks) if per.get((i, r))]
            if not meds:
                continue
            print(f"  {name:34s} {min(meds):10.1f} {statistics.median(meds):8.1f} "
                  f"{max(meds):10.1f}")


if __name__ == "__main__":
    main()
