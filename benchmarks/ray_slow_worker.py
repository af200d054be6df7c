"""Two Ray workers, one six times slower than the other (the echo engine's step, 60 ms against 10 ms): which rows
each takes, and when the job's last row ends, with the workers preparing four batches ahead (before stop 48) and
one (now), side by side in one run on a local cluster.

A unit smaller than a batch is a batch, so a worker's input thread held as many units ahead as batches, beside the
rows its engine ran and the scheduler's refill, and the slow worker kept them while the fast one ran dry.

    python benchmarks/ray_slow_worker.py [--rows 600] [--repeats 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=600)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    import duckdb
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray

    from fakes import write_tiny_model
    from overnight.pipeline.cluster import ray_job, units
    from overnight.pipeline.cluster.actors import Worker
    from overnight.pipeline.configio import resolve

    def slow_second(depth: int):
        class SlowSecond(Worker):  # (a local class: Ray pickles it, and depth, to the worker processes)
            def __init__(self, cfg, index, *a, **k):
                units.UnitSource.prefetch_depth = depth   # in the worker's process, which reads the units
                if index == 1:
                    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, echo_step_ms=60.0))
                super().__init__(cfg, index, *a, **k)
        return SlowSecond
    root = Path(tempfile.mkdtemp(prefix="ray-slow-"))
    inp = root / "in"
    inp.mkdir()
    n = args.rows
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(n)], "prompt": [f"question {i}" for i in range(n)]}),
                   inp / "a.parquet", row_group_size=max(1, n // 8))
    model = write_tiny_model(root / "tiny")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    print("| prefetch (batches) | repeat | w0 rows | w1 rows (the slow one) | first row queued to last finished |")
    print("| --- | --- | --- | --- | --- |")
    for rep in range(args.repeats):
        for depth in (4, 1):
            ray_job.Worker = slow_second(depth)
            out = root / f"out-{depth}-{rep}"
            shutil.rmtree(out, ignore_errors=True)
            cfg = resolve({"input": {"path": str(inp)}, "output": {"path": str(out), "flush_rows": 16},
                           "engine": {"model": model, "kind": "echo", "echo_step_ms": 10, "max_num_seqs": 8},
                           "sampling": {"max_tokens": 16}})
            s = ray_job.run_on_ray(cfg, False, 2, is_tty=False)
            assert s.state == "completed", s.message
            got = dict(duckdb.sql(
                f"select regexp_extract(filename, 'w[0-9]+'), count(*) from read_parquet('{out}/workers/*/parts/"
                f"*.parquet', filename=true) group by 1").fetchall())
            span = duckdb.sql(f"select epoch(max(finished_at)) - epoch(min(queued_at)) from read_parquet("
                              f"'{out}/workers/*/parts/*.parquet')").fetchall()[0][0]
            print(f"| {depth} | {rep} | {got.get('w00000', 0)} | {got.get('w00001', 0)} | {span:.1f} s |", flush=True)
    ray.shutdown()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    t = time.time()
    main()
    print(f"({time.time() - t:.0f} s)")
