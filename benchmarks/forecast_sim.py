"""The forecast and the cap on a simulated engine with a fake clock: the real Scheduler and DeadlineTracker, no
machine noise (tests/test_forecast.py's simulate()).

A step costs fixed + per-sequence seconds: this CPU's (38 ms + 3.4 ms per sequence, docs/BENCHMARKS.md "Engine
step cost") or a GPU's (20 ms + 0.02 ms). Rows' lengths are log-normal around predictions that are 32% low and
barely rank (Kendall's tau about 0.15), as the embedded model's are. It prints:

1. the worst absolute ETA error over --seeds seeds at 10%, 25% and 50% of rows, per policy and cost model, and
   for rows of 4 samples (n = 4, fifo);
2. how often the 80% range held the actual remaining time;
3. rows done by a deadline at 30% of the fifo makespan (150 rows, CPU cost), per seed: fifo, shortest-first
   without the cap, auto (shortest-first and the cap), and auto with perfect predictions: what the order and
   the cap can reach when the lengths are known, against what they reach with these predictions.

    python benchmarks/forecast_sim.py --seeds 3
    python benchmarks/forecast_sim.py --late    # only: the signed ETA error late in the run, where the drain's tail rules
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--goodput-seeds", type=int, default=6)
    ap.add_argument("--late", action="store_true", help="only the signed ETA error at 50% / 75% / 90% of rows, "
                                                        "longest-first and auto, on tests/test_forecast.py's story")
    args = ap.parse_args()
    logging.disable(logging.CRITICAL)
    import numpy as np

    import test_forecast as tf

    if args.late:
        print("ETA error at 50% / 75% / 90% of rows (test_forecast.simulate's defaults):")
        for name, cost in (("CPU", tf.CPU), ("GPU", tf.GPU)):
            for pol in ("longest-first", "auto"):
                story = tf.simulate(pol, cost)
                print(f"  {name} {pol:14s} " + " / ".join(f"{tf.eta_error(story, s)[0]:+.1%}" for s in (0.5, 0.75, 0.9)))
        return

    print("worst |ETA error| over seeds at 10% / 25% / 50% of rows:")
    cases = [(name, cost, pol, 1) for name, cost in (("CPU", tf.CPU), ("GPU", tf.GPU))
             for pol in ("fifo", "longest-first", "shortest-first", "auto")] + [("CPU", tf.CPU, "fifo", 4)]
    for name, cost, pol, n in cases:
        errs = []
        for seed in range(args.seeds):
            story = tf.simulate(pol, cost, seed=seed, n_rows=600 if n == 1 else 200, n_samples=n)
            errs.append([abs(tf.eta_error(story, s)[0]) for s in (0.10, 0.25, 0.50)])
        worst = np.max(np.array(errs), axis=0)
        label = pol + ("" if n == 1 else f", n = {n}")
        print(f"  {name} {label:22s} " + " / ".join(f"{w:.1%}" for w in worst))

    held = []
    for seed in range(4):
        story = tf.simulate("fifo", tf.CPU, seed=seed)
        for share in (0.10, 0.25, 0.50):
            _, f, actual = tf.eta_error(story, share)
            held.append(f.eta_low_s <= actual <= f.eta_high_s)
    print(f"80% range held the actual remaining time in {sum(held)} of {len(held)} checks (fifo, CPU, 4 seeds)")

    print("\nrows done by a deadline at 30% of the fifo makespan (150 rows, CPU cost):")
    real = tf.lognormal_rows

    def perfect(n, mu, sigma, rng, cap=512):
        _, actual = real(n, mu, sigma, rng, cap)
        return actual.copy(), actual

    ratios, best = [], []
    for seed in range(args.goodput_seeds):
        full = tf.simulate("fifo", tf.CPU, seed=seed, n_rows=150)
        kw = dict(deadline_share=0.3, makespan=full.end, seed=seed, n_rows=150)
        fifo = tf.simulate("fifo", tf.CPU, **kw).done
        nocap = tf.simulate("shortest-first", tf.CPU, **kw).done
        auto = tf.simulate("auto", tf.CPU, **kw).done
        tf.lognormal_rows = perfect
        try:
            oracle = tf.simulate("auto", tf.CPU, **kw).done
        finally:
            tf.lognormal_rows = real
        ratios.append(auto / fifo)
        best.append(oracle / fifo)
        print(f"  seed {seed}: fifo {fifo}, shortest-first (no cap) {nocap}, auto {auto} ({auto / fifo:.2f}x), auto "
              f"with perfect predictions {oracle} ({oracle / fifo:.2f}x)")
    print(f"  auto / fifo: median {statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f}); "
          f"with perfect predictions median {statistics.median(best):.2f}x ({min(best):.2f}-{max(best):.2f})")


if __name__ == "__main__":
    main()
