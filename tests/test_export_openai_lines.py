"""`overnight export --format openai`: the ok rows' lines that DuckDB builds are the lines Python builds."""

from __future__ import annotations

import json
import re

import duckdb
import pytest

from fakes import FakeEngine, given
from overnight.pipeline.api import run_job
from overnight.pipeline.tools.export import export


@pytest.mark.parametrize("id_type", ["varchar", "bigint"])
def test_duckdbs_ok_lines_are_pythons(id_type):
    """ok_line_sql builds the line of an ok row of one sample in DuckDB: the same JSON as ok_line's, for text JSON
    must escape and text past ASCII, and for the line breaks str.splitlines() splits at (escaped)."""
    from overnight.pipeline.tools.openai_lines import ok_line, ok_line_sql

    texts = ['say "hi"\\ there\n\ttab\x01', "caf\u00e9 \U0001F600 \u2028para\u2029graph\x85next", "", None]
    rows = [(i if id_type == "bigint" else f"r{i}", t, f, p, o, e)
            for i, (t, f, p, o, e) in enumerate(zip(texts, ["stop", "", None, "length"], [5, None, 0, 7],
                                                    [3, 0, None, 9], [1795835549.75, None, 0.0, 12.5]))]
    con = duckdb.connect()
    con.execute(f"create table r (id {id_type}, text varchar, finish varchar, ptok bigint, otok bigint, "
                f"done_at timestamptz)")
    con.executemany("insert into r values (?, ?, ?, ?, ?, to_timestamp(?))", rows)
    sql = ok_line_sql("id", "text", "finish", "ptok", "otok", "epoch(done_at)", "'m''s model'")
    built = [r[0] for r in con.execute(f"select {sql} from r order by id").fetchall()]
    for line, (rid, text, finish, ptok, otok, at) in zip(built, rows):
        assert "\n" not in line and len(line.splitlines()) == 1 and "\u2028" not in line
        choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None}, "logprobs": None,
                  "finish_reason": finish or "stop"}
        got, want = json.loads(line), ok_line(rid, [choice], ptok, otok, at, "m's model")
        for x in (got, want):
            assert re.fullmatch("batch_req_[0-9a-f]{32}", x["id"]), x["id"]
            assert re.fullmatch("req_[0-9a-f]{32}", x["response"]["request_id"])
            assert re.fullmatch("chatcmpl-[0-9a-f]{32}", x["response"]["body"]["id"])
            x["id"] = x["response"]["request_id"] = x["response"]["body"]["id"] = None
        assert got == want


def test_duckdbs_logprobs_are_pythons():
    """The logprobs of a chat.completion's choice built by DuckDB as choice() and token() build them: each token's
    UTF-8 bytes, a logprob of -inf or none as -9999, NaN as null, a token or its alternatives missing."""
    import math
    import random

    import numpy as np
    import pyarrow as pa

    from overnight.pipeline.output.schema import LOGPROBS_TYPE
    from overnight.pipeline.tools.export import _line
    from overnight.pipeline.tools.openai_lines import choice, ok_line, ok_line_sql

    rng = random.Random(1)
    texts = ["a", " the", "\u00e9", "\U0001F600", "", None, "\u2028x", '"q"', "\\"]

    def token(j):
        return {"token_id": j, "token": rng.choice(texts), "logprob": rng.choice(
            [float(np.float32(-rng.expovariate(1))), -math.inf, None, 0.0, math.nan, -12345.0]),
                "top_logprobs": None if rng.random() < 0.1 else [
                    {"token_id": k, "token": rng.choice(texts), "logprob": float(np.float32(-rng.expovariate(0.5)))}
                    for k in range(rng.randint(0, 3))]}

    rows = [None if r % 17 == 0 else [token(j) for j in range(rng.randint(0, 6))] for r in range(300)]
    con = duckdb.connect()
    con.register("t", pa.table({"id": [f"r{i:03d}" for i in range(len(rows))], "lp": pa.array(rows, LOGPROBS_TYPE)}))
    sql = ok_line_sql("id", "'x'", "'stop'", "1", "2", "0", "'m'", "lp")
    for rid, line, lp in con.execute(f"select id, {sql}, lp from t order by id").fetchall():
        got, want = json.loads(line), json.loads(_line(ok_line(rid, [choice("x", "stop", 0, lp)], 1, 2, 0, "m")))
        for x in (got, want):
            x["id"] = x["response"]["request_id"] = x["response"]["body"]["id"] = None
        assert got == want


@pytest.mark.parametrize("logprobs", [None, 2])
def test_the_openai_export_writes_the_same_lines_with_duckdb_as_without(tmp_path, cfg, write_parquet, monkeypatch,
                                                                         logprobs):
    """Ok rows built by DuckDB, error and expired rows by Python: the lines are those Python alone writes, in the
    same order, every line in one style (compact)."""
    import overnight.pipeline.tools.export as ex
    from overnight.pipeline.tools.openai_lines import ok_line

    n = 30
    out = tmp_path / "out"
    inp = write_parquet({"id": [f"r{i:03d}" for i in range(n)][::-1],
                         "prompt": [None if i == 7 else f"question {i} caf\u00e9 " + "word " * (i % 5)
                                    for i in range(n)],
                         "deadline": ["2020-01-01T00:00:00Z" if i == 11 else None for i in range(n)]})
    run_job(cfg(inp, out, sampling={"logprobs": logprobs}), engine_factory=given(FakeEngine()), is_tty=False)
    built = []   # the ok lines Python built
    monkeypatch.setattr(ex, "ok_line", lambda *a: built.append(a[0]) or ok_line(*a))
    export(str(out), "openai", str(tmp_path / "fast.jsonl"))
    assert built == []
    monkeypatch.setattr(ex, "one_sample", lambda con, index: False)   # every line through Python
    export(str(out), "openai", str(tmp_path / "python.jsonl"))
    assert len(built) == n - 2
    texts = [(tmp_path / f).read_text().splitlines() for f in ("fast.jsonl", "python.jsonl")]
    lines = [[json.loads(x) for x in t] for t in texts]
    assert len(lines[0]) == len(lines[1]) == n
    assert sum(x["response"] is not None and x["response"]["status_code"] == 400 for x in lines[0]) == 1  # row 7
    assert sum(x["response"] is None for x in lines[0]) == 1                  # row 11: its deadline had passed
    for a, b in zip(*lines):
        for x in (a, b):
            x["id"] = None
            if x["response"] is not None:
                x["response"]["request_id"] = None
                x["response"]["body"].pop("id", None)
        assert a == b
    assert all((x["response"]["body"]["choices"][0]["logprobs"] is not None) == (logprobs is not None)
               for x in lines[0] if x["response"] and x["response"]["status_code"] == 200)
    assert all(x.startswith('{"id":"batch_req_') for t in texts for x in t)


@pytest.mark.parametrize("moved", [False, True])
def test_completions_lines_without_logprobs_are_built_by_duckdb_as_by_python(tmp_path, cfg, monkeypatch, moved):
    """A /v1/completions line's text_completion is DuckDB's too, but where it asked for logprobs (the legacy
    shape's {token: logprob} objects stay Python's): the same lines as Python alone writes, read with the input
    or (moved) from the rows' passthrough columns."""
    import overnight.pipeline.tools.export as ex
    from openai_lines import chat, completion, write_lines
    from overnight.pipeline.tools.openai_lines import ok_line

    reqs = [completion(f"c{i}", f"once {i} caf\u00e9", max_tokens=4, **({"logprobs": 2} if i == 3 else {}))
            for i in range(6)] + [chat(f"q{i}", f"hi {i}", max_tokens=3) for i in range(4)]
    path = write_lines(tmp_path / "requests.jsonl", reqs)
    out = tmp_path / "out"
    run_job(cfg(path, out), engine_factory=given(FakeEngine()), is_tty=False)
    if moved:
        (tmp_path / "requests.jsonl").rename(tmp_path / "moved.jsonl")
    built = []   # the ok lines Python built
    monkeypatch.setattr(ex, "ok_line", lambda *a: built.append(a[0]) or ok_line(*a))
    export(str(out), "openai", str(tmp_path / "fast.jsonl"))
    assert built == ["c3"]   # the one that asked for logprobs
    monkeypatch.setattr(ex, "one_sample", lambda con, index: False)   # every line through Python
    export(str(out), "openai", str(tmp_path / "python.jsonl"))
    lines = [{x["custom_id"]: x for x in map(json.loads, (tmp_path / f).read_text().splitlines())}
             for f in ("fast.jsonl", "python.jsonl")]
    assert lines[0].keys() == lines[1].keys() and len(lines[0]) == 10
    for cid, a in lines[0].items():
        b = lines[1][cid]
        assert a["response"]["body"]["id"].startswith("cmpl-" if cid.startswith("c") else "chatcmpl-")
        for x in (a, b):
            x["id"] = x["response"]["request_id"] = x["response"]["body"]["id"] = None
        assert a == b
        assert a["response"]["body"]["object"] == ("text_completion" if cid.startswith("c") else "chat.completion")
    assert lines[0]["c3"]["response"]["body"]["choices"][0]["logprobs"]["top_logprobs"]


def _lines(tmp_path, **columns) -> list:
    """export's OpenAI lines for a results view of these columns (each a one-sample ok row of model "base")."""
    import datetime as dt

    import pyarrow as pa

    import overnight.pipeline.tools.export as ex

    n = len(next(iter(columns.values())))
    base = {"id": [f"r{i}" for i in range(n)], "text": ["t"] * n, "finish_reason": ["stop"] * n,
            "prompt_tokens": pa.array([1] * n, pa.int32()), "output_tokens": pa.array([1] * n, pa.int32()),
            "finished_at": pa.array([dt.datetime(2024, 1, 1)] * n, pa.timestamp("ms")), "status": ["ok"] * n,
            "error": pa.array([None] * n, pa.string()), "model": ["base"] * n}
    con = duckdb.connect()
    con.register("_t", pa.table({**base, **columns}))
    con.execute("create view results as select * from _t")
    out = tmp_path / "o.jsonl"
    ex._openai(con, {"fingerprint_fields": {"id_column": "id", "model": "base"}}, False, str(out), None, "x")
    return [json.loads(x)["response"]["body"] for x in out.read_text().splitlines()]


def test_what_a_review_found_the_duckdb_lines_did_not_do_as_pythons(tmp_path):
    import pyarrow as pa

    from overnight.pipeline.output.schema import LOGPROBS_TYPE

    # token counts whose sum passes int32 (the line failed: "Overflow in addition of INT32")
    [body] = _lines(tmp_path, prompt_tokens=pa.array([2_000_000_000], pa.int32()),
                    output_tokens=pa.array([2_000_000_000], pa.int32()))
    assert body["usage"]["total_tokens"] == 4_000_000_000
    # a logprob of +inf is null, as JSON holds no infinity (it was written Infinity)
    [body] = _lines(tmp_path, logprobs=pa.array([[{"token_id": 1, "token": "a", "logprob": float("inf"),
                                                   "top_logprobs": []}]], LOGPROBS_TYPE))
    assert body["choices"][0]["logprobs"]["content"][0]["logprob"] is None
    # a logprobs column of another shape (no top_logprobs) goes through Python (the SQL failed to bind)
    [body] = _lines(tmp_path, logprobs=pa.array([[{"token": "a", "logprob": -0.5}]], pa.list_(
        pa.struct([("token", pa.string()), ("logprob", pa.float32())]))))
    assert body["choices"][0]["logprobs"]["content"] == [{"token": "a", "logprob": -0.5, "bytes": [97],
                                                          "top_logprobs": []}]
    # rows without a sample_index (a part written before it, beside one after) are a sample each: none is lost
    bodies = _lines(tmp_path, id=["a", "a"], text=["one", "two"], sample_index=pa.array([None, None], pa.int32()))
    assert [b["choices"][0]["message"]["content"] for b in bodies] == ["one", "two"]
