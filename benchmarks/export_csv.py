"""`overnight export --format csv` of a logprobs column: json's encoder per value (a Python function DuckDB calls,
how every nested column holding floats was written before) against DuckDB's to_json with that function only for
the values in which to_json writes NaN or Infinity (export._nested_as_json now). Side by side in one process, each
repeat interleaved; the two files' cells must parse to the same JSON.

    python benchmarks/export_csv.py --rows 100000 --tokens 16 --top 1 --repeats 3
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
from overnight.pipeline.tools.export import _ident, _json, _nested_as_json


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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--top", type=int, default=1, help="alternatives per token")
    ap.add_argument("--non-finite-every", type=int, default=1000, help="a -inf logprob in every N-th row")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "parts.parquet")
        pq.write_table(logprobs_table(args.rows, args.tokens, args.top, args.non_finite_every), src)
        con = duckdb.connect()
        query = f"select * from read_parquet('{src}')"
        before, after = udf_query(con, query), _nested_as_json(con, query)
        times = {"before": [], "after": []}
        for _ in range(args.repeats):
            for name, q in (("before", before), ("after", after)):
                times[name].append(write(con, q, os.path.join(tmp, f"{name}.csv")))
        same = cells(os.path.join(tmp, "before.csv")) == cells(os.path.join(tmp, "after.csv"))
    b, a = statistics.median(times["before"]), statistics.median(times["after"])
    print(f"{args.rows} rows x {args.tokens} tokens x {args.top} alternatives, -inf in every "
          f"{args.non_finite_every}th row; median of {args.repeats}")
    print(f"before (json's encoder per value): {b:.2f} s  {[round(x, 2) for x in times['before']]}")
    print(f"after (to_json, the encoder for NaN/Infinity): {a:.2f} s  {[round(x, 2) for x in times['after']]}")
    print(f"speed-up: {b / a:.2f}x; the cells parse to the same JSON: {same}")
    if not same:
        raise SystemExit("the two exports differ")


if __name__ == "__main__":
    main()
