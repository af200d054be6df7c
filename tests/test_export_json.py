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


def test_jsonl_lines_are_what_jsons_encoder_writes_for_each_type(tmp_path):
    """DuckDB builds each jsonl line; every value is what json's encoder writes for the Python value DuckDB fetches
    (the writer before), for each type a passthrough column can have, and no line is split by str.splitlines."""
    import duckdb

    from overnight.pipeline.tools.export import _json, _write_jsonl

    con = duckdb.connect()
    con.execute("create type mood as enum ('ok', 'sad')")
    con.execute(r"""create table t as select * from (values
      (1, 'a' || chr(0) || chr(8232) || chr(133) || chr(8233) || chr(28) || chr(13) || 'é"\',
       0.5::float, 'nan'::double,
       1.25::decimal(5, 2), '\x89PN'::blob, '2024-01-02 03:04:05.5'::timestamp_ms, '2024-01-02 03:04:05'::timestamp,
       '2024-01-02 03:04:05.25+00'::timestamptz, '01:02:03.5'::time, interval 1 day, '2024-01-02'::date,
       '5cf7414c-91a9-49ef-b596-abd6ea7853c8'::uuid, 170141183460469231731687303715884105727::hugeint, true,
       'ok'::mood, '{"k": [1, 2]}'::json, [0.5, 'nan'::double, '-inf'::double], {'b': '\xff'::blob, 'x': 2},
       map(['w'], [1e-7]), [{'at': '2024-01-02 03:04:05.5'::timestamp, 'f': 1.5}], [[1, 2], []],
       union_value(s := 'u')::union(s varchar, n int), '2024-01-02 03:04:05.000000001'::timestamp_ns),
      (2, null, 'inf'::float, 1.5, null, null, null, null, null, null, null, null, null, null, null, null, null,
       [], null, map(['k'], ['nan'::double]), [], null, null, null),
      (3, 'finite', 1.5, 2.5, null, null, null, null, null, null, null, null, null, null, null, null, null,
       [2.5, -0.125], null, map(['k'], [0.25]), null, null, null, null),
      (4, 'x:NaN},[-Infinity]', null, null, null, null, null, null, null, null, null, null, null, null, null, null,
       null, [1.0], null, null, null, null, null, null)
    ) v("the id", s, f, d, dec, b, ms, us, tz, tm, iv, dt, u, h, bo, mood, j, lst, st, mp, ts_list, ints, un, ns)""")
    query = "select * from t order by 1"
    with open(tmp_path / "new.jsonl", "w", encoding="utf-8") as f:
        assert _write_jsonl(con, query, f) == 4
    text = (tmp_path / "new.jsonl").read_text(encoding="utf-8")
    cur = con.execute(query)
    names = [c[0] for c in cur.description]
    before = [json.loads(_json(dict(zip(names, row)))) for row in cur.fetchall()]
    got = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} is not JSON")) for line in text.splitlines()]
    assert len(got) == 4 and len(text.split("\n")) == 5
    for new, old in zip(got, before):
        assert list(new) == names
        old["ns"] = new["ns"]   # a Python datetime drops the nanoseconds; DuckDB's keeps them
        assert new == old
    assert got[0]["ns"] == "2024-01-02 03:04:05.000000001" and got[0]["ms"] == "2024-01-02 03:04:05.500000"
    assert got[0]["j"] == '{"k": [1, 2]}' and got[0]["b"] == "iVBO" and got[0]["lst"] == [0.5, None, None]
    assert got[1]["f"] is None and got[1]["mp"] == {"k": None} and got[1]["lst"] == []
    assert got[2]["lst"] == [2.5, -0.125] and got[2]["mp"] == {"k": 0.25} and got[3]["s"] == "x:NaN},[-Infinity]"


@pytest.mark.parametrize("value", [
    "'9999-12-31 23:59:59.999'::timestamp_ms", "'0001-01-01'::timestamp_ms", "'20000-01-01'::timestamp_s",
    "'infinity'::timestamp_ms", "'-infinity'::timestamp", "'infinity'::date", "'0044-03-15 (BC)'::date",
    "123456789012345678::decimal(18, 0)", "1.25::decimal(15, 2)", "[1::decimal(18, 0)]",
    "map([1.5::decimal(18, 3)], [1])", "map([0.1::float], [1])", "map([[1, 2]], [1])", "map([1], ['nan'::double])",
    "{'t': '2024-01-02 03:04:05.5'::timestamp, 'f': 'nan'::double}", "[-0.0, 5e-324, 1.7976931348623157e308]",
    "{'t': '2024-01-02 03:04:05.123456789'::timestamp_ns, 'f': 'nan'::double}"])
def test_jsonl_edge_values_as_before(value):
    """Values at the edges of what DuckDB writes as Python does (a review's list): dates and times out of Python's
    range or strftime's, wide DECIMALs, maps keyed by other than text, NaN beside nanoseconds."""
    import io

    import duckdb

    from overnight.pipeline.tools.export import _json, _write_jsonl

    con = duckdb.connect()
    con.execute(f"create table t as select {value} as c, 1 as k union all select null, 2")
    query = "select * from t order by k"
    f = io.StringIO()
    assert _write_jsonl(con, query, f) == 2
    got = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} is not JSON")) for line in
           f.getvalue().splitlines()]
    before = [json.loads(_json({"c": c, "k": k})) for c, k in con.execute(query).fetchall()]
    if "timestamp_ns" in value:   # a Python datetime drops the nanoseconds
        assert got[0]["c"]["t"] == "2024-01-02 03:04:05.123456789"
        before[0]["c"]["t"] = got[0]["c"]["t"]
    assert got == before and [repr(g) for g in got] == [repr(b) for b in before]   # 1.0 is not 1


def test_jsonl_lines_over_several_batches_keep_their_order(tmp_path):
    import duckdb

    from overnight.pipeline.tools import export as ex

    con = duckdb.connect()
    rows = 3 * ex._BATCH_ROWS + 5
    with open(tmp_path / "o.jsonl", "w", encoding="utf-8") as f:
        assert ex._write_jsonl(con, f"select 'r' || i as id, [i * 0.5, 'nan'::double] as v from range({rows}) t(i) "
                                    f"order by i desc", f) == rows
    lines = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [x["id"] for x in lines] == [f"r{i}" for i in reversed(range(rows))]
    assert lines[-2]["v"] == [0.5, None]
