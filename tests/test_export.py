"""`overnight export`: one compacted file in input order, and OpenAI Batch output lines that OpenAI's own
types parse (ok rows), with error rows and rows never done (batch_expired) in the errors file."""

from __future__ import annotations

import json

import duckdb
import pytest

from fakes import FakeEngine, given
from overnight.pipeline.api import run_job
from overnight.pipeline.tools.export import export


@pytest.fixture
def job(tmp_path, cfg, write_parquet):
    ids = [f"r{i:03d}" for i in range(40)][::-1]            # input order is not id order
    prompts = [None if i == 7 else f"question {i} " + "word " * (i % 5) for i in range(40)]
    inp = write_parquet({"id": ids, "prompt": prompts})
    out = tmp_path / "out"
    run_job(cfg(inp, out, input={"limit": 30}), engine_factory=given(FakeEngine()), is_tty=False)  # 10 not done
    return ids, out


@pytest.mark.parametrize("fmt", ["parquet", "csv", "jsonl"])
def test_one_file_in_input_order(job, tmp_path, fmt):
    ids, out = job
    path = tmp_path / f"all.{fmt}"
    info = export(str(out), fmt, str(path))
    assert info == {"rows": 30, "in_input_order": True, "output": str(path)}
    reader = {"parquet": "read_parquet", "csv": "read_csv_auto", "jsonl": "read_json_auto"}[fmt]
    got = [r[0] for r in duckdb.sql(f"select id from {reader}('{path}')").fetchall()]
    assert got == ids[:30]


def test_openai_batch_output_parses_with_openai_types(job, tmp_path):
    from openai.types import BatchError
    from openai.types.chat import ChatCompletion

    ids, out = job
    ok_path, err_path = tmp_path / "results.jsonl", tmp_path / "errors.jsonl"
    info = export(str(out), "openai", str(ok_path), str(err_path))
    assert (info["ok"], info["errors"], info["expired"]) == (29, 1, 10)
    lines = [json.loads(x) for x in ok_path.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == [i for n, i in enumerate(ids[:30]) if n != 7]
    for x in lines:
        assert x["error"] is None and x["response"]["status_code"] == 200 and x["id"].startswith("batch_req_")
        completion = ChatCompletion.model_validate(x["response"]["body"])   # a user's parser works unchanged
        assert completion.choices[0].message.role == "assistant" and completion.usage.total_tokens > 0
    errors = [json.loads(x) for x in err_path.read_text().splitlines()]
    kinds = [e["error"]["code"] for e in errors]
    assert kinds == ["invalid_request"] + ["batch_expired"] * 10
    assert [e["custom_id"] for e in errors[1:]] == ids[30:]
    for e in errors:
        BatchError.model_validate(e["error"])
        assert e["response"] is None
