"""Resume at its edges (found by a review, stop 40): ids whose kind changed, results no longer in the input while
a run goes on, duplicates on an unchanged rerun, a prompt given where there was none, damaged progress files,
--fresh over shards, and a sharded job with a shard not started yet."""

from __future__ import annotations

import json
import os
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fakes import FakeEngine, given
from overnight.pipeline.api import run_job
from overnight.pipeline.output.checkpoint import OutputError
from overnight.pipeline.tools.inspection import open_results, summary_lines
from overnight.pipeline.tools.status import job_status


def test_ids_of_another_kind_are_refused_not_answered_again(tmp_path, cfg, write_parquet):
    out = tmp_path / "out"
    inp = write_parquet({"id": pa.array([1, 2, 3], pa.int64()), "prompt": ["a", "b", "c"]})
    run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    write_parquet({"id": pa.array([1, 2, 3], pa.int32()), "prompt": ["a", "b", "c"]})   # another width: the same
    assert run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False).num_resumed == 3
    write_parquet({"id": ["1", "2", "3"], "prompt": ["a", "b", "c"]})                   # 1 and "1" never match
    with pytest.raises(OutputError, match=r"part-00000.parquet holds integer ids, but the input's id column is now "
                                          r"string: .*\(cast it\), or pass --fresh"):
        run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    s = run_job(cfg(inp, out), fresh=True, engine_factory=given(FakeEngine()), is_tty=False)
    assert (s.num_ok, s.num_resumed) == (3, 0)


def test_a_rerun_counts_the_error_rows_of_null_ids_as_already_done(tmp_path, cfg, write_parquet):
    """A row without an id is an error row, matched on a resume by its origin: it is not answered again, and it
    counts among the rows already done (it did not: 3 of 5)."""
    out = tmp_path / "out"
    inp = write_parquet({"id": ["a", None, "b", None, "c"], "prompt": ["hi"] * 5})
    s = run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    assert (s.num_ok, s.num_error) == (3, 2)
    write_parquet({"id": ["a", None, "b", None, "c", "d"], "prompt": ["hi"] * 6})   # one row more: a full pass
    s = run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    assert (s.num_resumed, s.num_ok, s.num_error, s.num_done) == (5, 4, 2, 6)


def test_results_no_longer_in_the_input_are_not_counted_done_once_it_is_read(tmp_path, cfg, write_parquet):
    out = tmp_path / "out"
    inp = write_parquet({"id": list(range(20)), "prompt": ["hi"] * 20})
    run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    write_parquet({"id": list(range(100, 120)), "prompt": ["hi"] * 20})       # 20 new ids, the 20 old ones gone
    with pytest.raises(Exception, match="engine died"):                      # stopped with rows left
        run_job(cfg(inp, out, engine={"max_restarts": 0}), engine_factory=given(FakeEngine(fail_after_steps=6)),
                is_tty=False)
    rows = json.loads((out / "status.json").read_text())["rows"]
    assert rows["removed"] == 20 and 0 < rows["done"] < 20 and rows["remaining"] == 20 - rows["done"]
    s = job_status(str(out))
    assert (s["rows_done"], s["rows_left"]) == (rows["done"], rows["remaining"])   # not 20 done, 0 left
    con, m = open_results(str(out))
    assert f"{rows['remaining']} not done; 20 no longer in the input, not counted as done" in summary_lines(con, m)[2]


def test_an_unchanged_rerun_keeps_the_duplicates(tmp_path, cfg, write_parquet):
    out = tmp_path / "out"
    inp = write_parquet({"id": [1, 2, 2, 3, 3, 4], "prompt": list("abcdef")})
    for _ in range(2):                                                       # the second: nothing to do
        run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
        rows = json.loads((out / "status.json").read_text())["rows"]
        assert (rows["done"], rows["remaining"], rows["duplicates"]) == (4, 0, 2)


def test_a_prompt_given_where_there_was_none_shows_as_changed(tmp_path, cfg, write_parquet):
    out = tmp_path / "out"
    inp = write_parquet({"id": [1, 2, 3], "prompt": ["a", None, "  "]})
    assert run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False).num_error == 2
    write_parquet({"id": [1, 2, 3], "prompt": ["a", "fixed", "fixed too"]})
    run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    assert json.loads((out / "status.json").read_text())["rows"]["changed"] == 2   # the null one too


def test_damaged_progress_files_are_read_as_absent(tmp_path, cfg, write_parquet, caplog):
    out = tmp_path / "out"
    inp = write_parquet({"id": [1, 2, 3], "prompt": ["a", "b", "c"]})
    run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    (out / "status.json").write_text('{"state": "runn')
    (out / "timeline.json").write_text('[{"t": 1')
    assert job_status(str(out))["state"] == "completed"                     # the manifest's word
    write_parquet({"id": [1, 2, 3, 4], "prompt": ["a", "b", "c", "d"]})
    with caplog.at_level(logging.WARNING, logger="overnight"):
        s = run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    assert (s.num_ok, s.num_resumed) == (4, 3)
    assert any("timeline.json is damaged" in m and "read as absent" in m for m in caplog.messages)
    assert json.loads((out / "status.json").read_text())["state"] == "completed"   # written again


def _files(tmp_path, n: int = 2):
    inp = tmp_path / "in"
    inp.mkdir()
    for k in range(n):
        pq.write_table(pa.table({"id": [k * 100 + i for i in range(5)], "prompt": ["hi"] * 5}), inp / f"f{k}.parquet")
    return inp


def test_fresh_starts_a_sharded_job_over_with_new_settings(tmp_path, cfg):
    inp, out = _files(tmp_path), tmp_path / "out"
    for k in range(2):
        run_job(cfg(inp, out, cluster={"shard": f"{k}/2"}), engine_factory=given(FakeEngine()), is_tty=False)
    new = {"max_tokens": 20}
    with pytest.raises(OutputError, match="ran with other settings .* run every shard again with --fresh"):
        run_job(cfg(inp, out, cluster={"shard": "0/2"}, sampling=new), engine_factory=given(FakeEngine()),
                is_tty=False)
    for k in range(2):
        s = run_job(cfg(inp, out, cluster={"shard": f"{k}/2"}, sampling=new), fresh=True,
                    engine_factory=given(FakeEngine()), is_tty=False)
        assert (s.num_ok, s.num_resumed) == (5, 0)
    with pytest.raises(OutputError, match="ran with other settings"):        # the old settings now differ
        run_job(cfg(inp, out, cluster={"shard": "1/2"}), engine_factory=given(FakeEngine()), is_tty=False)


def test_a_shard_not_started_leaves_the_jobs_rows_unknown(tmp_path, cfg):
    inp, out = _files(tmp_path), tmp_path / "out"
    run_job(cfg(inp, out, cluster={"shard": "0/2"}), engine_factory=given(FakeEngine()), is_tty=False)
    con, m = open_results(str(out))
    lines = summary_lines(con, m)
    assert "(? rows)" in lines[1] and "rows: 5 (5 ok, 0 error, and the rows of 1 shard not started)" in lines[2]


def test_a_rerun_with_nothing_to_do_keeps_the_measured_rate(tmp_path, cfg, write_parquet):
    """`plan --out` reads the token rate the last run measured from status.json: a rerun that found every row
    done (by the input's stamp, or by reading it all) wrote a status without it, and plan's ETA became unknown."""
    import os

    from overnight.pipeline.scheduling.plan import measured_throughput

    out = tmp_path / "out"
    inp = write_parquet({"id": list(range(20)), "prompt": ["hi there"] * 20})
    run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    rate = measured_throughput(str(out))
    assert rate and rate > 0
    s = run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)     # the stamp: nothing read
    assert s.message.startswith("nothing to do") and measured_throughput(str(out)) == rate
    os.utime(inp, (1, 1))                                                             # read it all: every row done
    s = run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    assert s.num_resumed == 20 and measured_throughput(str(out)) == rate
    st = job_status(str(out))
    assert (st["state"], st["rows_done"], st["eta_s"]) == ("completed", 20, 0.0)


def test_plan_counts_the_start_up_the_last_run_measured(tmp_path, cfg, write_parquet):
    """`plan --out`'s ETA and deadline count the engine's start-up as the last run there measured it (they left
    it out, where a --time-budget includes it)."""
    from overnight.pipeline.scheduling.plan import make_plan

    out = tmp_path / "out"
    inp = write_parquet({"id": list(range(40)), "prompt": ["hi there"] * 40})
    assert make_plan(cfg(inp, out), out=str(out), throughput=100.0).startup_s is None   # no run there yet
    run_job(cfg(inp, out, input={"limit": 10}), engine_factory=given(FakeEngine()), is_tty=False)
    st = json.loads((out / "status.json").read_text())
    st["startup"]["first_row_s"] = 40.0   # (the test's process was born long before its run)
    (out / "status.json").write_text(json.dumps(st))
    p = make_plan(cfg(inp, out), out=str(out), throughput=100.0)
    assert p.num_todo == 30 and p.startup_s == 40.0
    # (the predictions scaled by the 10 rows done there: the echo's answers are far shorter than predicted)
    assert p.calibration_rows == 10 and 0 < p.calibration < 0.5
    assert p.eta_s == pytest.approx(p.predicted_tokens * p.calibration / 100.0 + 40.0)
    # a budget the rows' tokens alone would fit with 20 s to spare, but not after the start-up
    budget = p.predicted_tokens * p.calibration / 10.0 + 20
    tight = make_plan(cfg(inp, out, scheduler={"time_budget": f"{budget:.0f}s", "safety_margin_s": 0}),
                      out=str(out), throughput=10.0)
    assert p.predicted_tokens * p.calibration > 30 and tight.is_feasible is False and tight.rows_left > 0


def test_plan_scales_the_predictions_by_the_rows_done_in_out(tmp_path, cfg, write_parquet):
    """A run's forecast scales the predictions by the rows it finished; plan --out does the same with the rows
    done there (its ETA was 33% short on the demo's second half: predicted 17,422 output tokens, 28,339 came)."""
    import duckdb

    from overnight.pipeline.scheduling.plan import CALIBRATION_ROWS, make_plan

    out = tmp_path / "out"
    inp = write_parquet({"id": list(range(60)), "prompt": [f"question {i} " + "word " * (i % 9) for i in range(60)]})
    run_job(cfg(inp, out, input={"limit": CALIBRATION_ROWS - 1}), engine_factory=given(FakeEngine()), is_tty=False)
    few = make_plan(cfg(inp, out), out=str(out), throughput=100.0)
    assert (few.calibration, few.calibration_rows) == (None, CALIBRATION_ROWS - 1)   # too few rows to go by
    assert few.eta_s == pytest.approx(few.predicted_tokens / 100.0 + few.startup_s)
    run_job(cfg(inp, out, input={"limit": 30}), engine_factory=given(FakeEngine()), is_tty=False)
    (actual, predicted), = duckdb.sql(f"select sum(output_tokens), sum(predicted_tokens) from "
                                      f"read_parquet('{out}/parts/*.parquet')").fetchall()
    p = make_plan(cfg(inp, out, scheduler={"time_budget": "1h"}), out=str(out), throughput=100.0)
    assert p.num_todo == 30 and p.calibration_rows == 30 and p.calibration == pytest.approx(actual / predicted)
    assert p.eta_s == pytest.approx(p.predicted_tokens * p.calibration / 100.0 + p.startup_s)
    assert p.is_feasible and p.rows_left == 0 and p.tokens_left == 0
    # another predictor than the runs there used: plan predicts the rows done with its own, and scales by that
    other = make_plan(cfg(inp, out, buckets={"predictor": "heuristic"}), out=str(out), throughput=100.0)
    assert other.calibration_rows == 30 and other.calibration == pytest.approx(p.calibration)  # (the online's prior)
    assert other.eta_s == pytest.approx(other.predicted_tokens * other.calibration / 100.0 + other.startup_s)


def test_plans_factor_is_over_its_own_predictions_not_those_the_run_recorded(tmp_path, cfg, write_parquet):
    """The online predictor records its prior's predictions for a run's first rows and its refits' after; plan
    predicts with the prior. Its factor went by the recorded ones: on GSM8K 1.18x, where the rows ran 1.57x the
    prior's. Here the recorded predictions are tripled, as a refit might, and the factor must not move."""
    import pyarrow.compute as pc

    from overnight.pipeline.scheduling.plan import make_plan

    out = tmp_path / "out"
    inp = write_parquet({"prompt": [f"question {i} " + "word " * (i % 9) for i in range(60)]})  # ids: file#row
    run_job(cfg(inp, out, input={"limit": 30}), engine_factory=given(FakeEngine()), is_tty=False)
    before = make_plan(cfg(inp, out), out=str(out), throughput=100.0)
    assert before.num_todo == 30 and before.calibration_rows == 30
    for part in (out / "parts").glob("*.parquet"):
        t = pq.read_table(part)
        i = t.schema.get_field_index("predicted_tokens")
        pq.write_table(t.set_column(i, "predicted_tokens", pc.multiply(t.column(i), 3)), part)
    after = make_plan(cfg(inp, out), out=str(out), throughput=100.0)
    assert after.calibration_rows == 30 and after.calibration == pytest.approx(before.calibration)
    assert after.eta_s == pytest.approx(before.eta_s)


def test_plans_scaled_rows_never_run_past_their_max_tokens(tmp_path, cfg, write_parquet, monkeypatch):
    from overnight.pipeline.scheduling import plan as planmod

    out = tmp_path / "out"
    inp = write_parquet({"id": list(range(20)), "prompt": [f"question {i}" for i in range(20)],
                         "max_tokens": [5, None] * 10})
    run_job(cfg(inp, out, input={"limit": 10}, sampling={"max_tokens": 64}), engine_factory=given(FakeEngine()),
            is_tty=False)
    monkeypatch.setattr(planmod, "measured_calibration", lambda *args: (1000.0, 10))
    p = planmod.make_plan(cfg(inp, out, sampling={"max_tokens": 64}), out=str(out), throughput=10.0)
    assert p.num_todo == 10 and p.eta_s == pytest.approx((5 * 5 + 5 * 64) / 10.0 + p.startup_s)


def test_plan_counts_a_ray_workers_start_up(tmp_path, cfg, write_parquet):
    """A Ray job's folders are its workers': their start-up was left out ("not counting the start-up, which no
    run in --out measured"), where a worker took 33 s to its first row."""
    from overnight.pipeline.output.layout import worker_out
    from overnight.pipeline.scheduling.plan import make_plan

    out = tmp_path / "out"
    inp = write_parquet({"id": list(range(20)), "prompt": ["hi there"] * 20})
    w0 = worker_out(str(out), 0).root
    run_job(cfg(inp, w0, input={"limit": 10}), engine_factory=given(FakeEngine()), is_tty=False)
    st = json.loads((tmp_path / "out" / "workers" / os.path.basename(w0) / "status.json").read_text())
    st["startup"]["first_row_s"] = 33.0
    (tmp_path / "out" / "workers" / os.path.basename(w0) / "status.json").write_text(json.dumps(st))
    assert make_plan(cfg(inp, out), out=str(out), throughput=100.0).startup_s == 33.0


def test_plan_goes_on_unscaled_when_the_rows_done_cannot_be_matched(tmp_path, cfg, write_parquet, monkeypatch,
                                                                    caplog):
    from overnight.pipeline.scheduling import plan as planmod

    def broken(*args):
        raise ValueError("Binder Error: cannot compare VARCHAR and BIGINT")

    out = tmp_path / "out"
    inp = write_parquet({"id": list(range(40)), "prompt": [f"question {i}" for i in range(40)]})
    run_job(cfg(inp, out, input={"limit": 20}), engine_factory=given(FakeEngine()), is_tty=False)
    monkeypatch.setattr(planmod, "done_lengths", broken)
    with caplog.at_level(logging.WARNING, logger="overnight"):
        p = planmod.make_plan(cfg(inp, out), out=str(out), throughput=10.0)
    assert p.num_todo == 20 and (p.calibration, p.calibration_rows) == (None, 0)
    assert "could not be matched with their results (ValueError: Binder Error" in caplog.text
