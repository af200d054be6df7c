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


def _stopped(out) -> set:
    """Remove OUT's last part, as if the job had been killed before it wrote it; the ids the other parts hold."""
    parts = sorted((out / "parts").glob("part-*.parquet"))
    parts[-1].unlink()
    return {r[0] for r in duckdb.sql(f"select id from read_parquet('{out}/parts/*.parquet')").fetchall()}


def test_openai_batch_output_parses_with_openai_types(job, tmp_path):
    from openai.types import BatchError
    from openai.types.chat import ChatCompletion

    ids, out = job
    done = _stopped(out)                                       # the job covers ids[:30] (--limit 30)
    left = [i for i in ids[:30] if i not in done]
    assert left and ids[7] in done
    ok_path, err_path = tmp_path / "results.jsonl", tmp_path / "errors.jsonl"
    info = export(str(out), "openai", str(ok_path), str(err_path))
    assert (info["ok"], info["errors"], info["expired"]) == (len(done) - 1, 1, len(left))
    lines = [json.loads(x) for x in ok_path.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == [i for n, i in enumerate(ids[:30]) if n != 7 and i in done]
    for x in lines:
        assert x["error"] is None and x["response"]["status_code"] == 200 and x["id"].startswith("batch_req_")
        completion = ChatCompletion.model_validate(x["response"]["body"])   # a user's parser works unchanged
        assert completion.choices[0].message.role == "assistant" and completion.usage.total_tokens > 0
    errors = [json.loads(x) for x in err_path.read_text().splitlines()]
    kinds = [e["error"]["code"] for e in errors]
    assert kinds == ["invalid_request"] + ["batch_expired"] * len(left)
    assert [e["custom_id"] for e in errors[1:]] == left        # the rows past --limit were never the job's
    for e in errors:
        BatchError.model_validate(e["error"])
        assert e["response"] is None


# -- OpenAI Batch input ----------------------------------------------------------------------------

def request(cid, words: int) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": "word " * words}]}})


def test_a_jsonl_jobs_rows_come_in_line_order(tmp_path, cfg):
    ids = [f"r{i:03d}" for i in range(40)][::-1]
    lines = [request(cid, 1 + i % 7) for i, cid in enumerate(ids)]
    lines[7] = "not json"                                               # no custom_id: an error row without an id
    lines[11] = json.dumps({"custom_id": ids[11], "method": "POST", "url": "/v1/embeddings", "body": {}})
    lines.insert(20, "")                                                # blank lines are not rows
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    run_job(cfg(path, out, input={"limit": 30}), engine_factory=given(FakeEngine()), is_tty=False)  # 30 of 40
    finished = [r[0] for r in duckdb.sql(f"select id from read_parquet('{out}/parts/*.parquet')").fetchall()]
    assert finished != [i for n, i in enumerate(ids[:30]) if n != 7] + [None]  # the parts hold finish order

    ok_path, err_path = tmp_path / "results.jsonl", tmp_path / "errors.jsonl"
    info = export(str(out), "openai", str(ok_path), str(err_path))
    assert (info["ok"], info["errors"], info["expired"], info["in_input_order"]) == (28, 2, 0, True)
    assert [json.loads(x)["custom_id"] for x in ok_path.read_text().splitlines()] == \
        [i for n, i in enumerate(ids[:30]) if n not in (7, 11)]
    errors = [json.loads(x) for x in err_path.read_text().splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == \
        [(ids[11], "invalid_request"), (None, "invalid_request")]  # the lines past --limit were never the job's
    info = export(str(out), "jsonl", str(tmp_path / "all.jsonl"))
    got = [json.loads(x)["id"] for x in (tmp_path / "all.jsonl").read_text().splitlines()]
    assert got == [i for n, i in enumerate(ids[:30]) if n != 7] + [None] and info["in_input_order"]
    # an input that moved: finish order, and said so
    path.rename(tmp_path / "moved.jsonl")
    assert export(str(out), "openai", str(ok_path), str(err_path))["in_input_order"] is False


def test_a_jsonl_folders_files_come_in_the_sources_order(tmp_path, cfg):
    import gzip

    folder = tmp_path / "reqs"
    (folder / "b").mkdir(parents=True)
    (folder / "a.jsonl").write_text("".join(request(f"a{i}", 6 - i) + "\n" for i in range(6)))
    with gzip.open(folder / "b" / "c.jsonl.gz", "wt") as f:
        f.write("".join(request(f"c{i}", 1 + i) + "\n" for i in range(5)))
    out = tmp_path / "out"
    run_job(cfg(folder, out), engine_factory=given(FakeEngine()), is_tty=False)
    info = export(str(out), "openai", str(tmp_path / "results.jsonl"))
    assert info["in_input_order"] and info["ok"] == 11
    got = [json.loads(x)["custom_id"] for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert got == [f"a{i}" for i in range(6)] + [f"c{i}" for i in range(5)]
