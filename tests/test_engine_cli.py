"""The CLI in-process (CliRunner) through the real vLLM engine with the embedded model.

Every job here uses the same engine settings, so the engine starts once for the module; the last test's jobs, whose
model is named by its folder (no preset), start a second.
"""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from conftest import real_prompts
from overnight.jobs.cli import cli

pytestmark = pytest.mark.engine

FAST = ["--max-tokens", "48"]


@pytest.fixture(scope="module", autouse=True)
def one_engine_per_module():
    yield
    from overnight.pipeline.engine.vllm import shutdown_engines
    shutdown_engines()


def invoke(*args, ok=True):
    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=not ok)
    if ok:
        assert result.exit_code == 0, result.output
    return result


def parts(out) -> pa.Table:
    return pq.read_table(f"{out}/parts")


def test_run_over_real_prompts(tmp_path, model_path):
    inp = tmp_path / "real.parquet"
    pq.write_table(real_prompts(30), inp)
    out = tmp_path / "out"
    result = invoke("run", inp, "--out", out, *FAST, "--flush-rows", "10")
    summary = result.output.strip().splitlines()[-1]
    assert summary.startswith("overnight: done: 30/30 rows (30 ok, 0 error)")
    assert summary.endswith(f"-> {out}")
    t = parts(out)
    rows = t.to_pylist()
    assert sorted(r["id"] for r in rows) == sorted(pq.read_table(inp).column("id").to_pylist())
    for r in rows:
        assert r["status"] == "ok" and r["error"] is None and r["text"].strip()
        assert r["finish_reason"] in ("stop", "length")
        assert 1 <= r["output_tokens"] <= 48 and r["prompt_tokens"] > 10
        # a row cut at the limit has 48 tokens; one under it stopped itself (a row may also stop
        # itself on its 48th token, the end-of-sequence token counted, and then reads "stop")
        assert r["output_tokens"] == 48 if r["finish_reason"] == "length" else True
        assert r["finish_reason"] == "stop" if r["output_tokens"] < 48 else True
        assert r["queued_at"] <= r["finished_at"]
        assert r["first_token_at"] is None or r["queued_at"] <= r["first_token_at"] <= r["finished_at"]
        assert r["prompt"] and r["model"] == "smollm2-135m"
    sizes = [pq.read_metadata(p).num_rows for p in sorted((out / "parts").glob("part-*.parquet"))]
    assert sum(sizes) == 30 and all(n >= 10 for n in sizes[:-1])  # a part is written once 10 rows are buffered
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "completed" and status["rows"]["done"] == 30 and status["output_tokens"] > 100
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["num_ok"] == 30 and manifest["config"]["sampling"]["max_tokens"] == 48

    # inspect: the summary, and SQL over the view `results`
    summary = invoke("inspect", out).output
    assert "rows: 30 (30 ok, 0 error)" in summary and "state: completed" in summary
    q = invoke("inspect", out, "--sql", "select status, count(*) as n from results group by status")
    assert q.output.splitlines()[2].split() == ["ok", "30"]
    js = json.loads(invoke("inspect", out, "--sql", "select id from results order by id limit 2",
                           "--format", "json").output)
    assert len(js) == 2 and set(js[0]) == {"id"}


def test_per_row_overrides_are_honoured(tmp_path, model_path):
    capital = "What is the capital of France?"
    inp = tmp_path / "over.parquet"
    pq.write_table(pa.table({
        "id": ["greedy", "short", "stopped", "seed-a", "seed-b", "chat", "long"],
        "prompt": [capital, "Write a long story about a dragon.", capital,
                   "Name a colour.", "Name a colour.", None, "Write a long story about a dragon."],
        "temperature": [0.0, None, 0.0, 1.0, 1.0, 0.0, None],
        "max_tokens": [None, 5, None, 20, 20, None, 96],   # "long" asks for more than the job's 48
        "seed": [None, None, None, 7, 7, None, None],
        "stop": [None, None, ["Paris"], None, None, None, None],
        "messages": [None, None, None, None, None,
                     [{"role": "developer", "content": "You answer in one word."},   # read as system
                      {"role": "user", "content": capital}], None],
    }), inp)
    out = tmp_path / "out"
    invoke("run", inp, "--out", out, *FAST)
    rows = {r["id"]: r for r in parts(out).to_pylist()}
    assert all(r["status"] == "ok" for r in rows.values()), [r["error"] for r in rows.values()]
    assert "Paris" in rows["greedy"]["text"]
    assert rows["short"]["output_tokens"] == 5 and rows["short"]["finish_reason"] == "length"
    assert "Paris" not in rows["stopped"]["text"] and rows["stopped"]["finish_reason"] == "stop"
    assert rows["stopped"]["output_tokens"] < rows["greedy"]["output_tokens"]
    assert rows["seed-a"]["text"] == rows["seed-b"]["text"]
    assert "Paris" in rows["chat"]["text"]
    # a row may ask for more than the job's max_tokens (and the forecast's length models allow it that long)
    assert rows["long"]["output_tokens"] > 48


def test_bad_rows_become_error_rows_and_the_job_goes_on(tmp_path, model_path):
    inp = tmp_path / "bad.parquet"
    pq.write_table(pa.table({
        "id": [1, 2, 3, 4, 5, 6],
        "prompt": ["Say hi.", None, "", "word " * 3000, "Say bye.", "Count to three."],
        "max_tokens": pa.array([None, None, None, None, None, None], pa.int64()),
        "temperature": [None, None, None, None, -1.0, None],
    }), inp)
    out = tmp_path / "out"
    result = invoke("run", inp, "--out", out, *FAST)
    assert "6/6 rows (2 ok, 4 error)" in result.output
    rows = {r["id"]: r for r in parts(out).to_pylist()}
    assert rows[1]["status"] == rows[6]["status"] == "ok"
    assert rows[2]["error"] == "bad.parquet#1: prompt column 'prompt' is null; give the row a prompt or a " \
                               "'messages' chat"
    assert rows[3]["error"] == "bad.parquet#2: prompt column 'prompt' is empty; give the row a prompt"
    assert rows[4]["error"].startswith("bad.parquet#3: prompt is ")
    assert "max_model_len=2048; shorten the prompt or raise --max-model-len" in rows[4]["error"]
    assert rows[5]["error"] == "bad.parquet#4: temperature is -1.0; it must be 0 (greedy) to 2"
    assert all(rows[i]["text"] is None for i in (2, 3, 4, 5))
    summary = invoke("inspect", out).output
    assert "rows: 6 (2 ok, 4 error)" in summary and "most common errors:" in summary
    # row 5's temperature fixed: --retry-errors answers the error rows again, and row 5 is now answered
    table = pq.read_table(inp)
    pq.write_table(table.set_column(3, "temperature", pa.array([None] * 6, pa.float64())), inp)
    retried = invoke("run", inp, "--out", out, *FAST, "--retry-errors")
    assert "6/6 rows (3 ok, 3 error, 2 already done)" in retried.output
    rows = {r["id"]: r for r in parts(out).to_pylist()}
    assert len(rows) == parts(out).num_rows == 6                      # each id one row
    assert rows[5]["status"] == "ok" and rows[5]["text"]
    assert [rows[i]["status"] for i in (2, 3, 4)] == ["error"] * 3


def test_memory_urls_and_yaml_config(tmp_path, model_path):
    import fsspec
    fs = fsspec.filesystem("memory")
    with fs.open("/engine-test/in/a.parquet", "wb") as f:
        pq.write_table(real_prompts(4), f)
    cfg = tmp_path / "job.yaml"
    cfg.write_text("input:\n  path: memory://engine-test/in\n  passthrough: none\n"
                   "output:\n  path: memory://engine-test/out\nsampling:\n  max_tokens: 48\n")
    result = invoke("run", cfg)
    assert "4/4 rows (4 ok" in result.output
    with fs.open("/engine-test/out/manifest.json") as f:
        assert json.load(f)["state"] == "completed"
    q = invoke("inspect", "memory://engine-test/out", "--sql", "select count(*) as n from results", "--format", "csv")
    assert q.output.split() == ["n", "4"]


def test_s3_input_and_output_on_the_real_engine(s3, model_path):
    import fsspec
    fs = fsspec.filesystem("s3")
    with fs.open("overnight-test/engine-in/a.parquet", "wb") as f:
        pq.write_table(real_prompts(6), f)
    out = "s3://overnight-test/engine-out"
    result = invoke("run", "s3://overnight-test/engine-in/", "--out", out, *FAST)
    assert "6/6 rows (6 ok, 0 error)" in result.output
    q = invoke("inspect", out, "--sql", "select count(*) as n, min(length(text)) > 0 as texts from results",
               "--format", "csv")
    assert q.output.split() == ["n,texts", "6,True"]


def test_shards_of_unequal_files_split_into_equal_ranges(tmp_path, model_path):
    """Two files of 9 and 3 rows, two shards: 6 rows each (whole files gave 9 and 3), every id answered once by
    the real engine, and export puts them back in input order."""
    rows = real_prompts(12)
    inp = tmp_path / "in"
    inp.mkdir()
    pq.write_table(rows.slice(0, 9), inp / "a.parquet")
    pq.write_table(rows.slice(9, 3), inp / "b.parquet")
    out = tmp_path / "out"
    for k in range(2):
        invoke("run", inp, "--out", out, *FAST, "--shard", f"{k}/2")
    done = [json.loads((out / "shards" / f"0000{k}-of-00002" / "manifest.json").read_text()) for k in range(2)]
    assert [m["counts"]["num_ok"] for m in done] == [6, 6]
    assert {m["input"]["split_rule"] for m in done} == {"rows"}
    t = pq.read_table([str(p) for p in sorted(out.glob("shards/*/parts/part-*.parquet"))]).to_pylist()
    assert sorted(r["id"] for r in t) == sorted(rows.column("id").to_pylist())
    assert all(r["status"] == "ok" and r["text"].strip() for r in t)
    status = json.loads(invoke("status", out, "--json").output)
    assert (status["state"], status["rows_done"], status["exit_code"]) == ("completed", 12, 0)
    invoke("export", out, "--output", tmp_path / "all.parquet")
    assert pq.read_table(tmp_path / "all.parquet").column("id").to_pylist() == rows.column("id").to_pylist()


def test_resume_and_fingerprint_refusal(tmp_path, model_path, monkeypatch):
    """Last in the module: the model by its folder has no preset, so its engine's settings are not the alias's
    and it starts an engine of its own, which no test after it would reuse."""
    import os

    inp = tmp_path / "in.parquet"
    pq.write_table(real_prompts(12), inp)
    out = tmp_path / "out"
    folder = os.path.realpath(model_path)   # the embedded model's folder, by its absolute path
    invoke("run", inp, "--out", out, *FAST, "--limit", "5", "--model", folder)
    assert parts(out).num_rows == 5
    refused = invoke("run", inp, "--out", out, *FAST, "--temperature", "0.9", "--model", folder, ok=False)
    assert refused.exit_code == 2   # bad usage: a rerun fails the same way
    assert refused.output.startswith(f"Error: {out} holds results of a run with different settings "
                                     f"(sampling.temperature: 1.0 -> 0.9). Resuming would mix outputs.")
    # (a folder has no sampling preset; the alias's temperature is 0.2.) The same folder by a relative path, from
    # its parent: the same model, so the run resumes
    monkeypatch.chdir(os.path.dirname(folder))
    result = invoke("run", inp, "--out", out, *FAST, "--model", os.path.basename(folder))
    assert "12/12 rows (12 ok, 0 error, 5 already done)" in result.output
    ids = parts(out).column("id").to_pylist()
    assert len(ids) == 12 == len(set(ids)) and set(parts(out).column("model").to_pylist()) == {folder}
    # a lower --limit: its 4 rows are done, the 8 past it are not this run's (the progress began at 12/4 before)
    lower = invoke("run", inp, "--out", out, *FAST, "--limit", "4", "--model", os.path.basename(folder))
    assert "8 of the rows done are past --limit 4" in lower.output
    assert "4/4 rows (12 ok, 0 error, 4 already done; the output holds 8 rows beyond this input's" in lower.output
    fresh = invoke("run", inp, "--out", out, *FAST, "--temperature", "0.9", "--fresh", "--limit", "3",
                   "--model", os.path.basename(folder))
    assert "3/3 rows (3 ok" in fresh.output and parts(out).num_rows == 3
