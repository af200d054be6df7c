"""The drain's tail for a trained predictor's rows run longest predicted first: the sqrt ratio's spread against the
log ratio's. The product's ETA on a simulated engine over the labelled lengths, side by side.

With a trained predictor (calibrated predictions) under longest-first (and auto with no deadline at risk), the
forecast's expected lengths come from SqrtRatioModel. Its drain's tail, the spread of the last rows' lengths beyond
their expected ends (pipeline/scheduling/forecast.py, _tail_steps), came from it too until stop 38; now from the
log ratio (LengthModel) fitted on the same rows (LengthMixture.spread). On a GPU, where a step's cost hardly depends
on the batch, the run's end is the latest row's, and the tail is most of what the ETA has to get right late in a
run.

Each draw is one of benchmarks/forecast_floor.py's emulated runs (the labelled rows of benchmarks/data/lengths.parquet,
the product's trained predictor out of fold; the real world's lengths or the per-prompt world's), run by the real
Scheduler and DeadlineTracker on tests/test_forecast.py's simulated engine with this CPU's step cost and a GPU's,
once with each tail. Prints, per world, workload, step cost and tail: the share of draws within ±10% at 10% / 25% /
50% of rows, the median signed error there, the median |error|, and how often the ETA's range held the actual time.

    python benchmarks/tail_spread.py [--draws 12]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

SHARES = (0.10, 0.25, 0.50)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=12)
    args = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.join(os.path.dirname(here), "tests")]
    import test_forecast as tf
    from forecast_floor import draw_run, worlds

    from overnight.pipeline.scheduling.lengths import LengthMixture

    lab, out, prompt = worlds()
    fit = LengthMixture.fit

    def sqrt_tail(self, *a, **k):  # as before stop 38: the sqrt ratio's own tail
        r = fit(self, *a, **k)
        self.spread = None
        return r

    print(f"the product's ETA under longest-first, a trained predictor's rows, {args.draws} draws: within ±10% at "
          "10% / 25% / 50% of rows; median signed error there; median |error|; the range held the actual time")
    for world in ("real", "per-prompt"):
        for workload in ("mixed", "open"):
            res: dict = {}
            for d in range(args.draws):
                _, p, a = draw_run(lab, out, prompt, world, workload, np.random.default_rng(1000 + d))
                for tail in ("sqrt ratio's", "log ratio's"):
                    LengthMixture.fit = sqrt_tail if tail == "sqrt ratio's" else fit
                    try:
                        for cost in ("CPU", "GPU"):
                            story = tf.simulate("longest-first", getattr(tf, cost), rows=(p, a), calibrated=True)
                            for share in SHARES:
                                e, f, actual = tf.eta_error(story, share)
                                held = f.eta_low_s is not None and f.eta_low_s <= actual <= f.eta_high_s
                                res.setdefault((cost, tail), []).append((e, held))
                    finally:
                        LengthMixture.fit = fit
            for (cost, tail), v in sorted(res.items()):
                e = np.array([x[0] for x in v]).reshape(-1, len(SHARES))
                print(f"{world:10s} {workload:5s} {cost} {tail:13s} "
                      + " / ".join(f"{m:4.0%}" for m in (np.abs(e) <= 0.10).mean(0)) + "; "
                      + " / ".join(f"{m:+.1%}" for m in np.median(e, 0))
                      + f"; |err| {np.median(np.abs(e)):.1%}; range {np.mean([x[1] for x in v]):.0%}", flush=True)


if __name__ == "__main__":
    main()
