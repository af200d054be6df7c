"""How many engine steps did the forecast expect to come, and how many came? From one run's debug log and step log.

The model forecast (pipeline/scheduling/estimate.py) costs what is left as a drain: each slot's expected load
(the expected lengths laid out over the engine's slots), plus a tail (the expected maximum over the slots of
each one's last row's end, from the length model's spread, minus the drain's steps). Its debug line ("forecast:
step ...; N steps + M tail, ...") gives both every few seconds. This lines them up with the steps that actually
ran after each one, from the step log of the same run (benchmarks/step_log.py). The two clocks are aligned on
the progress lines ("K/N rows"): the wall time of each against the step log's time when K rows had finished.

    python benchmarks/step_log.py --log steps.json -- -v run prompts.parquet --out OUT --policy longest-first \\
        2> run.log
    python benchmarks/drain_steps.py run.log steps.json [--points 16]

Prints, at about --points moments, rows done, the drain's and the tail's steps, the steps that came, and the
error of the drain alone and of the drain with the tail.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics

FORECAST = re.compile(r"forecast: step .*?; (\d+) steps \+ (\d+) tail")
PROGRESS = re.compile(r" INFO (\d+)/(\d+) rows")


def wall(line: str) -> float:
    return datetime.datetime.fromisoformat(line[:19]).timestamp()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("log", help="the run's stderr, with -v (the forecast's debug lines)")
    ap.add_argument("steps", help="the step log benchmarks/step_log.py wrote for the same run")
    ap.add_argument("--points", type=int, default=16)
    args = ap.parse_args()

    steps = json.load(open(args.steps))  # [seconds since the first step, sequences, ..., rows finished, ...]
    times = [s[0] for s in steps]
    done_at, finished = [], 0
    for s in steps:
        finished += s[5]
        done_at.append(finished)
    lines = open(args.log).read().splitlines()
    offsets = []
    for line in lines:
        m = PROGRESS.search(line)
        if m and 0 < int(m.group(1)) <= finished:
            k = next(i for i, d in enumerate(done_at) if d >= int(m.group(1)))
            offsets.append(wall(line) - times[k])
    if not offsets:
        raise SystemExit(f"{args.log} has no progress line ('K/N rows') to align the two clocks on")
    offset = statistics.median(offsets)
    forecasts = [(wall(line) - offset, int(m.group(1)), int(m.group(2)))
                 for line in lines for m in [FORECAST.search(line)] if m]
    if not forecasts:
        raise SystemExit(f"{args.log} has no forecast debug line: run with -v")
    print(f"clocks aligned on {len(offsets)} progress lines (spread {max(offsets) - min(offsets):.1f} s); "
          f"{len(steps)} steps, {finished} rows")
    print("rows done | drain steps | tail steps | steps that came | drain alone | drain + tail")
    for t, main_steps, tail in forecasts[::max(1, len(forecasts) // args.points)]:
        came = sum(1 for x in times if x > t)
        if came < 20:
            continue
        rows = next((done_at[i - 1] for i, x in enumerate(times) if x > t), finished) if times[0] <= t else 0
        print(f"{rows:9d} | {main_steps:11d} | {tail:10d} | {came:15d} | {(main_steps - came) / came:+11.0%} | "
              f"{(main_steps + tail - came) / came:+12.0%}")


if __name__ == "__main__":
    main()
