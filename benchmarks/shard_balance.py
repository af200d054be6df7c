"""How long a sharded job takes: the split by whole files (OUTs begun before stop 42) against equal row ranges.

Shards run on separate machines at once, so a job ends with its slowest shard. This runs each shard of the
input in turn, in one process on the echo engine at a fixed cost per step (``--step-ms``, a GPU's step barely
grows with the batch), and times it: the job's makespan is the slowest shard's time. The input by default is
../shared/data (GSM8K 1319 rows, MT-bench 80, Vicuna 80: three files of very unequal size). Both rules run
side by side in this one process.

    python benchmarks/shard_balance.py                    # ../shared/data, 2 and 3 shards, 10 ms a step
    python benchmarks/shard_balance.py --input DIR --shards 4 8 --step-ms 20
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

from overnight.pipeline.api import run_job
from overnight.pipeline.configio import resolve
from overnight.pipeline.input.shards import FRAGMENTS, ROWS
import overnight.pipeline.job as job

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def config(inp: str, out: Path, args, **extra):
    return resolve({"input": {"path": inp, **extra.pop("input", {})}, "output": {"path": str(out)},
                    "engine": {"kind": "echo", "echo_step_ms": args.step_ms, "max_num_seqs": args.seqs},
                    "sampling": {"max_tokens": 64}, **extra})


def run_shards(inp: str, out: Path, n: int, rule: str, args) -> list[tuple[int, float]]:
    """(rows, seconds) of each shard of n, run one after another under ``rule``."""
    job.recorded_split = lambda url, shard, fresh: rule  # the rule a new OUT would record
    times = []
    for k in range(n):
        cfg = config(inp, out, args, cluster={"shard": f"{k}/{n}"})
        t0 = time.monotonic()
        s = run_job(cfg, is_tty=False)
        times.append((s.num_rows, time.monotonic() - t0))
        assert s.state == "completed", s.state
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", default=str(DATA))
    p.add_argument("--shards", type=int, nargs="+", default=[2, 3])
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=10.0)
    args = p.parse_args()
    logging.getLogger("overnight").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:  # the first job in a process loads the tokenizer: not timed
        run_job(config(args.input, Path(tmp) / "out", args, input={"limit": 10}), is_tty=False)
    print(f"input {args.input}; echo engine, {args.step_ms:g} ms a step, {args.seqs} sequences, max_tokens 64")
    for n in args.shards:
        made = {}
        for rule in (FRAGMENTS, ROWS):
            with tempfile.TemporaryDirectory() as tmp:
                made[rule] = run_shards(args.input, Path(tmp) / "out", n, rule, args)
            shards = ", ".join(f"{r} rows {t:.1f} s" for r, t in made[rule])
            print(f"  {n} shards, {rule:9}: {shards}; makespan {max(t for _, t in made[rule]):.1f} s")
        old, new = (max(t for _, t in made[r]) for r in (FRAGMENTS, ROWS))
        print(f"  {n} shards: makespan by files / by equal ranges = {old / new:.2f}x")


if __name__ == "__main__":
    main()
