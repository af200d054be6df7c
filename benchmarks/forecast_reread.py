"""The ETA's error read again from finished benchmarks/forecast.py runs, at any share of their rows, with the parts.

For each run folder OUT (a `full-POLICY` folder of forecast.py, its `OUT.run.json` beside it), at each --shares
point (the first timeline sample with that share of the run's rows done, as forecast.py takes them):

- the ETA against the time that remained until the command returned, and the forecast's tokens to come against
  the tokens that came (forecast.py's step clock);
- where the run was --verbose with the forecast's split (since d5a8ba6), the forecast line at that moment split
  into the rows running, queued in the engine and still to start, each against what those rows generated after it;
- with --steps, the engine's step time over each 20 s of the run (the step clock's, at the rows running then).

    python benchmarks/forecast_reread.py /tmp/mixD/full-auto /tmp/mixD/full-fifo --shares 0.1 0.25 0.5 --steps
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from length_replay import load, step_clock  # noqa: E402

LINE = re.compile(r"^(\S+) overnight DEBUG forecast: .*?, (\d+) tokens \(running (\d+), queued (\d+), to start (\d+)\)")


def forecast_lines(out: str) -> list[tuple[float, tuple[float, ...]]]:
    """(epoch seconds, (tokens, running, queued, to start)) of each forecast's debug line with the split."""
    err = json.load(open(out + ".run.json"))["stderr"]
    found = []
    for line in err.splitlines():
        m = LINE.match(line)
        if m:
            at = datetime.datetime.fromisoformat(m.group(1)).replace(tzinfo=datetime.timezone.utc).timestamp()
            found.append((at, tuple(float(x) for x in m.groups()[1:])))
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--shares", nargs="+", type=float, default=[0.10, 0.25, 0.50])
    ap.add_argument("--steps", action="store_true", help="the step time over each 20 s of the run")
    args = ap.parse_args()
    for out in args.runs:
        out = out.rstrip("/")
        missing = [f for f in (out + ".run.json", os.path.join(out, "timeline.json")) if not os.path.exists(f)]
        if missing:
            sys.exit(f"{out}: not a finished benchmarks/forecast.py run ({', '.join(missing)} missing); pass a "
                     f"full-POLICY folder of forecast.py's --out, its .run.json beside it")
        end = json.load(open(out + ".run.json"))["t1"]
        d = load(out)
        clock = step_clock(d)
        timeline = json.load(open(os.path.join(out, "timeline.json")))
        lines = forecast_lines(out)
        total = len(d["a"])
        print(f"{out}: {total} rows")
        for share in args.shares:
            s = next((s for s in timeline if s["rows_done"] >= share * total and s.get("eta_s") is not None), None)
            if s is None:
                print(f"  {share:.0%}: no forecast")
                continue
            t = s["t"]
            left = d["e"] > t
            run = left & (d["f"] <= t)
            queued = left & (d["q"] <= t) & (d["f"] > t)
            pool = left & (d["q"] > t)
            gen = np.floor(np.clip(clock(np.full(int(run.sum()), t)) - clock(d["f"][run]), 0, d["a"][run] - 1))
            parts = (float(d["a"][run].sum() - gen.sum()), float(d["a"][queued].sum()), float(d["a"][pool].sum()))
            actual = end - t
            cell = f"  {share:.0%} ({s['rows_done']} rows): ETA {s['eta_s']:.0f} s, actual {actual:.0f} s, " \
                   f"{(s['eta_s'] - actual) / actual:+.0%}"
            if s.get("remaining_tokens") is not None:
                cell += f"; tokens x{s['remaining_tokens'] / max(1.0, sum(parts)):.2f}"
            before = [v for at, v in lines if at <= t + 0.5]  # the debug line's time is to the second
            if before:
                v = before[-1]
                cell += "; running x{:.2f} ({} rows), queued x{:.2f} ({}), to start x{:.2f} ({})".format(
                    v[1] / max(1.0, parts[0]), int(run.sum()), v[2] / max(1.0, parts[1]), int(queued.sum()),
                    v[3] / max(1.0, parts[2]), int(pool.sum()))
            print(cell)
        if args.steps:
            t0 = d["f"].min()
            cells = []
            for a in np.arange(t0, d["e"].max(), 20.0):
                steps = float(clock(np.array([a + 20.0]))[0] - clock(np.array([a]))[0])
                running = int(((d["f"] <= a + 10) & (d["e"] > a + 10)).sum())
                if steps > 0:
                    cells.append(f"{20.0 / steps * 1000:.0f}ms/{running}")
            print("  step time per 20 s (ms / rows running):", " ".join(cells))


if __name__ == "__main__":
    main()
