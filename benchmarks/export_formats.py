"""`overnight export` to csv and jsonl, the writers before against now, side by side in one process, each repeat
interleaved; the two files must parse to the same JSON.

- csv, a logprobs column: json's encoder per value (a Python function DuckDB calls, how every nested column holding
  floats was written before) against DuckDB's to_json, with that function only for the values in which to_json
  writes NaN or Infinity (export._nested_as_json now).
- jsonl, the same logprobs rows, and result rows without logprobs (--plain-rows, the output's own columns): json's
  encoder per row, over the rows DuckDB fetches (before), against DuckDB building each line (export._write_jsonl).

    python benchmarks/export_formats.py --rows 100000 --tokens 16 --top 1 --plain-rows 1000000 --repeats 3
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import tempfile
import time

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from overnight.pipeline.output.schema import LOGPROBS_TYPE
from overnight.pipeline.tools.export import _ident, _json, _nested_as_json, _write_jsonl


def logprobs_table(rows: int, tokens: int, top: int, non_finite_every: int, seed: int = 0) -> pa.Table:
    """``rows`` rows of ``tokens`` tokens, each with ``top`` alternatives, as the product writes them (float32
    logprobs); every ``non_finite_every``-th row has a -inf logprob (a token the sampler could never have chosen)."""
    rng = np.random.default_rng(seed)
    values = -rng.exponential(1.5, size=(rows, tokens, 1 + top)).astype(np.float32)
    values[::non_finite_every, 0, 0] = -np.inf
    column = [[{"token_id": int(t), "token": f" tok{t}", "logprob": float(v[t, 0]),
                "top_logprobs": [{"token_id": int(a), "token": f" alt{a}", "logprob": float(v[t, 1 + a])}
                                 for a in range(top)]}
               for t in range(tokens)] for v in values]
    return pa.table({"id": pa.array([str(i) for i in range(rows)]), "logprobs": pa.array(column, LOGPROBS_TYPE)})


def plain_table(rows: int) -> pa.Table:
    """Result rows as a job without logprobs writes them (OutputSchema's columns, a typical answer's length)."""
    ms = np.datetime64("2026-11-27T01:02:03.456", "ms") + np.arange(rows).astype("timedelta64[ms]")
    n = np.arange(rows)
    return pa.table({
        "id": pa.array([f"row-{i}" for i in range(rows)]),
        "text": pa.array(["An answer of a typical length, about a hundred characters, with words and more words."]
                         * rows),
        "finish_reason": pa.array(["stop"] * rows), "prompt_tokens": pa.array(100 + n % 50, pa.int32()),
        "output_tokens": pa.array(200 + n % 300, pa.int32()), "predicted_tokens": pa.array(180 + n % 7, pa.int32()),
        "bucket": pa.array(n % 4, pa.int16()), "queued_at": pa.array(ms), "first_token_at": pa.array(ms),
        "finished_at": pa.array(ms), "status": pa.array(["ok"] * rows), "error": pa.nulls(rows, pa.string()),
        "prompt_hash": pa.array(["abcdef0123456789"] * rows), "engine_seconds": pa.array(n / 1000.0),
        "run_id": pa.array(["run-1"] * rows), "model": pa.array(["smollm2-135m"] * rows)})


def jsonl_before(con, query: str, path: str) -> float:
    """jsonl as it was written before: json's encoder over each row DuckDB fetches."""
    t = time.perf_counter()
    cur = con.execute(query)
    names = [d[0] for d in cur.description]
    with open(path, "w", encoding="utf-8") as f:
        while batch := cur.fetchmany(10_000):
            for row in batch:
                f.write(_json(dict(zip(names, row))) + "\n")
    return time.perf_counter() - t


def jsonl_after(con, query: str, path: str) -> float:
    t = time.perf_counter()
    with open(path, "w", encoding="utf-8") as f:
        _write_jsonl(con, query, f)
    return time.perf_counter() - t


def same_lines(a: str, b: str) -> bool:
    with open(a, encoding="utf-8") as fa, open(b, encoding="utf-8") as fb:
        return all(json.loads(x) == json.loads(y) for x, y in zip(fa, fb)) and sum(1 for _ in open(a)) == sum(
            1 for _ in open(b))


def udf_query(con, query: str) -> str:
    """Before: json's encoder for every value of a nested column holding floats."""
    kind = dict((n, k) for n, k, *_ in con.execute(f"describe ({query})").fetchall())["logprobs"]
    con.create_function("overnight_json_before", _json, [con.sqltype(kind)], "VARCHAR", side_effects=False)
    return f"select * replace (overnight_json_before({_ident('logprobs')}) as logprobs) from ({query})"


def write(con, query: str, path: str) -> float:
    t = time.perf_counter()
    con.sql(f"copy ({query}) to '{path}' (header, format csv)")
    return time.perf_counter() - t


def cells(path: str) -> dict:
    with open(path, newline="") as f:
        return {r["id"]: json.loads(r["logprobs"]) for r in csv.DictReader(f)}


def compare(name: str, repeats: int, before, after, same) -> bool:
    times = {"before": [], "after": []}
    for _ in range(repeats):
        times["before"].append(before())
        times["after"].append(after())
    b, a = statistics.median(times["before"]), statistics.median(times["after"])
    ok = same()
    print(f"{name}: before {b:.2f} s {[round(x, 2) for x in times['before']]}; "
          f"now {a:.2f} s {[round(x, 2) for x in times['after']]}; {b / a:.2f}x; the same JSON: {ok}")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000, help="rows with logprobs")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--top", type=int, default=1, help="alternatives per token")
    ap.add_argument("--non-finite-every", type=int, default=1000, help="a -inf logprob in every N-th row")
    ap.add_argument("--plain-rows", type=int, default=1_000_000, help="result rows without logprobs (0: none)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"median of {args.repeats}; logprobs rows: {args.rows} x {args.tokens} tokens x {args.top} alternatives, "
          f"-inf in every {args.non_finite_every}th; plain rows: {args.plain_rows}")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        con = duckdb.connect()
        out = {k: os.path.join(tmp, k) for k in ("before.csv", "after.csv", "before.jsonl", "after.jsonl")}
        src = os.path.join(tmp, "logprobs.parquet")
        pq.write_table(logprobs_table(args.rows, args.tokens, args.top, args.non_finite_every), src)
        query = f"select * from read_parquet('{src}')"
        before, after = udf_query(con, query), _nested_as_json(con, query)
        ok &= compare("csv, logprobs", args.repeats, lambda: write(con, before, out["before.csv"]),
                      lambda: write(con, after, out["after.csv"]),
                      lambda: cells(out["before.csv"]) == cells(out["after.csv"]))
        ok &= compare("jsonl, logprobs", args.repeats, lambda: jsonl_before(con, query, out["before.jsonl"]),
                      lambda: jsonl_after(con, query, out["after.jsonl"]),
                      lambda: same_lines(out["before.jsonl"], out["after.jsonl"]))
        if args.plain_rows:
            src = os.path.join(tmp, "plain.parquet")
            pq.write_table(plain_table(args.plain_rows), src)
            query = f"select * from read_parquet('{src}')"
            ok &= compare("jsonl, plain rows", args.repeats, lambda: jsonl_before(con, query, out["before.jsonl"]),
                          lambda: jsonl_after(con, query, out["after.jsonl"]),
                          lambda: same_lines(out["before.jsonl"], out["after.jsonl"]))
    if not ok:
        raise SystemExit("the exports differ")


if __name__ == "__main__":
    main()
