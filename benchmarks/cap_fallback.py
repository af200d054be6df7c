"""auto's cap on rows in flight when less time is left than a slot needs for its first row on average, before and
after stop 43's change, side by side on the simulated engine (tests/test_forecast.py's simulate(): the real
Scheduler and DeadlineTracker, a fake clock, no machine noise).

best_cap scores c slots by renewal theory, c * (steps(c) / mean + spread / 2 - 1). Where that is 0 or less for
every c (little time left), it returned 1 (before). A review found the cap at 1 for a whole 40 s budget on an echo
engine of a fixed 0.4 s step, where it finished 8 rows and fifo 16. Two rules were tried against it, side by side here:

    lognormal  c * P(L <= steps(c)), L log-normal with the forecast's mean and spread (tried, not kept: worse on
               the CPU's cost)
    flat       the full engine where a step's cost is measured to barely grow with c (step(max) <= 1.25
               step(1)), else 1 (kept: cap.best_cap)

Rows done by a deadline, fifo and auto with each rule, per seed, 150 rows of lengths log-normal around predictions
32% low, for three step costs: this CPU's (38 ms + 3.4 ms a sequence), a GPU's (20 ms + 0.02 ms), and a fixed
0.4 s step; deadlines at 30% and 10% of the fifo makespan.

    python benchmarks/cap_fallback.py --seeds 6
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))


def renewal_only(*args, **kwargs):
    """best_cap before stop 43: renewal theory alone, and 1 where it scores no c above 0."""
    from overnight.pipeline.scheduling.cap import best_cap

    return best_cap(*args, **kwargs, fallback=lambda c, step: 1)


def lognormal(max_seqs, fixed_s, per_seq_s, time_left_s, mean_tokens, prefill_s_per_row=0.0, spread=1.0,
              per_seq_known=True):
    """The rule tried first: where renewal scores no c above 0, c * P(L <= steps(c)), L log-normal."""
    import math

    import numpy as np

    from overnight.pipeline.scheduling.censored import norm_cdf
    from overnight.pipeline.scheduling.cap import best_cap

    def first_rows(c, step):
        sigma = math.sqrt(math.log(max(spread, 1.0)))
        if sigma < 1e-6:
            return 1
        mu = math.log(mean_tokens) - sigma * sigma / 2
        first = c * norm_cdf((np.log(time_left_s / np.maximum(step, 1e-9)) - mu) / sigma)
        return int(c[int(np.argmax(first))]) if first.max() > 1e-9 else 1

    return best_cap(max_seqs, fixed_s, per_seq_s, time_left_s, mean_tokens, prefill_s_per_row, spread,
                    per_seq_known, fallback=first_rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=6)
    args = ap.parse_args()
    logging.disable(logging.CRITICAL)
    import overnight.pipeline.scheduling.estimate as estimate
    import test_forecast as tf

    after = estimate.best_cap  # the flat rule
    costs = {"CPU": tf.CPU, "GPU": tf.GPU, "fixed 0.4 s": (0.4, 0.0)}
    for name, cost in costs.items():
        for share in (0.3, 0.1):
            rows = []
            for seed in range(args.seeds):
                full = tf.simulate("fifo", cost, seed=seed, n_rows=150)
                kw = dict(deadline_share=share, makespan=full.end, seed=seed, n_rows=150)
                fifo = tf.simulate("fifo", cost, **kw).done
                got = {}
                for rule, fn in (("before", renewal_only), ("lognormal", lognormal), ("after", after)):
                    estimate.best_cap = fn
                    try:
                        got[rule] = tf.simulate("auto", cost, **kw).done
                    finally:
                        estimate.best_cap = after
                rows.append((fifo, got["before"], got["lognormal"], got["after"]))
            per_seed = ", ".join("/".join(map(str, r)) for r in rows)
            med = [statistics.median(r[i] / max(r[0], 1) for r in rows) for i in (1, 2, 3)]
            print(f"{name}, deadline at {share:.0%} of the fifo makespan: rows done fifo/before/lognormal/flat per "
                  f"seed {per_seed}; auto / fifo median {med[0]:.2f}x before, {med[1]:.2f}x lognormal, "
                  f"{med[2]:.2f}x flat")


if __name__ == "__main__":
    main()
