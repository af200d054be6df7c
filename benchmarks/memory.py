"""Memory stays flat as the input grows: peak RSS of the reading stage at 10k, 100k, 1M and 5M rows.

Builds Parquet inputs of real prompts (examples/prompts.parquet repeated with
unique ids), then, in a fresh process per size, streams every row through the
source and the per-row validation (parse_batch) and reports the peak RSS.
A second column is the peak RSS of opening the job and reading --limit 1000
rows, which is what a `--limit` run pays before the engine.

    python benchmarks/memory.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, resource, sys
from overnight.pipeline.config import InputConfig, SamplingConfig
from overnight.pipeline.input.source import ParquetSource
from overnight.pipeline.input.validate import parse_batch, sampling_defaults
path, limit = sys.argv[1], (int(sys.argv[2]) if sys.argv[2] != "none" else None)
cfg = InputConfig(path=path, limit=limit)
src = ParquetSource(cfg)
defaults = sampling_defaults(SamplingConfig())
rows = 0
for sb in src.batches():
    parsed, errors = parse_batch(sb, cfg, defaults, src.passthrough_columns())
    rows += len(parsed) + len(errors)
print(json.dumps({"rows": rows, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def build(path: str, n: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    base = pq.read_table(os.path.join(REPO, "examples", "prompts.parquet"))
    reps = -(-n // base.num_rows)
    chunk = pa.concat_tables([base] * min(reps, 500))
    with pq.ParquetWriter(path, base.schema) as w:
        for start in range(0, n, chunk.num_rows):
            t = chunk.slice(0, min(chunk.num_rows, n - start))
            t = t.set_column(0, "id", pa.array([f"row-{start + i:08d}" for i in range(t.num_rows)]))
            w.write_table(t, row_group_size=50_000)


def measure(path: str, limit) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, path, str(limit)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    tmp = tempfile.mkdtemp(prefix="overnight-mem-")
    print(f"{'input rows':>10s} {'file MB':>8s} {'read all: peak RSS MB':>22s} {'--limit 1000: peak RSS MB':>26s}")
    for n in (10_000, 100_000, 1_000_000, 5_000_000):
        path = os.path.join(tmp, f"in-{n}.parquet")
        build(path, n)
        full = measure(path, "none")
        limited = measure(path, 1000)
        assert full["rows"] == n and limited["rows"] == 1000
        print(f"{n:>10d} {os.path.getsize(path) / 2**20:>8.1f} {full['peak_rss_mb']:>22.0f} "
              f"{limited['peak_rss_mb']:>26.0f}", flush=True)


if __name__ == "__main__":
    main()
