"""Scaling over Ray workers: rows/s with 1, 2 and 4 workers, side by side in one run.

The echo engine with a fixed GPU-like step time (--step-ms, default 20 ms) stands in for vLLM, so that the
engine and not Python is the bottleneck, as on a GPU. Each configuration runs `overnight run ... --workers W`
as a user would, into a fresh OUT, on its own local Ray cluster. Reported per W:

- wall: the command's whole time (Ray start, actor start, the job);
- steady rows/s: rows over the span from the first row queued to the last finished (from the parts), so the
  fixed start-up cost is left out;
- efficiency: steady rows/s against W x the one-worker figure (target >= 0.9).

    python benchmarks/ray_scaling.py --rows 12000 --workers 1 2 4
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def make_input(folder: Path, rows: int, files: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    per = rows // files
    for f in range(files):
        t = pa.table({"id": [f"f{f}-{i}" for i in range(per)],
                      "prompt": [f"Answer question {i} of file {f} in one short sentence." for i in range(per)]})
        pq.write_table(t, folder / f"part-{f:03d}.parquet", row_group_size=500)


def run(inp: Path, out: Path, workers: int, args) -> dict:
    import duckdb

    cmd = [str(Path(sys.executable).parent / "overnight"), "run", str(inp), "--out", str(out), "--workers",
           str(workers), "--engine", "echo", "--echo-step-ms", str(args.step_ms), "--max-tokens",
           str(args.max_tokens), "--max-num-seqs", str(args.max_num_seqs), "--flush-rows", "2000"]
    t0 = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    if done.returncode != 0:
        raise SystemExit(f"W={workers} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    n, span = duckdb.sql(f"select count(*), epoch(max(finished_at) - min(queued_at)) "
                         f"from read_parquet('{out}/workers/*/parts/*.parquet')").fetchall()[0]
    per_worker = duckdb.sql(f"select regexp_extract(filename, 'w[0-9]+') w, count(*) from "
                            f"read_parquet('{out}/workers/*/parts/*.parquet', filename=true) group by 1 order by 1"
                            ).fetchall()
    return {"workers": workers, "rows": n, "wall_s": wall, "span_s": span, "steady": n / span,
            "per_worker": [c for _, c in per_worker]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=12000)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        inp = Path(tmp) / "in"
        make_input(inp, args.rows, args.files)
        results = [run(inp, Path(tmp) / f"out-{w}", w, args) for w in args.workers]
    base = next((r["steady"] for r in results if r["workers"] == 1), None)
    print(f"{args.rows} rows, echo engine {args.step_ms:g} ms/step, max_tokens {args.max_tokens}, "
          f"max_num_seqs {args.max_num_seqs}, {os.cpu_count()} cores")
    print(f"{'W':>3} {'wall s':>8} {'span s':>8} {'rows/s wall':>12} {'rows/s steady':>14} {'efficiency':>11}  "
          f"rows per worker")
    for r in results:
        eff = r["steady"] / (r["workers"] * base) if base else float("nan")
        print(f"{r['workers']:>3} {r['wall_s']:>8.1f} {r['span_s']:>8.1f} {r['rows'] / r['wall_s']:>12.1f} "
              f"{r['steady']:>14.1f} {eff:>11.2f}  {r['per_worker']}")


if __name__ == "__main__":
    main()
