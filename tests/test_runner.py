"""The run loop with a fake engine and the tiny model's tokenizer: resume, duplicates, error rows, parts, failures."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fakes import TINY_TEMPLATE_TOKENS, FakeEngine, given
from overnight.pipeline.api import run_job
from overnight.pipeline.output.checkpoint import OutputError
from overnight.pipeline.engine import EngineError


def output(out) -> pa.Table:
    return pq.read_table(f"{out}/parts")


@pytest.fixture
def data(write_parquet):
    return write_parquet({"id": [f"q{i}" for i in range(10)], "prompt": [f"question {i}?" for i in range(10)],
                          "category": ["a", "b"] * 5})


def test_run_writes_every_row_once_with_result_columns(data, tmp_path, cfg, tiny_model):
    out = tmp_path / "out"
    s = run_job(cfg(data, out), engine_factory=given(FakeEngine()), is_tty=False)
    assert (s.state, s.exit_code, s.num_ok, s.num_error, s.num_done) == ("completed", 0, 10, 0, 10)
    t = output(out)
    assert sorted(t.column("id").to_pylist()) == [f"q{i}" for i in range(10)]
    assert t.column_names == ["id", "prompt", "category", "text", "finish_reason", "prompt_tokens",
                              "output_tokens", "predicted_tokens", "bucket", "queued_at", "first_token_at",
                              "finished_at", "status", "error", "prompt_hash", "engine_seconds", "run_id", "model"]
    row = t.to_pylist()[0]
    assert row["status"] == "ok" and row["model"] == tiny_model and row["run_id"] == s.run_id
    assert row["prompt_tokens"] == 3 + TINY_TEMPLATE_TOKENS  # "question N?" is 3 tokens, then the chat template
    assert row["text"] == f"echo of {row['prompt_tokens']} prompt tokens"
    assert row["queued_at"] <= row["finished_at"]
    assert len(list((out / "parts").iterdir())) == 3  # flush_rows=4: 4 + 4 + 2


def test_resume_processes_only_rows_not_done(data, tmp_path, cfg):
    out = tmp_path / "out"
    first = FakeEngine()
    run_job(cfg(data, out, input={"limit": 6}), engine_factory=given(first), is_tty=False)
    assert len(first.added) == 6
    second = FakeEngine()
    s = run_job(cfg(data, out), engine_factory=given(second), is_tty=False)
    assert len(second.added) == 4
    assert s.num_resumed == 6 and s.num_done == 10
    # the job's tokens, and this run's, whose time and rate the line gives
    assert 0 < s.attempt_output_tokens < s.num_output_tokens
    assert f"{s.num_output_tokens} output tokens ({s.attempt_output_tokens} this run) in " in s.line()
    ids = output(out).column("id").to_pylist()
    assert sorted(ids) == [f"q{i}" for i in range(10)] and len(ids) == len(set(ids))
    m = __import__("json").loads((out / "manifest.json").read_text())
    assert len(m["attempts"]) == 2 and m["state"] == "completed" and m["counts"]["num_done"] == 10


def test_rerun_of_a_finished_job_does_nothing(data, tmp_path, cfg):
    out = tmp_path / "out"
    run_job(cfg(data, out), engine_factory=given(FakeEngine()), is_tty=False)
    again = FakeEngine()
    s = run_job(cfg(data, out), engine_factory=given(again), is_tty=False)
    assert again.added == [] and s.num_done == 10 and s.num_resumed == 10


def test_error_rows_and_duplicates(write_parquet, tmp_path, cfg):
    inp = write_parquet({"id": ["a", "b", "c", "a", "d"], "prompt": ["ok", None, "fine", "dup", ""],
                         "max_tokens": [5, 5, -1, 5, 5]})
    out = tmp_path / "out"
    s = run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    assert (s.num_ok, s.num_error, s.num_duplicates) == (1, 3, 1)
    rows = {r["id"]: r for r in output(out).to_pylist()}
    assert sorted(rows) == ["a", "b", "c", "d"]
    assert rows["a"]["status"] == "ok" and rows["a"]["prompt"] == "ok" and rows["a"]["max_tokens"] == 5
    assert rows["b"]["error"] == "in.parquet#1: prompt column 'prompt' is null; give the row a prompt or a " \
                                 "'messages' chat"
    assert rows["c"]["error"] == "in.parquet#2: max_tokens is -1; it must be at least 1 (or null for the job default)"
    assert rows["d"]["error"] == "in.parquet#4: prompt column 'prompt' is empty; give the row a prompt"


def test_prompt_longer_than_context_is_an_error_row(write_parquet, tmp_path, cfg):
    inp = write_parquet({"id": ["short", "long"], "prompt": ["hi", "word " * 400]})
    out = tmp_path / "out"
    s = run_job(cfg(inp, out), engine_factory=given(FakeEngine(max_model_len=128)), is_tty=False)
    assert (s.num_ok, s.num_error) == (1, 1)
    err = [r for r in output(out).to_pylist() if r["status"] == "error"][0]
    assert err["id"] == "long"
    assert "tokens after the chat template, which leaves no room for output within max_model_len=128" in err["error"]


def test_max_tokens_is_clipped_to_the_context(write_parquet, tmp_path, cfg):
    inp = write_parquet({"id": ["x"], "prompt": ["hello"]})
    eng = FakeEngine(max_model_len=64, length_of=lambda ids: 10_000)
    run_job(cfg(inp, tmp_path / "out", sampling={"max_tokens": 500}), engine_factory=given(eng), is_tty=False)
    row = output(tmp_path / "out").to_pylist()[0]
    assert row["prompt_tokens"] + row["output_tokens"] == 64 and row["finish_reason"] == "length"
    # min_tokens comes down with it: vLLM refuses min_tokens above max_tokens, a max_tokens the user never set
    run_job(cfg(inp, tmp_path / "out2", sampling={"max_tokens": 500, "min_tokens": 100}),
            engine_factory=given(FakeEngine(max_model_len=64, length_of=lambda ids: 10_000)), is_tty=False)
    row = output(tmp_path / "out2").to_pylist()[0]
    assert row["status"] == "ok" and row["prompt_tokens"] + row["output_tokens"] == 64, row


def test_fingerprint_mismatch_is_refused_and_fresh_starts_over(data, tmp_path, cfg):
    out = tmp_path / "out"
    run_job(cfg(data, out, input={"limit": 3}), engine_factory=given(FakeEngine()), is_tty=False)
    with pytest.raises(OutputError, match=r"sampling.temperature: 1.0 -> 0.9"):
        run_job(cfg(data, out, sampling={"temperature": 0.9}), engine_factory=given(FakeEngine()), is_tty=False)
    eng = FakeEngine()
    s = run_job(cfg(data, out, sampling={"temperature": 0.9}), fresh=True, engine_factory=given(eng), is_tty=False)
    assert len(eng.added) == 10 and s.num_resumed == 0 and output(out).num_rows == 10


def test_a_json_schema_is_fingerprinted_by_what_it_says_not_where_it_is(data, tmp_path, cfg):
    import json

    from overnight.pipeline.output import manifest as mf

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    f = tmp_path / "schema.json"
    f.write_text(json.dumps(schema))
    out = tmp_path / "out"
    run_job(cfg(data, out, input={"limit": 3}, sampling={"json_schema": str(f)}), engine_factory=given(FakeEngine()),
            is_tty=False)
    # the same schema given inline: the same settings
    s = run_job(cfg(data, out, input={"limit": 5}, sampling={"json_schema": json.dumps(schema)}),
                engine_factory=given(FakeEngine()), is_tty=False)
    assert (s.num_resumed, s.num_done) == (3, 5)
    # the file edited: other settings, though its path is the same
    f.write_text(json.dumps(dict(schema, required=["a"])))
    with pytest.raises(OutputError, match=r"sampling.json_schema.required: None -> \['a'\]"):
        run_job(cfg(data, out, sampling={"json_schema": str(f)}), engine_factory=given(FakeEngine()), is_tty=False)
    # an OUT written before stop 37 fingerprinted the path: the same path resumes it
    m = json.loads((out / "manifest.json").read_text())
    m["fingerprint_fields"]["sampling"]["json_schema"] = str(f)
    m["fingerprint"] = mf.fingerprint(m["fingerprint_fields"])
    (out / "manifest.json").write_text(json.dumps(m))
    s = run_job(cfg(data, out, input={"limit": 6}, sampling={"json_schema": str(f)}),
                engine_factory=given(FakeEngine()), is_tty=False)
    assert (s.num_resumed, s.num_done) == (5, 6)
    with pytest.raises(OutputError, match="sampling.json_schema"):
        run_job(cfg(data, out, sampling={"json_schema": json.dumps(schema)}), engine_factory=given(FakeEngine()),
                is_tty=False)


def test_parts_without_manifest_are_refused(data, tmp_path, cfg):
    out = tmp_path / "out"
    run_job(cfg(data, out), engine_factory=given(FakeEngine()), is_tty=False)
    (out / "manifest.json").unlink()
    with pytest.raises(OutputError, match="holds result parts but no manifest.json"):
        run_job(cfg(data, out), engine_factory=given(FakeEngine()), is_tty=False)


def test_engine_failure_keeps_finished_rows(data, tmp_path, cfg):
    out = tmp_path / "out"
    eng = FakeEngine(max_num_seqs=2, fail_after_steps=12)
    with pytest.raises(EngineError, match="The vLLM engine failed mid-run \\(RuntimeError: engine died\\)"):
        run_job(cfg(data, out, output={"flush_rows": 100}), engine_factory=given(eng), is_tty=False)
    done = output(out).column("id").to_pylist()
    assert 0 < len(done) < 10
    m = __import__("json").loads((out / "manifest.json").read_text())
    assert m["state"] == "failed" and "engine died" in m["attempts"][-1]["message"]
    assert m["counts"]["num_done"] == len(done)
    s = run_job(cfg(data, out), engine_factory=given(FakeEngine()), is_tty=False)
    ids = output(out).column("id").to_pylist()
    assert s.state == "completed" and sorted(ids) == sorted(set(ids)) and len(ids) == 10


def test_derived_ids_without_id_column(write_parquet, tmp_path, cfg):
    inp = write_parquet({"prompt": ["a", "b", "c"]}, "data.parquet")
    out = tmp_path / "out"
    run_job(cfg(inp, out, input={"limit": 2}), engine_factory=given(FakeEngine()), is_tty=False)
    run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    assert sorted(output(out).column("id").to_pylist()) == ["data.parquet#0", "data.parquet#1", "data.parquet#2"]


def test_passthrough_none_and_list(data, tmp_path, cfg):
    run_job(cfg(data, tmp_path / "a", input={"passthrough": "none"}), engine_factory=given(FakeEngine()), is_tty=False)
    assert "prompt" not in output(tmp_path / "a").column_names
    run_job(cfg(data, tmp_path / "b", input={"passthrough": ["category"]}), engine_factory=given(FakeEngine()), is_tty=False)
    names = output(tmp_path / "b").column_names
    assert "category" in names and "prompt" not in names


def test_status_file(data, tmp_path, cfg):
    out = tmp_path / "out"
    run_job(cfg(data, out), engine_factory=given(FakeEngine()), is_tty=False)
    st = __import__("json").loads((out / "status.json").read_text())
    assert st["state"] == "completed" and st["exit_code"] == 0
    assert st["rows"] == {"total": 10, "done": 10, "ok": 10, "error": 0, "remaining": 0, "resumed": 0,
                          "duplicates": 0, "changed": 0, "removed": None, "aborted": 0, "in_flight": 0}


def test_null_id_error_rows_are_written_once_across_resumes(write_parquet, tmp_path, cfg):
    inp = write_parquet({"id": pa.array([1, None, 3, None], pa.int64()), "prompt": ["a", "b", "c", "d"]})
    out = tmp_path / "out"
    run_job(cfg(inp, out, input={"limit": 2}), engine_factory=given(FakeEngine()), is_tty=False)
    s = run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    rows = output(out).to_pylist()
    assert sorted((r["id"] is None, r["status"]) for r in rows) == [(False, "ok"), (False, "ok"),
                                                                    (True, "error"), (True, "error")]
    assert sorted(r["error"].split(":")[0] for r in rows if r["id"] is None) == ["in.parquet#1", "in.parquet#3"]
    again = run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    assert output(out).num_rows == 4 and again.num_done == 4 and s.num_done == 4


def test_predictions_are_stored_next_to_actual_lengths(data, tmp_path, cfg):
    out = tmp_path / "out"
    run_job(cfg(data, out), engine_factory=given(FakeEngine()), is_tty=False)
    rows = output(out).to_pylist()
    assert all(r["predicted_tokens"] >= 1 and r["bucket"] is not None for r in rows)


def test_each_row_gets_its_share_of_engine_time_and_the_job_its_cost(tmp_path, cfg, write_parquet):
    import duckdb

    inp = write_parquet({"id": list(range(30)), "prompt": [f"question {i} " + "word " * (i % 7) for i in range(30)]})
    out = tmp_path / "out"
    run_job(cfg(inp, out, input={"limit": 20}), engine_factory=given(FakeEngine(step_sleep=0.002)), is_tty=False)
    s = run_job(cfg(inp, out, output={"price_per_hour": 3.6}), engine_factory=given(FakeEngine(step_sleep=0.002)),
                is_tty=False)
    cost = s.extra["cost"]
    assert cost["engine_seconds"] > 0 and cost["cost"] == pytest.approx(cost["engine_seconds"] / 1000, rel=1e-3)
    # the attempt's cost over the attempt's rows (the 10 left), not over the 30 in OUT
    assert cost["cost_per_1000_rows"] == pytest.approx(cost["engine_seconds"] / 10, rel=0.03)  # (rounded)
    shares = [r[0] for r in duckdb.sql(f"select engine_seconds from read_parquet('{out}/parts/*.parquet')").fetchall()]
    assert len(shares) == 30 and all(x > 0 for x in shares)
    shares = [r[0] for r in duckdb.sql(f"select engine_seconds from read_parquet('{out}/parts/*.parquet') "
                                       f"order by finished_at desc limit 10").fetchall()]
    # every step's time is split among the rows in it: this attempt's rows' shares add up to its engine time
    assert sum(shares) == pytest.approx(cost["engine_seconds"], rel=0.02)
    assert f"engine-hours, {cost['cost_per_1000_rows']:.4f} per 1,000 rows)" in s.line() and "cost 0.0" in s.line()


def test_a_completed_job_over_an_unchanged_input_knows_at_once(tmp_path, cfg, write_parquet, monkeypatch):
    import os

    from overnight.pipeline.output.checkpoint import OutputDir

    inp = write_parquet({"id": list(range(12)), "prompt": [f"q {i}" for i in range(12)]})
    out = tmp_path / "out"
    starts = []

    def factory(job):
        starts.append(1)
        return FakeEngine()

    assert run_job(cfg(inp, out), engine_factory=factory, is_tty=False).num_ok == 12
    scans = []
    real = OutputDir.scan
    monkeypatch.setattr(OutputDir, "scan", lambda self, *a, **k: scans.append(1) or real(self, *a, **k))
    s = run_job(cfg(inp, out), engine_factory=factory, is_tty=False)
    assert (s.exit_code, s.num_done, s.num_resumed) == (0, 12, 12) and "unchanged" in s.message
    assert scans == [] and starts == [1]            # neither the parts nor the input were read; no engine
    os.utime(inp, (1, 1))                          # the input file changed (its time): a real resume pass
    s = run_job(cfg(inp, out), engine_factory=factory, is_tty=False)
    assert s.num_resumed == 12 and scans and starts == [1]
    s = run_job(cfg(inp, out, input={"limit": 5}), engine_factory=factory, is_tty=False)   # another --limit
    assert "unchanged" not in (s.message or "")


def test_a_completed_job_whose_part_was_deleted_answers_its_rows_again(tmp_path, cfg, write_parquet):
    # a bad part's message says to delete it and rerun: the input is unchanged, but the job is no longer complete
    import os

    from overnight.pipeline.output.checkpoint import OutputDir

    inp = write_parquet({"id": list(range(12)), "prompt": [f"q {i}" for i in range(12)]})
    out = tmp_path / "out"
    assert run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False).num_ok == 12
    parts = OutputDir(str(out)).part_paths()
    assert len(parts) >= 2
    lost = pq.read_table(parts[0]).num_rows
    os.remove(parts[0])
    s = run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    assert "unchanged" not in (s.message or "")
    assert (s.num_done, s.num_resumed) == (12, 12 - lost)
    assert sorted(pq.read_table(str(out / "parts")).column("id").to_pylist()) == list(range(12))
