"""The early warning on an engine whose step cost does not grow with the batch, as a GPU's barely does.

The echo engine (`--engine echo --echo-step-ms 20`) takes 20 ms a step whatever it holds: the fixed cost of a
GPU step, without a GPU. One run without a deadline measures the job's wall time W; then the same job runs with
`--time-budget` at each --shares of W. For each it prints whether the deadline was said to be at risk, at what
share of rows, the rows the warning expected to be left undone, and the rows that were.

A budget above W must not be warned of (the start-up probe's fit of one size once costed a full engine's steps
2.5 times too long, and warned of about 914 of 2962 rows for a job that completed in half its budget); one
below W must be warned of early, with a count near the rows left.

    python benchmarks/warning_fixed_step.py                      # 3000 rows, 64 sequences, budgets 1.3 and 0.6 W
    python benchmarks/warning_fixed_step.py --rows 6000 --shares 1.1 0.8 0.5
    python benchmarks/warning_fixed_step.py --predictor heuristic    # no refit of the predictions during the run
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def write_input(path: Path, rows: int) -> None:
    prompts = [f"Write a short note about {' '.join(WORDS[:(i * 7) % len(WORDS) + 1])} item {i}" for i in range(rows)]
    pq.write_table(pa.table({"id": list(range(rows)), "prompt": prompts}), path)


def run(inp: Path, out: Path, args, budget: float | None) -> dict:
    cmd = [str(Path(sys.executable).parent / "overnight"), "--log-format", "json", "run", str(inp), "--out", str(out),
           "--fresh", "--engine", "echo", "--echo-step-ms", str(args.step_ms), "--max-tokens", "64",
           "--max-num-seqs", str(args.seqs), "--log-every", "0.5", "--predictor", args.predictor, "--json"]
    if budget is not None:
        cmd += ["--time-budget", f"{budget:.1f}s"]
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - t0
    summary = json.loads(done.stdout)
    lines = [json.loads(ln) for ln in done.stderr.splitlines() if ln.startswith("{")]
    rows_done, warning, revisions = 0, None, []
    for ln in lines:
        if "counters" in ln:
            rows_done = ln["counters"].get("rows_done", rows_done)
        m = re.search(r"deadline at risk: .*expect about (\d+) of (\d+) remaining rows", ln["message"])
        if m and warning is None:
            warning = (rows_done, int(m.group(1)))
        m = re.search(r"deadline at risk: now expecting about (\d+) of (\d+) remaining rows", ln["message"])
        if m:  # a revision of the count
            revisions.append((rows_done, int(m.group(1))))
    return {"wall": wall, "summary": summary, "warning": warning, "revisions": revisions}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=3000)
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--shares", type=float, nargs="+", default=[1.3, 0.6])
    p.add_argument("--predictor", default="online",
                   help="online (the default's: the heuristic until 256 rows have finished, then refitted), or "
                        "heuristic (never learns: the order the first warning sees is the order to the end)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        inp = Path(tmp) / "in.parquet"
        write_input(inp, args.rows)
        base = run(inp, Path(tmp) / "out", args, None)
        w = base["wall"]
        print(f"{args.rows} rows, {args.seqs} sequences, {args.step_ms:g} ms a step whatever its size, "
              f"--predictor {args.predictor}: "
              f"W = {w:.1f} s without a deadline ({base['summary']['state']})")
        for share in args.shares:
            r = run(inp, Path(tmp) / "out", args, share * w)
            s = r["summary"]
            left = s["num_rows"] - s["num_done"]
            said = ("no warning" if r["warning"] is None else
                    f"warned at {100 * r['warning'][0] / args.rows:.1f}% of rows, expecting {r['warning'][1]} left")
            said += "".join(f"; revised at {100 * done / args.rows:.1f}%: {n}" for done, n in r["revisions"])
            print(f"  budget {share:.2f} W ({share * w:.1f} s): {s['state']}, {left} rows left; {said}")


if __name__ == "__main__":
    main()
