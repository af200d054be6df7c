"""Every engine step the deadline forecast sees, through a whole `overnight run`, and what they say of a step's cost.

Runs `overnight run ARGS...` in this process with the deadline tracker's after_step wrapped, so each step is
logged as (seconds since the first step, sequences, prompt tokens emulated as prefilled, the loop's cycle in
seconds, probe done, rows finished, context tokens of the running rows). It prints the median decode step by
size in the engine's first SETTLE_S seconds, in the probe after them, and in the drain at the end (the last
--drain-share of the run), and a line (fixed + per sequence) through the drain's: the step cost the forecast
should have learned. The log is written as JSON to --log.

    python benchmarks/step_log.py --log steps.json -- -v run prompts.parquet --out OUT --policy auto
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def fit(by_size: dict[int, list[float]]) -> tuple[float, float]:
    """A line through each size's median, weighted by its steps (the forecast's StepCost does the same)."""
    pts = [(n, statistics.median(v), len(v)) for n, v in by_size.items() if len(v) >= 3]
    w = sum(c for _, _, c in pts)
    mn = sum(n * c for n, _, c in pts) / w
    mt = sum(t * c for _, t, c in pts) / w
    b = sum(c * (n - mn) * (t - mt) for n, t, c in pts) / sum(c * (n - mn) ** 2 for n, _, c in pts)
    return mt - b * mn, b


def table(rec, lo: float, hi: float) -> dict[int, list[float]]:
    by: dict[int, list[float]] = {}
    for t, n, prefill, s, _, _, _ in rec:
        if s is not None and not prefill and lo <= t < hi:
            by.setdefault(n, []).append(s)
    return by


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", required=True)
    ap.add_argument("--drain-share", type=float, default=0.2)
    ap.add_argument("args", nargs=argparse.REMAINDER, help="after --: the overnight command line")
    args = ap.parse_args()

    from overnight.pipeline.scheduling import deadline as dl

    rec = []
    after_step = dl.DeadlineTracker.after_step

    def logged(self, seconds, finished_ids):
        inf = self.inflight
        ctx = sum(inf.info[r][1] + inf.step - s for r, s in inf.start.items())
        rec.append([time.time(), self._step_n, self._step_prefill, seconds, self.probe_done, len(finished_ids), ctx])
        return after_step(self, seconds, finished_ids)

    dl.DeadlineTracker.after_step = logged
    from overnight.jobs.cli import cli

    try:
        cli([a for a in args.args if a != "--"], prog_name="overnight")
    except SystemExit:
        pass
    finally:
        if rec:
            t0 = rec[0][0]
            for r in rec:
                r[0] -= t0
        json.dump(rec, open(args.log, "w"))
    if not rec:
        return
    end = rec[-1][0]
    probe_end = next((r[0] for r in rec if r[4]), end)

    def show(label, by):
        print(f"{label:28s}" + "  ".join(f"{n}: {1000 * statistics.median(v):.0f} ms ({len(v)})"
                                         for n, v in sorted(by.items()) if len(v) >= 3))

    show(f"first {dl.SETTLE_S:.0f} s", table(rec, 0, dl.SETTLE_S))
    show("probe after them", table(rec, dl.SETTLE_S, probe_end))
    drain = table(rec, (1 - args.drain_share) * end, end + 1)
    show(f"drain (last {args.drain_share:.0%})", drain)
    if len([v for v in drain.values() if len(v) >= 3]) >= 2:
        a, b = fit(drain)
        print(f"the drain's own step cost: {a:.4f} s + {1000 * b:.2f} ms a sequence")


if __name__ == "__main__":
    sys.exit(main())
