"""`overnight export --format csv`: a nested value (a list, a struct, a map) as JSON text in its cell, the JSON
jsonl writes for it: NaN and infinity as null, bytes as base64, nanoseconds kept."""

from __future__ import annotations

import csv
import json

import pyarrow as pa
import pytest

from fakes import FakeEngine, given
from overnight.pipeline.api import run_job
from overnight.pipeline.tools.export import export


def _both(tmp_path, out):
    export(str(out), "csv", str(tmp_path / "o.csv"))
    export(str(out), "jsonl", str(tmp_path / "o.jsonl"))
    rows = list(csv.DictReader(open(tmp_path / "o.csv", newline="")))
    return rows, [json.loads(line) for line in open(tmp_path / "o.jsonl")]


def test_csv_writes_nested_values_as_json(tmp_path, cfg, write_parquet):
    meta = [{"src": "a", "tags": ["x", "y"]}, {"src": "b", "tags": []}]
    scores = [[0.5, float("nan"), float("-inf")], None]           # a -inf logprob, a NaN: JSON has neither
    blobs = [[b"\x89PNG\xff"], []]
    keyed = pa.array([[(b"\x89k", 1.5)], []], pa.map_(pa.binary(), pa.float64()))   # a map keyed by bytes
    inp = write_parquet({"id": ["a", "b"], "prompt": ["p", "q"], "meta": meta, "stop": [["\n\n"], None],
                         "scores": scores, "blobs": blobs, "keyed": keyed})
    out = tmp_path / "out"
    run_job(cfg(inp, out, input={"passthrough": ["meta", "scores", "blobs", "keyed"]}),
            engine_factory=given(FakeEngine()), is_tty=False)
    rows, lines = _both(tmp_path, out)
    assert [json.loads(r["meta"]) for r in rows] == meta            # DuckDB's own literal ({'src': a, ...}) before
    # as jsonl writes them: NaN and infinity as null, bytes as base64 (DuckDB's to_json wrote NaN, -Infinity, raw)
    assert json.loads(rows[0]["scores"]) == [0.5, None, None] == lines[0]["scores"] and rows[1]["scores"] == ""
    assert json.loads(rows[0]["blobs"]) == ["iVBOR/8="] == lines[0]["blobs"] and json.loads(rows[1]["blobs"]) == []
    assert json.loads(rows[0]["keyed"]) == lines[0]["keyed"] and rows[0]["status"] == "ok"
    from overnight.pipeline.tools.export import _json
    assert json.loads(_json({float("nan"): 1.0, b"k": float("inf"), 2.5: 1})) == {"nan": 1.0, "aw==": None, "2.5": 1}
    assert rows[0]["text"] and not rows[0]["text"].startswith('"')   # text stays text


def test_csv_cells_of_floats_from_duckdb_and_from_json_for_nan(tmp_path, cfg, write_parquet):
    """A nested column of floats is written by DuckDB's to_json, but a value where that would write NaN or
    Infinity (not JSON) by json's encoder, as jsonl writes it; text that only looks like one stays text."""
    tokens = pa.list_(pa.struct([("token", pa.string()), ("logprob", pa.float32())]))
    lp = pa.array([[{"token": "x:NaN}", "logprob": -0.1}, {"token": "[-Infinity,", "logprob": -2.5}],
                   [{"token": "a", "logprob": float("-inf")}, {"token": "NaN", "logprob": float("nan")}],
                   [], None], tokens)
    timed = pa.array([[{"at": 1_500_000, "x": 0.5}], [{"at": 0, "x": float("inf")}], [], None],
                     pa.list_(pa.struct([("at", pa.time64("us")), ("x", pa.float64())])))
    weights = pa.array([[("w", 1e-7), ("v", 1e300)], [("nan", float("nan"))], [], None],
                       pa.map_(pa.string(), pa.float64()))
    inp = write_parquet({"id": ["a", "b", "c", "d"], "prompt": ["p"] * 4, "lp": lp, "timed": timed,
                         "weights": weights})
    out = tmp_path / "out"
    run_job(cfg(inp, out, input={"passthrough": ["lp", "timed", "weights"]}), engine_factory=given(FakeEngine()),
            is_tty=False)
    rows, lines = _both(tmp_path, out)
    assert [r["id"] for r in rows] == [line["id"] for line in lines] == ["a", "b", "c", "d"]
    for r, line in zip(rows, lines):
        for name in ("lp", "timed", "weights"):
            cell = r[name]
            assert (json.loads(cell) if cell else None) == line[name], (r["id"], name, cell)
            assert "NaN" not in cell.replace('"NaN"', "").replace("x:NaN}", "") and "Infinity," not in cell.replace(
                "[-Infinity,", "")
    assert json.loads(rows[0]["lp"]) == [{"token": "x:NaN}", "logprob": pytest.approx(-0.1)},
                                         {"token": "[-Infinity,", "logprob": -2.5}]
    assert json.loads(rows[1]["lp"]) == [{"token": "a", "logprob": None}, {"token": "NaN", "logprob": None}]
    assert json.loads(rows[0]["timed"]) == [{"at": "00:00:01.500000", "x": 0.5}]   # a time: json's encoder
    assert json.loads(rows[0]["weights"]) == {"w": 1e-7, "v": 1e300} and json.loads(rows[1]["weights"]) == {"nan": None}
    assert rows[2]["lp"] == "[]" and rows[3]["lp"] == ""
