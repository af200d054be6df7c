"""Where does the ETA's error come from? One `overnight run`, every engine step and every model forecast's drain.

Runs `overnight run ARGS...` in this process with the deadline tracker's after_step and the forecast wrapped
(as benchmarks/step_log.py does), and at the first forecast with 10%, 25% and 50% of rows done prints:

- the ETA as shown (the forecast's, and the FINISH_S the progress line adds) against the time that actually remained
  until the command returned (it runs in a child process: the engine's exit and the interpreter's count), as (ETA - actual) / actual;
- its parts against what came: the tokens (the forecast's tokens to come over the sequences summed over the steps
  that followed), the steps (the drain's, and its tail's, over the steps that followed), and the step cost (the
  forecast's fixed and per-sequence parts applied to the steps that followed, over their measured seconds);
- the seconds from the last step to the process's end.

With --log it writes the steps in benchmarks/step_log.py's format, for benchmarks/step_cost_replay.py.

    python benchmarks/eta_parts.py [--log steps.json] -- -v run prompts.parquet --out OUT --policy longest-first
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import subprocess
import sys
import tempfile
import time

POINTS = (0.10, 0.25, 0.50)


def report(steps: list, forecasts: list, t_end: float, total: int) -> None:
    from overnight.pipeline.clockwork import FINISH_S

    finished, done = [], 0
    for r in steps:
        done += r[4]
        finished.append(done)
    for share in POINTS:
        f = next((f for f in forecasts if 0 < f["step"] <= len(steps) and finished[f["step"] - 1] >= share * total
                  and f["steps"] is not None), None)
        if f is None:
            continue
        rest = steps[f["step"]:]
        if not rest:
            continue
        actual = t_end - f["t"]
        seconds = sum(r[3] for r in rest if r[3] is not None)
        seqs = sum(r[1] for r in rest)
        costed = f["a"] * len(rest) + f["b"] * seqs + f["c"] * sum(r[2] for r in rest)
        print(f"{share:.0%}: ETA {f['eta'] + FINISH_S:.1f} s, actual {actual:.1f} s "
              f"({(f['eta'] + FINISH_S) / actual - 1:+.0%}); tokens x{f['tokens'] / max(seqs, 1):.2f}, "
              f"steps x{f['steps'] / len(rest):.2f} + tail x{f['tail'] / len(rest):.2f}, "
              f"step cost x{costed / seconds:.2f} ({1000 * f['a']:.1f} ms + {1000 * f['b']:.2f} ms a sequence); "
              f"{t_end - rest[-1][0]:.1f} s from the last step to the end")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", help="write the steps here (benchmarks/step_log.py's format)")
    ap.add_argument("--dump", help=argparse.SUPPRESS)  # the child's: where it writes its steps and forecasts
    ap.add_argument("args", nargs=argparse.REMAINDER, help="after --: the overnight command line")
    args = ap.parse_args()
    if args.dump:
        return child(args.dump, [a for a in args.args if a != "--"])
    # the run in a child process, so that the time actually left ends where a user's command returns: after the
    # engine's processes and the interpreter exit
    with tempfile.TemporaryDirectory() as tmp:
        dump = os.path.join(tmp, "dump.json")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--dump", dump, "--", *args.args])
        t_end = time.time()
        if not os.path.exists(dump):
            sys.exit("the run wrote no steps")
        d = json.load(open(dump))
    steps = d["steps"]
    report(steps, d["forecasts"], t_end, sum(r[4] for r in steps))
    if args.log:
        t0 = steps[0][0]
        json.dump([[r[0] - t0, r[1], r[2], r[3], False, r[4], r[5]] for r in steps], open(args.log, "w"))


def child(dump: str, argv: list[str]) -> None:
    """Runs `overnight ARGV` with the tracker's steps and the forecasts logged, written to ``dump`` at exit."""
    from overnight.pipeline.scheduling import deadline as dl
    from overnight.pipeline.scheduling import estimate as es

    steps, forecasts, drains = [], [], []
    after_step = dl.DeadlineTracker.after_step

    def logged(self, seconds, finished_ids):
        steps.append([time.time(), self._step_n, self._step_prefill, seconds, len(finished_ids),
                      self.inflight.context])
        return after_step(self, seconds, finished_ids)

    drain = es.drain

    def kept(*a, **k):  # the first drain of a forecast with the tail: its ETA's
        d = drain(*a, **k)
        if not drains and (k.get("tail") if "tail" in k else (a[5] if len(a) > 5 else None)) is not None:
            drains.append(d)
        return d

    model_forecast = dl.model_forecast

    def forecast(t, scheduler, *a, **k):
        drains.clear()
        f = model_forecast(t, scheduler, *a, **k)
        d = drains[0] if drains else None
        forecasts.append(dict(t=time.time(), step=len(steps), eta=f.eta_s, a=f.step_cost[0], b=f.step_cost[1],
                              c=f.step_cost[2], steps=d and d.steps, tail=d and d.tail_steps, tokens=d and d.tokens))
        return f

    dl.DeadlineTracker.after_step, es.drain, dl.model_forecast = logged, kept, forecast
    atexit.register(lambda: json.dump({"steps": steps, "forecasts": forecasts}, open(dump, "w")))
    from overnight.jobs import cli

    sys.argv = ["overnight", *argv]
    cli.main()


if __name__ == "__main__":
    main()
