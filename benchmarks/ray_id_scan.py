"""What the Ray driver's pass over the input's ids costs before any worker starts (pipeline/cluster/idscan.py):
every id read once (that column alone), duplicates found for the units to skip, and on a resume the worker
folders' ids matched against the input. Side by side in one run: a fresh job (no folder yet), and the same input
after a job whose folder holds every row (a resume), for string ids with and without duplicates; and OpenAI Batch
request lines (a tenth as many), whose every line is parsed for its custom_id.

    python benchmarks/ray_id_scan.py --rows 1000000
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import pyarrow as pa
import pyarrow.parquet as pq


def write_input(folder: str, rows: int, files: int, dup_every: int) -> None:
    os.makedirs(folder, exist_ok=True)
    per = rows // files
    for f in range(files):
        ids = [f"row-{(f * per + i) // dup_every if dup_every else f * per + i:09d}" for i in range(per)]
        pq.write_table(pa.table({"id": ids, "prompt": [f"q {i}" for i in range(per)]}),
                       os.path.join(folder, f"part-{f}.parquet"), row_group_size=100_000)


def folder_holding_every_row(src: str, out: str) -> None:
    """A worker folder whose one part holds every input id (as a finished Ray job leaves it)."""
    import duckdb

    parts = os.path.join(out, "workers", "w00000", "parts")
    os.makedirs(parts, exist_ok=True)
    rel = duckdb.sql(f"select distinct id, 'ok' as status, '0000000000000000' as prompt_hash, null::varchar as "
                     f"error, 1::integer as output_tokens from read_parquet('{src}/*.parquet')")
    t = getattr(rel, "to_arrow_table", None)() if hasattr(rel, "to_arrow_table") else rel.fetch_arrow_table()
    pq.write_table(t, os.path.join(parts, "part-00000.parquet"))
    with open(os.path.join(out, "workers", "w00000", "manifest.json"), "w") as f:
        f.write('{"state": "completed", "counts": {"num_ok": %d, "num_error": 0, "num_parts": 1}, "attempts": []}'
                % t.num_rows)


def write_lines(path: str, rows: int) -> None:
    """OpenAI Batch request lines: the id is each line's custom_id, so the pass parses every line."""
    import json

    with open(path, "w") as f:
        for i in range(rows):
            f.write(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "m", "messages": [{"role": "user", "content": f"question {i} " * 5}],
                                         "max_tokens": 64}}) + "\n")


def timed(cfg, fresh: bool, reps: int):
    from overnight.pipeline.cluster.idscan import scan_input_ids
    from overnight.pipeline.cluster.units import plan_units
    from overnight.pipeline.input.source import open_source

    best, got = float("inf"), None
    for _ in range(reps):
        source = open_source(cfg.input)
        units = plan_units(source.files, 2, cfg.input.limit)
        t = time.perf_counter()
        got = scan_input_ids(cfg, source, fresh, units)
        best = min(best, time.perf_counter() - t)
    return best, got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from overnight.pipeline.configio import resolve

    with tempfile.TemporaryDirectory() as tmp:
        for name, dup_every in (("unique ids", 0), ("every id twice", 2)):
            src, out = os.path.join(tmp, name.replace(" ", "-")), os.path.join(tmp, f"out-{dup_every}")
            write_input(src, args.rows, args.files, dup_every)
            cfg = resolve({"input": {"path": src}, "output": {"path": out}})
            fresh, f = timed(cfg, True, args.reps)
            folder_holding_every_row(src, out)
            resume, r = timed(cfg, False, args.reps)
            print(f"{args.rows} rows, {name}: fresh {fresh:.2f} s ({args.rows / fresh / 1e6:.2f} M ids/s, "
                  f"{f.num_duplicates} duplicates); resume over a folder of every id {resume:.2f} s "
                  f"({r.done_in_input} done in the input, {r.gone} gone)")
        lines = os.path.join(tmp, "requests.jsonl")
        n = args.rows // 10
        write_lines(lines, n)
        fresh, _ = timed(resolve({"input": {"path": lines}, "output": {"path": os.path.join(tmp, "out-jsonl")}}),
                         True, args.reps)
        print(f"{n} JSONL request lines: fresh {fresh:.2f} s ({n / fresh / 1e6:.3f} M lines/s)")


if __name__ == "__main__":
    main()
