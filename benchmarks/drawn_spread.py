"""The rows drawn at random, where the predictions spread wider or narrower than they know: the ETA's error with the
drawn rows' line alone (before stop 66), with the drawn rows predicted among the rows left (after), and under
shortest-first with the drawn rows still running counted before 8 count (stop 67), side by side.

Rows as tests/test_forecast_drawn.py's ``overconfident``: lengths log-normal around a signal, predictions spread
``--spreads`` times as wide as the signal in log (1: calibrated; 1.8: the online predictor fitted on few rows;
0.15: the online predictor's on GSM8K, whose predictions of the rows left span 0.01-0.03 in log). Each seed runs
the real Scheduler and DeadlineTracker on tests/test_forecast.py's simulated engine (a step costs 38 ms + 3.4 ms a
sequence, this CPU's), one admission in eight drawn at random, once per form:

    line    the drawn rows' line of the log ratio on the log prediction alone, the rows running unshifted
    among   the same, beside the shift at which the length model expects what the drawn rows predicted within
            the rows left's predictions ran, weighed by how far the two differ beyond their noise; the rows the
            policy runs shifted the same way (scheduling/drawn.py, estimate.py); under shortest-first nothing
            shifted before 8 drawn rows count
    censored  (shortest-first) the same, and before 8 drawn rows count the rows left shifted as the drawn rows
            within their predictions say, those still running counted as "at least" (DrawnRows.censored_shift)

It prints, per spread and policy, the mean error, the mean |error| and the worst at 10 / 25 / 50 / 75% of rows.

    python benchmarks/drawn_spread.py [--seeds 8] [--spreads 1.8 1.0 0.6 0.3 0.15] [--pool 300] [--forms censored]

With --pool the rows are read as the scheduler's pool drains, that many held at a time (the rest not read yet).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_forecast import CPU, eta_error, simulate  # noqa: E402
from test_forecast_drawn import overconfident  # noqa: E402

from overnight.pipeline.scheduling import estimate  # noqa: E402
from overnight.pipeline.scheduling.drawn import DrawnRows  # noqa: E402

SHARES = (0.10, 0.25, 0.50, 0.75)


def errors(policy: str, spread: float, seeds: int, pool=None) -> np.ndarray:
    out = []
    for seed in range(1, seeds + 1):
        story = simulate(policy, CPU, rows=overconfident(seed, spread=spread), sample_every=8, seed=seed, pool=pool)
        out.append([eta_error(story, share)[0] for share in SHARES])
    return 100 * np.array(out)


def line_only():
    """The drawn rows' line alone, and the rows running as they are: what stop 65 had."""
    among, running = DrawnRows._among, estimate._running_shifted
    DrawnRows._among = lambda self, x, n, e1, e2, where, shift, se, expected: (shift, se)
    estimate._running_shifted = lambda t, scheduler, model, run_p: run_p
    return lambda: (setattr(DrawnRows, "_among", among), setattr(estimate, "_running_shifted", running))


def none_censored():
    """Nothing shifted under shortest-first before 8 drawn rows count: what stop 66 had."""
    censored = DrawnRows.censored_shift
    DrawnRows.censored_shift = lambda self, *args: (0.0, 0.0)
    return lambda: setattr(DrawnRows, "censored_shift", censored)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--spreads", type=float, nargs="+", default=[1.8, 1.0, 0.6, 0.3, 0.15])
    ap.add_argument("--policies", nargs="+", default=["longest-first", "shortest-first"])
    ap.add_argument("--pool", type=int, default=None, help="rows read as the pool drains, this many held at a time")
    ap.add_argument("--forms", nargs="+", default=["line", "among", "censored"])
    args = ap.parse_args()
    print(f"ETA error (%) over {args.seeds} seeds at {' / '.join(f'{s:.0%}' for s in SHARES)} of 1,200 rows"
          + (f", {args.pool} read at a time" if args.pool else ""))
    for spread in args.spreads:
        for policy in args.policies:
            runs = []
            for name, patches in (("line", (line_only, none_censored)), ("among", (none_censored,)), ("censored", ())):
                if name not in args.forms or (name == "censored" and policy != "shortest-first"):
                    continue
                restores = [patch() for patch in patches]
                runs.append((name, errors(policy, spread, args.seeds, args.pool)))
                for restore in restores:
                    restore()
            for name, e in runs:
                worst = [e[int(np.abs(e[:, j]).argmax()), j] for j in range(len(SHARES))]
                print(f"spread {spread:<4} {policy:<14} {name:<8}  mean {' '.join(f'{v:+4.0f}' for v in e.mean(0))}"
                      f"   |mean| {' '.join(f'{v:4.1f}' for v in np.abs(e).mean(0))}"
                      f"   worst {' '.join(f'{v:+4.0f}' for v in worst)}", flush=True)


if __name__ == "__main__":
    main()
