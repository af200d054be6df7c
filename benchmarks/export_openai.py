"""`overnight export OUT --format openai`: ok rows' lines built by DuckDB (openai_lines.ok_line_sql) against every
line built by Python's json (as before), side by side in one process, each repeat interleaved. The two files
must hold the same lines but for their random ids.

    python benchmarks/scale.py --rows 1000000 --dir /tmp/scale-1m --keep       # an OUT of 1M rows (echo engine)
    python benchmarks/export_openai.py /tmp/scale-1m/out --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import overnight.pipeline.tools.export as ex


def timed(out: str, path: str, python_only: bool) -> float:
    real = ex.one_sample
    if python_only:
        ex.one_sample = lambda con, index: False
    try:
        t = time.perf_counter()
        ex.export(out, "openai", path)
        return time.perf_counter() - t
    finally:
        ex.one_sample = real


def without_ids(line: str) -> dict:
    x = json.loads(line)
    x["id"] = None
    if x.get("response"):
        x["response"]["request_id"] = None
        x["response"]["body"].pop("id", None)
    return x


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="a job's OUT folder")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    times = {"python": [], "duckdb": []}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {k: os.path.join(tmp, f"{k}.jsonl") for k in times}
        for _ in range(args.repeats):
            times["python"].append(timed(args.out, paths["python"], True))
            times["duckdb"].append(timed(args.out, paths["duckdb"], False))
        with open(paths["python"], encoding="utf-8") as a, open(paths["duckdb"], encoding="utf-8") as b:
            lines = same = 0
            for x, y in zip(a, b):
                lines += 1
                same += without_ids(x) == without_ids(y)
    p, d = statistics.median(times["python"]), statistics.median(times["duckdb"])
    print(f"{lines} lines; the same but for ids: {same == lines} ({same})")
    print(f"python: {p:.2f} s {[round(t, 2) for t in times['python']]}; duckdb: {d:.2f} s "
          f"{[round(t, 2) for t in times['duckdb']]}; {p / d:.2f}x")


if __name__ == "__main__":
    main()
