"""The product's whole forecast over the labelled lengths, every policy, in seconds rather than a real run's minutes.

Each draw is a workload drawn from benchmarks/data/lengths.parquet as benchmarks/length_labelled.py draws it (open:
150 MT-bench and Vicuna questions; mixed: 180 GSM8K, 60 MT-bench, 60 Vicuna; --scale k: k times as many, with
replacement), with the heuristic's predictions (an open run's, and a mixed run's before 256 rows have finished) and
one of the two real samplings' lengths. It runs through the real Scheduler and DeadlineTracker on
tests/test_forecast.py's simulated engine (64 slots, this CPU's step cost or a GPU's, one row in 8 drawn at random
as the product's default --sample-every does) and compares, at 10%, 25% and 50% of rows, the ETA with the time that
remained and the forecast's tokens to come with those that came.

    python benchmarks/forecast_labelled.py [--draws 12] [--policies ...] [--workloads open mixed] [--scale 1]
                                           [--cost CPU|GPU]

Prints per workload and policy: the median ETA error at each point, the share of draws within ±10% there, the mean
|error| over the three points, the median tokens to come (forecast / actual) and their mean |log|.
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
    ap.add_argument("--policies", nargs="+", default=["longest-first", "fifo", "shortest-first", "auto"])
    ap.add_argument("--workloads", nargs="+", default=["open", "mixed"])
    ap.add_argument("--scale", type=int, default=1)
    ap.add_argument("--cost", choices=("CPU", "GPU"), default="CPU")
    args = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.join(os.path.dirname(here), "tests")]
    import length_labelled
    import test_forecast as tf

    from overnight.pipeline.scheduling.deadline import DeadlineTracker

    generated, at_forecast = [0], []  # the tokens generated so far (a step's sequences each make one); at each one
    before_step, forecast_job = DeadlineTracker.before_step, DeadlineTracker.forecast_job

    def counting_before_step(self):
        before_step(self)
        generated[0] += self._step_n

    def recording_forecast_job(self, *a, **k):
        f = forecast_job(self, *a, **k)
        at_forecast.append(generated[0])
        return f

    DeadlineTracker.before_step, DeadlineTracker.forecast_job = counting_before_step, recording_forecast_job
    lab = length_labelled.labelled()
    cost = tf.CPU if args.cost == "CPU" else tf.GPU
    for workload in args.workloads:
        for policy in args.policies:
            errors, tokens = [], []
            for d in range(args.draws):
                rng = np.random.default_rng(d)
                idx = length_labelled.draw_rows(lab.src, workload, rng, args.scale)
                a = np.minimum(lab.out[idx, d % 2], length_labelled.CAP).astype(np.float64)
                p = lab.heuristic[idx].astype(np.float64)
                generated[0], at_forecast[:] = 0, []
                story = tf.simulate(policy, cost, rows=(p, a), sample_every=8, seed=d)
                e, t = [], []
                for share in SHARES:
                    i = next(j for j, s in enumerate(story.samples) if s[1] >= share * story.n)
                    when, _, f = story.samples[i]
                    e.append(f.eta_s / (story.end - when) - 1)
                    t.append(f.remaining_tokens / (a.sum() - at_forecast[i]))
                errors.append(e)
                tokens.append(t)
            e, t = np.array(errors), np.array(tokens)
            print(f"{workload:5s} {policy:14s} ETA " + " / ".join(f"{v:+.0%}" for v in np.median(e, 0))
                  + "  within ±10% " + " / ".join(f"{v:.0%}" for v in (np.abs(e) <= 0.10).mean(0))
                  + f"  |error| {np.abs(e).mean():.3f}  tokens " + " / ".join(f"x{v:.2f}" for v in np.median(t, 0))
                  + f"  |log| {np.abs(np.log(t)).mean():.3f}", flush=True)


if __name__ == "__main__":
    main()
