"""Do the forecast's length models get the long rows right? The tokens still to come of the rows that ran g tokens.

For each finished `overnight run` folder given, this fits the forecast's LengthMixture (pipeline/scheduling/
lengths.py) on all of the run's rows, in hindsight, and compares, for the rows that ran more than g tokens, the
tokens after g that it expects with those that came (g = 100, 200, 300, 400). A model whose shape misses the rows
that run to max_tokens says too little at large g. Also prints the share of rows max_tokens cut, and the model's
share of runaways where it has one.

    python benchmarks/length_tail.py OUT [OUT ...] [--max-tokens 512]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

GS = (100, 200, 300, 400)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outs", nargs="+")
    ap.add_argument("--max-tokens", type=int, default=512)
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from length_replay import load

    from overnight.pipeline.scheduling.lengths import LengthMixture

    print("expected / actual tokens after g, rows that ran more than g tokens: " + " / ".join(f"g {g}" for g in GS))
    ratios = []
    for out in args.outs:
        d = load(out)
        m = LengthMixture(args.max_tokens)
        m.observe(d["p"], d["a"], d["cut"])
        m.fit(np.zeros(0), np.zeros(0))
        a = np.minimum(d["a"], args.max_tokens)
        row = []
        for g in GS:
            alive = a > g
            row.append(float(m.expected(d["p"][alive], np.full(int(alive.sum()), float(g))).mean()
                             / (a[alive] - g).mean()))
        ratios.append(row)
        runaway = getattr(m, "runaway", None)
        print(f"  {out}  cut {d['cut'].mean():.1%}" + (f", runaway share {runaway:.3f}" if runaway is not None else "")
              + "  " + " ".join(f"{x:.2f}" for x in row))
    r = np.array(ratios)
    print("range over the runs: " + " / ".join(f"{lo:.2f}-{hi:.2f}" for lo, hi in zip(r.min(0), r.max(0))))


if __name__ == "__main__":
    main()
