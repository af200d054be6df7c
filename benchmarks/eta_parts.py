"""Where does the ETA's error come from? One `overnight run`, every engine step and every model forecast's drain.

Runs `overnight run ARGS...` in this process with the deadline tracker's after_step and the forecast wrapped
(as benchmarks/step_log.py does), and at the first forecast with 10%, 25% and 50% of rows done prints:

- the ETA as shown (the forecast's, and the FINISH_S the progress line adds) against the time that actually remained
  until the command returned (it runs in a child process: the engine's exit and the interpreter's count), as
  (ETA - actual) / actual;
- its parts against what came: the tokens (the forecast's tokens to come over the sequences summed over the steps
  that followed), the steps (the drain's, and its tail's, over the steps that followed), and the step cost (the
  forecast's fixed and per-sequence parts applied to the steps that followed, over their measured seconds);
- the steps of an oracle drain: every row's actual length laid over the same slots, the rows running at their
  actual tokens left and the rows to start in the order they did start (OUT's rows), over the steps that came:
  what the drain's layout itself misses, whatever the lengths;
- the seconds from the last step to the process's end.

With --log it writes the steps in benchmarks/step_log.py's format, for benchmarks/step_cost_replay.py.

    python benchmarks/eta_parts.py [--log steps.json] [--keep run.json] -- -v run prompts.parquet --out OUT \
        --policy longest-first
    python benchmarks/eta_parts.py --again run.json
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


def oracle(out: str, steps: list):
    """oracle(i): the steps a drain of every row's actual length takes after step i (forecast.drain, greedy over
    the engine's slots), the rows running then at what they had left and those to start in the order they did;
    None without OUT's rows."""
    import glob

    import duckdb
    import numpy as np

    from overnight.pipeline.scheduling.forecast import drain

    if not out or not glob.glob(f"{out}/**/parts/*.parquet", recursive=True):
        return None
    rows = np.array(duckdb.sql(f"select epoch(first_token_at), epoch(finished_at), output_tokens from read_parquet("
                              f"'{out}/**/parts/*.parquet') where output_tokens > 0").fetchall(), dtype=np.float64)
    at = np.array([r[0] for r in steps])
    first = np.searchsorted(at, rows[:, 0] - 0.01)  # the step that gave each row its first token
    slots = max(r[1] for r in steps)

    def at_step(i: int) -> float:
        running = (first < i) & (rows[:, 1] > at[i - 1] + 0.01)
        left = rows[running, 2] - np.minimum(i - first[running], rows[running, 2] - 1)
        later = np.flatnonzero(first >= i)
        later = later[np.argsort(first[later], kind="stable")]
        return drain(slots, left, rows[later, 2], np.ones(len(later))).steps
    return at_step


def report(steps: list, forecasts: list, t_end: float, total: int, out: str = None) -> None:
    from overnight.pipeline.clockwork import FINISH_S

    steps_of = oracle(out, steps)

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
              + ("" if steps_of is None else f"oracle drain x{steps_of(f['step']) / len(rest):.2f}; ") +
              f"{t_end - rest[-1][0]:.1f} s from the last step to the end")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", help="write the steps here (benchmarks/step_log.py's format)")
    ap.add_argument("--keep", help="keep the run's steps and forecasts here (JSON), for --again")
    ap.add_argument("--again", help="report a kept run again (its --keep file) instead of running one")
    ap.add_argument("--dump", help=argparse.SUPPRESS)  # the child's: where it writes its steps and forecasts
    ap.add_argument("args", nargs=argparse.REMAINDER, help="after --: the overnight command line")
    args = ap.parse_args()
    if args.dump:
        return child(args.dump, [a for a in args.args if a != "--"])
    if args.again:
        d = json.load(open(args.again))
    else:
        # the run in a child process, so that the time actually left ends where a user's command returns: after
        # the engine's processes and the interpreter exit
        with tempfile.TemporaryDirectory() as tmp:
            dump = os.path.join(tmp, "dump.json")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--dump", dump, "--", *args.args])
            t_end = time.time()
            if not os.path.exists(dump):
                sys.exit("the run wrote no steps")
            d = json.load(open(dump))
        d["t_end"] = t_end
        d["out"] = next((a for k, a in zip(args.args, args.args[1:]) if k == "--out"), None)
        if args.keep:
            json.dump(d, open(args.keep, "w"))
    steps = d["steps"]
    report(steps, d["forecasts"], d["t_end"], sum(r[4] for r in steps), d["out"])
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
