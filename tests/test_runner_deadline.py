"""The run loop against a deadline, with a fake engine and clock: a time budget's stop and exit 75, the start-up
that takes a budget whole, auto against fifo, aborts, a row's own deadline, the forecast's pace and the deadline
shown (tests/test_runner.py: the loop's rows, parts and resumes)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq

from fakes import FakeClock, FakeEngine, given
from overnight.pipeline.api import run_job


def output(out) -> pa.Table:
    return pq.read_table(f"{out}/parts")


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


def test_abort_on_deadline_leaves_in_flight_rows_not_done(write_parquet, tmp_path, cfg, caplog):
    inp = deadline_data(write_parquet)
    with caplog.at_level("WARNING", logger="overnight"):
        s, eng = budget_run(cfg, inp, tmp_path / "out", "fifo", on_deadline="abort")
    assert s.state == "partial" and len(eng.aborted) > 0
    # said as it is: no drain, so no word of a signal ending one
    assert f"deadline reached: stopped admitting rows; {len(eng.aborted)} rows in flight, aborting them" in caplog.text
    assert "--grace" not in caplog.text
    done = set(output(tmp_path / "out").column("id").to_pylist())
    assert len(done) == s.num_done


def test_per_row_deadline_that_passed_becomes_an_error_row(write_parquet, tmp_path, cfg):
    import datetime as dt
    past = dt.datetime(2020, 1, 1)
    inp = write_parquet({"id": ["a", "b"], "prompt": ["x", "y"], "deadline": pa.array([past, None], pa.timestamp("s"))})
    run_job(cfg(inp, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    rows = {r["id"]: r for r in output(tmp_path / "out").to_pylist()}
    assert rows["b"]["status"] == "ok"
    assert rows["a"]["error"] == "in.parquet#0: its deadline 2020-01-01T00:00:00+00:00 passed before the row could start"


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


def test_forecasts_near_a_deadline_come_at_least_every_tenth_of_the_time_left(write_parquet, tmp_path, cfg,
                                                                              monkeypatch):
    """A forecast that costs 20 ms of CPU puts the next 10 s off (0.2% of the loop's time); with a deadline the
    next comes within a tenth of the time left, never sooner than every 2 s (on a GPU the warning otherwise came 6 s
    after the forecast at 5% of rows, with a third of them done)."""
    import time

    from overnight.pipeline.clockwork import forecast_spacing
    from overnight.pipeline.scheduling.deadline import DeadlineTracker

    assert forecast_spacing(0.02) == 10.0 and forecast_spacing(0.001) == 2.0
    assert forecast_spacing(0.02, 40.0) == 4.0 and forecast_spacing(0.02, 5.0) == 2.0
    # and at most a tenth of the time since the loop's first tick: the first forecasts change most
    assert forecast_spacing(0.02, elapsed=30.0) == 3.0 and forecast_spacing(0.02, elapsed=300.0) == 10.0
    assert forecast_spacing(0.2, elapsed=30.0) == 10.0  # but at most 2% of the loop: 50 times a costly one
    calls = []
    forecast_job = DeadlineTracker.forecast_job

    def costly(self, *a, **k):
        calls.append((self.clock(), self.time_left()))
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.02:
            pass
        return forecast_job(self, *a, **k)

    monkeypatch.setattr(DeadlineTracker, "forecast_job", costly)
    budget_run(cfg, deadline_data(write_parquet), tmp_path / "out", "fifo", budget="60s")
    gaps = [(b[0] - a[0], a[1]) for a, b in zip(calls, calls[1:])]
    assert len(gaps) >= 5, gaps
    assert all(gap <= max(2.0, 0.1 * left) + 1.0 for gap, left in gaps), gaps  # + a tick: the loop's pace


def counted_forecasts(monkeypatch) -> list:
    """(the forecast's rows left, the tally's rows left, the rows this attempt has done, the input rows read) at
    each forecast. The rows read first: the input thread reads on meanwhile, and the two counts after it go by at
    least as many."""
    from overnight.pipeline.scheduling.deadline import DeadlineTracker

    seen = []
    forecast_job = DeadlineTracker.forecast_job

    def counted(self, scheduler, tally, *a):
        read = tally.num_read
        left = tally.num_left
        f = forecast_job(self, scheduler, tally, *a)
        seen.append((f.remaining_rows, left, tally.num_done - tally.done_before, read))
        return f

    monkeypatch.setattr(DeadlineTracker, "forecast_job", counted)
    return seen


def test_the_forecast_counts_the_rows_waiting_in_the_input_stages_queue(write_parquet, tmp_path, cfg, monkeypatch):
    """Once the scheduler's pool is full (scheduler.lookahead_rows), the input thread holds a few prepared batches
    that are read but not pooled. The forecast took them for neither: a 20k-row job on the echo engine (a pool of
    10k) left 4k rows out, and its ETA was 31% short at 25% of the rows (docs/BENCHMARKS.md)."""
    seen = counted_forecasts(monkeypatch)
    inp = write_parquet({"id": list(range(400)), "prompt": [f"say something about item {i}" for i in range(400)]})
    clock = FakeClock()
    eng = FakeEngine(max_num_seqs=4, clock=clock, step_seconds=1.0)
    s = run_job(cfg(inp, tmp_path / "out", input={"batch_rows": 10}, scheduler={"lookahead_rows": 20}),
                engine_factory=given(eng), is_tty=False, clock=clock)
    assert s.state == "completed" and len(seen) > 20
    # every row not done, and no other: in the engine, in the pool, in the input stage's queue, or not read yet
    assert all(rows == left for rows, left, *_ in seen), [x for x in seen if x[0] != x[1]][:5]


def test_the_first_forecasts_come_at_least_every_tenth_of_the_time_so_far(write_parquet, tmp_path, cfg, monkeypatch):
    """Without a deadline, a forecast that costs 20 ms of CPU puts the next 10 s off; in a job's first minutes the
    next comes within a tenth of the time since the loop began (a 20k-row job's forecast over a pool of 10k rows
    put the next 8-14 s off, and its ETA at 10% of the rows was its first seconds' one, counted down)."""
    import time

    from overnight.pipeline.scheduling.deadline import DeadlineTracker

    calls = []
    forecast_job = DeadlineTracker.forecast_job

    def costly(self, *a, **k):
        calls.append(self.clock())
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.02:
            pass
        return forecast_job(self, *a, **k)

    monkeypatch.setattr(DeadlineTracker, "forecast_job", costly)
    import overnight.pipeline.clockwork as clockwork

    cpu = []  # each forecast's CPU time as the loop measured it (20 ms and the forecast's own)
    spacing = clockwork.forecast_spacing
    monkeypatch.setattr(clockwork, "forecast_spacing", lambda cpu_s, *a: cpu.append(cpu_s) or spacing(cpu_s, *a))
    s, _ = budget_run(cfg, deadline_data(write_parquet, n=60), tmp_path / "out", "fifo", budget="10h")
    assert s.state == "completed"
    start = calls[0]
    gaps = [(b - a, a - start, c) for a, b, c in zip(calls, calls[1:], cpu)]
    assert len(gaps) >= 10 and calls[-1] - start > 100, gaps  # well past the first 100 s (a tenth: 10 s)
    # + a tick: the loop's pace; never sooner than 50 times a forecast's CPU time (on a busy machine, 60 ms and more)
    assert all(gap <= max(2.0, 0.1 * (since + 1.0), 50 * c) + 1.0 for gap, since, c in gaps), gaps
    first = [(gap, c) for gap, since, c in gaps if since < 20]
    assert len(first) >= 5 and all(gap < 250 * c for gap, c in first), gaps  # not 500 times their CPU time apart


def test_a_rerun_with_a_lower_limit_counts_only_the_rows_done_within_it(write_parquet, tmp_path, cfg, monkeypatch):
    """OUT holds 60 rows; the input now starts with 30 new ones, and --limit 40 keeps those and 10 done. The
    progress began at min(60, 40) rows done ("66/350 rows (105%)" in a run like it, ETA 0s), and the forecast took
    all 60 for rows of this job (none left). A pass over the limit's ids finds the 10 done within it."""
    from overnight.pipeline.progress import Progress

    seen, started = counted_forecasts(monkeypatch), []

    init = Progress.__init__

    def begun(self, total, done, *a, **k):
        started.append((done, total))
        init(self, total, done, *a, **k)

    monkeypatch.setattr(Progress, "__init__", begun)
    old = {"id": [f"old{i}" for i in range(60)], "prompt": [f"say something about item {i}" for i in range(60)]}
    inp = write_parquet(old)
    out = tmp_path / "out"
    assert run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False).num_ok == 60
    write_parquet({"id": [f"new{i}" for i in range(30)] + old["id"],
                   "prompt": [f"tell me about thing {i}" for i in range(30)] + old["prompt"]})
    seen.clear()
    clock = FakeClock()
    eng = FakeEngine(max_num_seqs=4, clock=clock, step_seconds=1.0)
    s = run_job(cfg(inp, out, input={"limit": 40, "batch_rows": 10}), engine_factory=given(eng), is_tty=False,
                clock=clock)
    assert s.state == "completed" and (s.num_done, s.num_resumed, s.num_ok) == (40, 10, 90)
    assert started[-1] == (10, 40)
    assert json.loads((out / "manifest.json").read_text())["counts"]["num_outside"] == 50
    assert seen and seen[0][1] == 30 and all(rows == left for rows, left, *_ in seen), seen[:5]
    assert "the output holds 50 rows beyond this input's" in s.line()


def test_an_input_replaced_by_another_is_not_forecast_as_done(write_parquet, tmp_path, cfg, monkeypatch, caplog):
    """OUT holds 60 rows whose ids the input no longer has (it was replaced, and no --fresh given). Which are gone is
    known once the input is read whole. The forecast counted all 60 as this job's, so rows read but waiting in the
    input stage's queue were left out (12 rows left where 32 were), and the progress and status.json said every row
    done. Now the rows done before that they count are those met, and of the rest no more than the input has left
    to read: once it is read, every row not done is counted. With a --limit past the input's rows the gone ids
    are reported as without one, not taken for rows past the limit."""
    import logging

    old = {"id": [f"old{i}" for i in range(60)], "prompt": [f"say something about item {i}" for i in range(60)]}
    out = tmp_path / "out"
    assert run_job(cfg(write_parquet(old), out), engine_factory=given(FakeEngine()), is_tty=False).num_ok == 60
    n = 200  # more than the pool (20) and the input stage's queue hold: the first forecasts come before it is read
    inp = write_parquet({"id": [f"new{i}" for i in range(n)], "prompt": [f"tell me about {i}" for i in range(n)]})
    seen = counted_forecasts(monkeypatch)
    clock = FakeClock()
    eng = FakeEngine(max_num_seqs=4, clock=clock, step_seconds=1.0)
    with caplog.at_level(logging.WARNING, logger="overnight"):
        s = run_job(cfg(inp, out, input={"limit": 1000, "batch_rows": 10}, scheduler={"lookahead_rows": 20}),
                    engine_factory=given(eng), is_tty=False, clock=clock)
    assert s.state == "completed" and (s.num_done, s.num_removed) == (n, 60)
    assert "60 rows in" in caplog.text and "are no longer in the input" in caplog.text
    read = [(rows, left, done) for rows, left, done, r in seen if r == n]
    assert len(read) > 5 and all(rows == left == n - done for rows, left, done in read), read[:5]
    assert all(rows <= n - done and left <= n - done for rows, left, done, _ in seen)
    # before it is read whole: at least the rows read and not done (they said none)
    early = [(left, r - done) for _, left, done, r in seen if r < n]
    assert early and all(left >= unread for left, unread in early) and max(u for _, u in early) > 0, early


def test_a_failed_count_of_the_rows_within_the_limit_leaves_the_run_to_its_own_pass(write_parquet, tmp_path, cfg,
                                                                                    monkeypatch, caplog):
    """The pass over the limit's ids runs before the run's own; where it cannot read the input, the run goes on
    and meets the error itself, answering the rows before it (it escaped before the attempt was recorded)."""
    import overnight.pipeline.input.resume as resume

    inp = write_parquet({"id": [f"r{i}" for i in range(30)], "prompt": [f"say {i}" for i in range(30)]})
    out = tmp_path / "out"
    run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)

    def unreadable(*a):
        raise OSError("the storage went away")

    monkeypatch.setattr(resume, "done_within", unreadable)
    s = run_job(cfg(inp, out, input={"limit": 10}), engine_factory=given(FakeEngine()), is_tty=False)
    assert s.state == "completed" and s.num_done == 10
    assert "the rows done within --limit 10 could not be counted (the storage went away)" in caplog.text


def test_a_lower_limits_partial_run_says_how_many_of_its_rows_are_not_done(write_parquet, tmp_path, cfg):
    """`overnight status` counted the output's rows past the --limit as this job's done: a job stopped with 30 of
    its 40 rows left said none was left."""
    from overnight.pipeline.tools.inspection import open_results, summary_lines

    old = {"id": [f"old{i}" for i in range(60)], "prompt": [f"say something about item {i}" for i in range(60)]}
    out = tmp_path / "out"
    assert run_job(cfg(write_parquet(old), out), engine_factory=given(FakeEngine()), is_tty=False).num_ok == 60
    inp = write_parquet({"id": [f"new{i}" for i in range(30)] + old["id"],
                         "prompt": [f"tell me about thing {i}" for i in range(30)] + old["prompt"]})
    clock = FakeClock()
    eng = FakeEngine(max_num_seqs=2, clock=clock, step_seconds=1.0)
    s = run_job(cfg(inp, out, input={"limit": 40}, scheduler={"time_budget": "12s", "policy": "fifo"}),
                engine_factory=given(eng), is_tty=False, clock=clock)
    assert s.state == "partial" and 0 < s.num_done - 10 < 30, s.line()
    left = 40 - s.num_done
    assert f", {left} not done" in "\n".join(summary_lines(*open_results(str(out)))), left
