"""The ETA's error on an engine whose step cost does not grow with the batch, on a job larger than the pool.

The echo engine (`--engine echo --echo-step-ms 5`) takes 5 ms a step whatever it holds, as a GPU's step barely
grows. The job (benchmarks/warning_fixed_step.py's prompts) is larger than the scheduler's pool of
`scheduler.lookahead_rows` (10k) rows, so the input stage holds prepared rows that are in neither the pool nor
the unread rows. Each run is a fresh `overnight run` with no deadline; from OUT/timeline.json, at the first
sample with 10%, 25% and 50% of the rows done, the ETA against the time that actually remained until the command
returned, as (ETA - actual) / actual; and beside it, the tokens still to come that the last forecast by then
counted, over those that came (the length models' part of the error; the rest is the rate's and the drain's),
and the command's wall time.

--against TREE runs each repeat a second time with TREE (a folder holding an `overnight` package) first on
PYTHONPATH, one after the other, so that the two sides see the same machine.

    python benchmarks/eta_fixed_step.py                          # 20000 rows, 64 sequences, 5 ms, 3 repeats
    python benchmarks/eta_fixed_step.py --against /tmp/oldpkg    # and an older tree, side by side
    python benchmarks/eta_fixed_step.py --extra "--sample-every 0"   # no rows drawn at random
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from warning_fixed_step import write_input  # noqa: E402

POINTS = (0.10, 0.25, 0.50)


def run(inp: Path, out: Path, args, tree: str | None) -> list[float]:
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-c", "import sys; from overnight.jobs.entry import main; sys.argv[0] = 'overnight'; "
           "main()", "run", str(inp), "--out", str(out), "--fresh", "--engine", "echo", "--echo-step-ms",
           str(args.step_ms), "--max-tokens", "64", "--max-num-seqs", str(args.seqs), "--policy", args.policy,
           "--json"] + args.extra.split()
    start = time.time()
    subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    end = time.time()
    samples = json.loads((out / "timeline.json").read_text())
    rows = duckdb.sql(f"select epoch(first_token_at) a, epoch(finished_at) f, output_tokens n "
                      f"from read_parquet('{out}/parts/*.parquet')").fetchnumpy()
    errors = []
    for p in POINTS:
        s = next(x for x in samples if x["rows_done"] >= p * args.rows and x.get("eta_s") is not None)
        errors.append((s["eta_s"] - (end - s["t"])) / (end - s["t"]))
        # the tokens still to come at the last forecast by then, against those that came (a row running at the
        # time: the share of its tokens after it, its tokens taken as evenly spaced from its first to its end)
        f = next(x for x in reversed(samples) if x["t"] <= s["t"] and x.get("remaining_tokens") is not None)
        a, e, n = rows["a"], rows["f"], rows["n"]
        came = np.where(e <= f["t"], 0.0, np.where(a <= f["t"], n * (e - f["t"]) / np.maximum(e - a, 1e-9), n))
        errors.append(f["remaining_tokens"] / max(float(came.sum()), 1.0))
    return errors, end - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=5.0)
    p.add_argument("--policy", default="auto")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--extra", default="", help="more `overnight run` options, e.g. \"--sample-every 0\"")
    p.add_argument("--against", default=None, help="a folder with an older `overnight` package, run side by side")
    args = p.parse_args()
    sides = [("this tree", None)] + ([(f"--against {args.against}", args.against)] if args.against else [])
    print(f"{args.rows} rows, {args.seqs} sequences, {args.step_ms:g} ms a step, --policy {args.policy}: "
          f"ETA error at {' / '.join(f'{100 * p:.0f}%' for p in POINTS)} of rows")
    with tempfile.TemporaryDirectory() as tmp:
        inp = Path(tmp) / "in.parquet"
        write_input(inp, args.rows)
        for r in range(args.repeats):
            for name, tree in sides:
                e, wall = run(inp, Path(tmp) / "out", args, tree)
                print(f"  repeat {r}, {name}: {wall:.1f} s; " + " / ".join(f"{100 * x:+.0f}%" for x in e[::2]) +
                      "   (tokens left, forecast / actual: " + " / ".join(f"x{x:.2f}" for x in e[1::2]) + ")",
                      flush=True)


if __name__ == "__main__":
    main()
