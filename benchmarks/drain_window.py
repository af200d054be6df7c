"""The rows a deadline leaves undone, where admission stops a margin before it and the rows in flight drain to it.

The real Scheduler and DeadlineTracker on tests/test_forecast.py's simulated engine (fifo, 600 rows, this CPU's
step cost and a GPU's), with the deadline at 1.02, 0.98 and 0.90 of the full run's makespan and the stop 10% of
the makespan before it. Side by side in one run: the forecast as it was before stop 48 (the rows done by the stop;
the tracker's ``drains`` off: what --on-deadline abort gets) and as it is (the rows started by the stop that end
by the deadline). Prints, per cost, deadline and seed: the rows actually left, the rows the last forecast before
the stop expected left, and how many of the forecasts past half the makespan warned of a miss.

    python benchmarks/drain_window.py
"""

from __future__ import annotations

import logging
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import test_forecast as tf  # noqa: E402
from overnight.pipeline.scheduling import deadline as dl  # noqa: E402


def run(drains: bool) -> dict:
    init = dl.DeadlineTracker.__init__

    def with_drains(self, *a, **k):
        init(self, *a, **k)
        self.drains = drains

    dl.DeadlineTracker.__init__ = with_drains
    try:
        out = {}
        for name, cost in (("CPU", tf.CPU), ("GPU", tf.GPU)):
            full = tf.simulate("fifo", cost)
            for share in (1.02, 0.98, 0.9):
                for seed in (3, 4, 5):
                    st = tf.simulate("fifo", cost, deadline_share=share, makespan=full.end, margin=0.1 * full.end,
                                     seed=seed)
                    stop = (share - 0.1) * full.end
                    f = [s for s in st.samples if s[0] <= stop][-1][2]
                    late = [f for t, _, f in st.samples if 0.5 * full.end < t <= stop]
                    out[(name, share, seed)] = (st.n - st.done, f.rows_expected_left if f.will_miss else 0,
                                                sum(x.will_miss for x in late), len(late))
        return out
    finally:
        dl.DeadlineTracker.__init__ = init


def main() -> None:
    logging.getLogger("overnight").setLevel(logging.ERROR)
    before, after = run(False), run(True)
    print("| cost | deadline | seed | rows left | expected left at the stop: before / after "
          "| forecasts past half the makespan that warned: before / after |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k in before:
        print(f"| {k[0]} | {k[1]:.2f} x makespan | {k[2]} | {before[k][0]} | {before[k][1]} / {after[k][1]} | "
              f"{before[k][2]} / {after[k][2]} of {before[k][3]} |")


if __name__ == "__main__":
    main()
