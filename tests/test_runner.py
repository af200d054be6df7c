"""The run loop with a fake engine and the tiny model's tokenizer: resume, duplicates, error rows, parts, failures."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fakes import TINY_TEMPLATE_TOKENS, FakeClock, FakeEngine, given
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


def deadline_data(write_parquet, n=40):
    # A bimodal mix like the real one (short math answers, long essays): every third prompt is long, and the
    # fake engine answers long prompts at length; the heuristic's estimate grows with prompt length too.
    prompts = [" ".join(["tell me about the weather"] * (12 if i % 3 == 0 else 1)) for i in range(n)]
    return write_parquet({"id": [f"r{i:02d}" for i in range(n)], "prompt": prompts})


def budget_run(cfg, inp, out, policy, budget="60s", **kw):
    clock = FakeClock()
    eng = FakeEngine(max_num_seqs=2, clock=clock, step_seconds=1.0, length_of=lambda ids: max(2, (len(ids) - 30) // 2))
    return run_job(cfg(inp, out, scheduler={"time_budget": budget, "policy": policy, **kw}), engine_factory=given(eng),
                   is_tty=False, clock=clock), eng


def test_time_budget_stops_early_exit_75_and_rerun_completes(write_parquet, tmp_path, cfg, caplog):
    inp = deadline_data(write_parquet)
    out = tmp_path / "out"
    with caplog.at_level("INFO", logger="overnight"):
        s, eng = budget_run(cfg, inp, out, "fifo")
    assert (s.state, s.exit_code) == ("partial", 75)
    assert 0 < s.num_done < 40
    assert s.message == f"deadline reached: {40 - s.num_done} rows not done; rerun the same command to continue"
    assert "deadline at risk: the remaining ~" in caplog.text and "remaining rows to be left undone" in caplog.text
    assert "deadline reached: stopped admitting rows;" in caplog.text and "(a signal ends the drain within --grace, a second" in caplog.text
    st = __import__("json").loads((out / "status.json").read_text())
    assert st["state"] == "partial" and st["exit_code"] == 75 and st["rows"]["remaining"] == 40 - s.num_done
    # the last status.json gives the outcome where the forecast stood, and the last forecast beside it
    f = st["forecast"]
    assert f["will_miss"] is True and f["deadline"] and f["eta_s"] is None and f["eta_range_s"] is None
    assert f["remaining_rows"] == f["rows_expected_left"] == 40 - s.num_done and f["time_left_s"] == 0.0
    assert f["last"]["will_miss"] is True and f["last"]["rows_expected_left"] is not None
    again = run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    ids = output(out).column("id").to_pylist()
    assert again.state == "completed" and sorted(ids) == [f"r{i:02d}" for i in range(40)] and len(set(ids)) == 40
    f = __import__("json").loads((out / "status.json").read_text())["forecast"]
    assert (f["eta_s"], f["remaining_rows"], f["remaining_tokens_predicted"], f["will_miss"]) == (0.0, 0, 0, False)
    assert f["last"]["remaining_rows"] > 0    # the last forecast, before the last rows finished


def test_a_budget_the_engines_start_up_takes_whole_says_so_and_the_rerun_is_warned(write_parquet, tmp_path, cfg,
                                                                                   caplog):
    """A --time-budget shorter than the engine's start-up exits 75 with no row done, and every rerun would do the
    same: the message says why, and a rerun with less time left than the last start-up is warned before it starts."""
    import json

    inp = write_parquet({"id": list(range(6)), "prompt": ["hi there"] * 6})
    out = tmp_path / "out"

    clock = FakeClock()

    def slow_start(job):
        clock.t += 120.0   # the budget's stop comes while the engine starts
        return FakeEngine()

    s = run_job(cfg(inp, out, scheduler={"time_budget": "60s"}), engine_factory=slow_start, is_tty=False,
                clock=clock)
    assert (s.state, s.exit_code, s.num_done) == ("partial", 75, 0)
    assert s.message.startswith("deadline reached: 6 rows not done; rerun the same command to continue (the engine "
                                "took ") and "and the stop came before it was ready" in s.message, s.message
    st = json.loads((out / "status.json").read_text())
    assert st["startup"]["engine_start_s"] is not None and st["startup"]["first_row_s"] is None
    st["startup"]["engine_start_s"] = 60.0   # (the fake engine started at once: the clock moved, not time)
    (out / "status.json").write_text(json.dumps(st))
    with caplog.at_level("WARNING", logger="overnight"):
        again = run_job(cfg(inp, out, scheduler={"time_budget": "30s"}), engine_factory=given(FakeEngine()),
                        is_tty=False)
    assert "are left before the stop, and the engine took 1m00s to start in the last attempt" in caplog.text
    assert again.state == "completed" and "no row started" not in (again.message or "")


def test_auto_completes_more_rows_than_fifo_by_the_deadline(write_parquet, tmp_path, cfg):
    inp = deadline_data(write_parquet)
    fifo, _ = budget_run(cfg, inp, tmp_path / "fifo", "fifo")
    auto, eng = budget_run(cfg, inp, tmp_path / "auto", "auto")
    assert auto.num_done >= 2 * fifo.num_done, (auto.num_done, fifo.num_done)
    assert auto.extra["forecast"]["mode"] == "deadline"
    assert len(set(eng.priorities.values())) > 1  # vLLM's own priority queue orders what waits in the engine


def test_abort_on_deadline_leaves_in_flight_rows_not_done(write_parquet, tmp_path, cfg):
    inp = deadline_data(write_parquet)
    s, eng = budget_run(cfg, inp, tmp_path / "out", "fifo", on_deadline="abort")
    assert s.state == "partial" and len(eng.aborted) > 0
    done = set(output(tmp_path / "out").column("id").to_pylist())
    assert len(done) == s.num_done


def test_predictions_are_stored_next_to_actual_lengths(data, tmp_path, cfg):
    out = tmp_path / "out"
    run_job(cfg(data, out), engine_factory=given(FakeEngine()), is_tty=False)
    rows = output(out).to_pylist()
    assert all(r["predicted_tokens"] >= 1 and r["bucket"] is not None for r in rows)


def test_per_row_deadline_that_passed_becomes_an_error_row(write_parquet, tmp_path, cfg):
    import datetime as dt
    past = dt.datetime(2020, 1, 1)
    inp = write_parquet({"id": ["a", "b"], "prompt": ["x", "y"], "deadline": pa.array([past, None], pa.timestamp("s"))})
    run_job(cfg(inp, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    rows = {r["id"]: r for r in output(tmp_path / "out").to_pylist()}
    assert rows["b"]["status"] == "ok"
    assert rows["a"]["error"] == "in.parquet#0: its deadline 2020-01-01T00:00:00+00:00 passed before the row could start"


def test_each_row_gets_its_share_of_engine_time_and_the_job_its_cost(tmp_path, cfg, write_parquet):
    import duckdb

    inp = write_parquet({"id": list(range(30)), "prompt": [f"question {i} " + "word " * (i % 7) for i in range(30)]})
    out = tmp_path / "out"
    s = run_job(cfg(inp, out, output={"price_per_hour": 3.6}), engine_factory=given(FakeEngine(step_sleep=0.002)),
                is_tty=False)
    cost = s.extra["cost"]
    assert cost["engine_seconds"] > 0 and cost["cost"] == pytest.approx(cost["engine_seconds"] / 1000, rel=1e-3)
    shares = [r[0] for r in duckdb.sql(f"select engine_seconds from read_parquet('{out}/parts/*.parquet')").fetchall()]
    assert len(shares) == 30 and all(x > 0 for x in shares)
    # every step's time is split among the rows in it: the rows' shares add up to the engine's time
    assert sum(shares) == pytest.approx(cost["engine_seconds"], rel=0.02)
    assert "cost 0.0" in s.line() and "engine-hours" in s.line()


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


def test_a_forecast_kept_waiting_does_not_put_the_next_ones_off(write_parquet, tmp_path, cfg, monkeypatch):
    """The loop forecasts every 2 s, or less often where a forecast's own cost would take over 0.2% of its time.
    A forecast held up 60 ms by a busy machine (here a sleep: no CPU time of its own) is not a costly one: at
    500 x its wall time the next would come 30 s later."""
    import time

    from overnight.pipeline.scheduling.deadline import DeadlineTracker

    calls = []
    forecast_job = DeadlineTracker.forecast_job

    def kept_waiting(self, *a, **k):
        calls.append(self.clock())
        time.sleep(0.06)
        return forecast_job(self, *a, **k)

    monkeypatch.setattr(DeadlineTracker, "forecast_job", kept_waiting)
    s, _ = budget_run(cfg, deadline_data(write_parquet), tmp_path / "out", "fifo", budget="10m")
    assert s.state == "completed"
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    assert len(calls) >= 10 and sorted(gaps)[len(gaps) // 2] < 15.0, gaps  # its own CPU time: 2-6 s apart here


def test_a_finished_run_gives_no_stale_eta(write_parquet, tmp_path, cfg):
    # the last forecast is not a time to anything once the run ended: 0 once completed, none once stopped
    inp = deadline_data(write_parquet)
    s, _ = budget_run(cfg, inp, tmp_path / "done", "fifo", budget="1h")
    st = __import__("json").loads((tmp_path / "done" / "status.json").read_text())
    assert s.state == "completed" and st["eta_s"] == 0.0
    s, _ = budget_run(cfg, inp, tmp_path / "stopped", "fifo")
    st = __import__("json").loads((tmp_path / "stopped" / "status.json").read_text())
    assert s.state == "partial" and st["eta_s"] is None


def test_the_deadline_shown_is_the_deadline_not_the_stop_for_new_rows(write_parquet, tmp_path, cfg):
    """The progress line's "deadline in", status.json's and the report's deadline: the one given (new rows stop a
    safety margin, here 20 s of the 60 s budget, before it; it showed that stop)."""
    import json

    out = tmp_path / "out"
    s, _ = budget_run(cfg, deadline_data(write_parquet), out, "fifo", safety_margin_s=20.0)
    assert s.exit_code == 75
    left = [x["deadline_left_s"] for x in json.loads((out / "timeline.json").read_text())
            if x.get("deadline_left_s") is not None]
    # (it counts down by the real clock between the fake clock's forecasts: microseconds that a busy machine
    # makes milliseconds, against the fake clock's one-second steps)
    assert left[0] > 50 and all(b <= a + 0.5 for a, b in zip(left, left[1:])), left    # 40 s and less before
    assert min(left) < 20                                                 # shown while the rows in flight drain
