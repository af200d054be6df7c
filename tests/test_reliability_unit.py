"""Reliability pieces without the engine: retries, failpoints, redaction, signals, engine restarts, input changes.
Locks: test_locks.py and test_lock_runs.py."""

import errno
import json
import os
import signal
import threading
import time

import pyarrow.parquet as pq
import pytest

from fakes import FakeEngine, given
from overnight.pipeline.output import faults
from overnight.pipeline.api import run_job
from overnight.pipeline.engine import EngineError
from overnight.pipeline.output.storage import redact, with_retries


@pytest.fixture
def data(write_parquet):
    return write_parquet({"id": [f"q{i:02d}" for i in range(24)], "prompt": [f"question {i}?" for i in range(24)]})


# -- storage -----------------------------------------------------------------------------------

def test_transient_errors_are_retried_with_backoff():
    calls, sleeps = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("connection reset")
        return "ok"

    assert with_retries(flaky, "writing x", sleep=sleeps.append) == "ok"
    assert sleeps == [0.5, 1.0]


def test_permanent_errors_are_not_retried():
    sleeps = []

    def full():
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        with_retries(full, "writing x", sleep=sleeps.append)
    assert sleeps == []


def test_an_injected_transient_write_failure_is_retried_and_the_job_completes(data, tmp_path, cfg,
                                                                               monkeypatch, caplog):
    monkeypatch.setenv("OVERNIGHT_FAILPOINTS", "storage.write=oserror@2-3")
    monkeypatch.setattr("overnight.pipeline.output.storage.RETRY_DELAYS", (0.01, 0.01, 0.01))
    faults.reset()
    try:
        s = run_job(cfg(data, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    finally:
        monkeypatch.delenv("OVERNIGHT_FAILPOINTS")
        faults.reset()
    assert s.state == "completed" and s.num_done == 24
    assert "injected I/O error" in caplog.text and "retry 1 of 3" in caplog.text
    assert pq.read_table(tmp_path / "out" / "parts").num_rows == 24


def test_redact_masks_credentials_in_urls():
    assert redact("s3://bucket/x") == "s3://bucket/x"
    assert redact("ftp://user:secret@host/dir/f.parquet") == "ftp://***@host/dir/f.parquet"
    assert redact("/local/path") == "/local/path"


# -- signals -----------------------------------------------------------------------------------

def signal_when(engine, steps, sig, times=1, gap=0.3):
    """Send sig to this process once the engine has taken this many steps (so the run is under way and its
    handlers are in place, however long the job took to start), then times - 1 more at gap seconds. The list
    returned gets the engine's step count right after each signal is sent."""
    sent = []

    def send():
        deadline = time.monotonic() + 60
        while engine.num_steps < steps:
            if time.monotonic() > deadline:
                return  # the run never got going; a late signal must not hit another test
            time.sleep(0.005)
        for i in range(times):
            if i:
                time.sleep(gap)
            os.kill(os.getpid(), sig)
            sent.append(engine.num_steps)
    threading.Thread(target=send, daemon=True).start()
    return sent


def slow_engine():
    return FakeEngine(max_num_seqs=2, step_sleep=0.05, length_of=lambda ids: 10)


def test_sigterm_drains_within_grace_and_exits_75(data, tmp_path, cfg):
    out = tmp_path / "out"
    eng = slow_engine()
    signal_when(eng, 10, signal.SIGTERM)
    s = run_job(cfg(data, out, scheduler={"grace_s": 30}), engine_factory=given(eng), is_tty=False)
    assert (s.state, s.exit_code) == ("interrupted", 75)
    assert s.message.startswith("interrupted by SIGTERM: ") and "rows not done" in s.message
    assert eng.aborted == []  # the grace period let the rows in flight finish
    m = json.loads((out / "manifest.json").read_text())
    assert m["state"] == "interrupted" and m["counts"]["num_done"] == s.num_done
    assert 0 < s.num_done < 24 and pq.read_table(out / "parts").num_rows == s.num_done
    again = run_job(cfg(data, out), engine_factory=given(FakeEngine()), is_tty=False)
    ids = pq.read_table(out / "parts").column("id").to_pylist()
    assert again.state == "completed" and len(ids) == 24 == len(set(ids))


class SignalAtStep(FakeEngine):
    """A fake-clock engine that sends SIGTERM to this process at one step (in the loop's own thread)."""

    def __init__(self, at_step: int, **kw):
        super().__init__(**kw)
        self.at_step = at_step

    def _step(self):
        if self.num_steps == self.at_step:
            os.kill(os.getpid(), signal.SIGTERM)
        return super()._step()


def test_a_signals_grace_ends_at_the_deadline(data, tmp_path, cfg):
    from fakes import FakeClock
    clock = FakeClock()
    start = clock.t
    eng = SignalAtStep(20, max_num_seqs=2, clock=clock, step_seconds=1.0, length_of=lambda ids: 500)
    s = run_job(cfg(data, tmp_path / "out", scheduler={"time_budget": "100s", "safety_margin_s": 10, "grace_s": 600}),
                engine_factory=given(eng), is_tty=False, clock=clock)
    assert (s.state, s.exit_code) == ("interrupted", 75)
    assert clock.t - start <= 101   # the 600 s grace stopped at the deadline (it drained to 620 s)
    assert eng.aborted                  # the rows in flight at the deadline


def test_a_signal_during_the_deadlines_drain_gets_its_grace(data, tmp_path, cfg, caplog):
    from fakes import FakeClock
    clock = FakeClock()
    start = clock.t
    eng = SignalAtStep(40, max_num_seqs=2, clock=clock, step_seconds=1.0, length_of=lambda ids: 500)
    with caplog.at_level("INFO", logger="overnight"):
        s = run_job(cfg(data, tmp_path / "out", scheduler={"time_budget": "100s", "safety_margin_s": 70,
                                                            "grace_s": 3}),
                    engine_factory=given(eng), is_tty=False, clock=clock)
    assert (s.state, s.exit_code) == ("interrupted", 75)
    assert 40 <= clock.t - start <= 46     # not drained on to the deadline at 100 s
    assert "interrupted by SIGTERM (deadline reached): 4 rows in flight, draining them until" in caplog.text


def test_a_second_signal_aborts_at_once_and_leaves_a_consistent_checkpoint(data, tmp_path, cfg):
    out = tmp_path / "out"
    eng = FakeEngine(max_num_seqs=2, step_sleep=0.05, length_of=lambda ids: 200)
    steps_at = signal_when(eng, 10, signal.SIGINT, times=2, gap=1.5)   # (a person's second Ctrl-C)
    s = run_job(cfg(data, out, scheduler={"grace_s": 60}), engine_factory=given(eng), is_tty=False)
    aborted = json.loads((out / "status.json").read_text())["rows"]["aborted"]
    assert s.state == "interrupted" and s.exit_code == 75 and len(eng.aborted) == aborted > 0
    # At once: the engine step under way when the second signal came is the last one (draining the rows in
    # flight would take 200 steps each, with the 60 s grace period allowing it).
    assert len(steps_at) == 2 and eng.num_steps <= steps_at[1] + 1, (steps_at, eng.num_steps)
    done = pq.read_table(out / "parts").num_rows if (out / "parts").exists() else 0
    assert done == s.num_done


def test_one_stop_delivered_twice_at_once_drains(data, tmp_path, cfg):
    """`scancel`, or Airflow stopping a task, signals the process group, and the wrapper passes the signal on: two
    SIGTERMs 20 ms apart are one stop, which drains (they aborted the rows in flight as a second signal does)."""
    out = tmp_path / "out"
    eng = FakeEngine(max_num_seqs=2, step_sleep=0.05, length_of=lambda ids: 20)
    signal_when(eng, 10, signal.SIGTERM, times=2, gap=0.02)
    s = run_job(cfg(data, out, scheduler={"grace_s": 60}), engine_factory=given(eng), is_tty=False)
    assert (s.state, s.exit_code) == ("interrupted", 75) and eng.aborted == []
    assert json.loads((out / "status.json").read_text())["rows"]["aborted"] == 0


def test_stop_requests_count_a_repeat_of_the_same_signal_at_once_as_one():
    from overnight.pipeline.signals import SAME_STOP_S, StopRequests

    t, told = [0.0], []
    r = StopRequests(clock=lambda: t[0], on_request=told.append)  # (the Ray driver tells its workers there)
    r._handle(signal.SIGTERM, None)
    t[0] += SAME_STOP_S / 2
    r._handle(signal.SIGTERM, None)          # the process group's copy
    assert (r.first, r.count, r.is_urgent) == ("SIGTERM", 1, False)
    r._handle(signal.SIGINT, None)           # another signal: the second stop
    assert r.is_urgent and told == ["SIGTERM", "SIGINT"]
    early = StopRequests(on_request=told.append)
    early.replay("SIGTERM")                  # one that came before these handlers (the job's opening)
    assert (early.first, early.count, told[-1]) == ("SIGTERM", 1, "SIGTERM")
    r = StopRequests(clock=lambda: t[0])
    r._handle(signal.SIGINT, None)
    t[0] += SAME_STOP_S * 2
    r._handle(signal.SIGINT, None)           # a person's second Ctrl-C, a moment later
    assert r.is_urgent


def test_an_engine_that_died_on_the_signal_during_the_drain_is_not_stepped_again(data, tmp_path, cfg):
    # Ctrl-C reaches the engine's processes too: a dead engine's next step may block forever (vLLM's output
    # queue), so it is never stepped again, though the 60 s grace period had just begun; and it is shut down,
    # through the engine interface's shutdown() (which takes no timeout)
    out = tmp_path / "out"

    class DiesOnTheSignal(FakeEngine):
        dead_steps = 0
        shut_down = 0

        def _step(self):
            if sent:
                self.dead_steps += 1
                raise RuntimeError("engine core died")
            return super()._step()

        def shutdown(self):
            self.shut_down += 1

    eng = DiesOnTheSignal(max_num_seqs=2, step_sleep=0.05, length_of=lambda ids: 200)
    sent = signal_when(eng, 10, signal.SIGINT)
    t0 = time.monotonic()
    s = run_job(cfg(data, out, scheduler={"grace_s": 60}), engine_factory=given(eng), is_tty=False)
    assert (s.state, s.exit_code) == ("interrupted", 75) and eng.dead_steps == 1 and eng.shut_down == 1
    assert time.monotonic() - t0 < 30


def test_rows_the_engine_ends_with_abort_or_error_are_not_written_as_answers(data, tmp_path, cfg):
    import dataclasses

    out = tmp_path / "out"

    class EndsTwo(FakeEngine):
        reasons = ["abort", "error"]

        def _step(self):
            return [dataclasses.replace(f, finish_reason=self.reasons.pop(0), text="partial") if self.reasons else f
                    for f in super()._step()]

    s = run_job(cfg(data, out), engine_factory=given(EndsTwo()), is_tty=False)
    assert (s.state, s.exit_code, s.num_done, s.num_error) == ("partial", 75, 23, 1)   # the aborted one is not done
    t = pq.read_table(out / "parts").to_pylist()
    assert len(t) == 23 and "partial" not in [r["text"] for r in t]
    err = [r for r in t if r["status"] == "error"]
    assert len(err) == 1 and "the engine ended the request with an internal error" in err[0]["error"]
    again = run_job(cfg(data, out), engine_factory=given(FakeEngine()), is_tty=False)
    assert (again.state, again.num_resumed) == ("completed", 23) and pq.read_table(out / "parts").num_rows == 24


# -- engine death ------------------------------------------------------------------------------

def test_engine_restarts_in_process_and_the_run_completes(data, tmp_path, cfg, caplog):
    out = tmp_path / "out"
    engines = []

    def factory(job):  # the first engine dies after 5 steps, the restarted one does not
        engines.append(FakeEngine(max_num_seqs=2, fail_after_steps=None if engines else 5))
        return engines[-1]

    s = run_job(cfg(data, out, engine={"max_restarts": 1}), engine_factory=factory, is_tty=False)
    assert s.state == "completed" and len(engines) == 2
    assert "restarting it (1 of 1); 4 rows in flight go back to the queue" in caplog.text  # 2 running, 2 waiting
    ids = pq.read_table(out / "parts").column("id").to_pylist()
    assert len(ids) == 24 == len(set(ids))
    assert json.loads((out / "status.json").read_text())["engine_restarts"] == 1


def test_engine_death_without_restarts_fails_with_a_clear_message(data, tmp_path, cfg):
    out = tmp_path / "out"
    with pytest.raises(EngineError, match="The vLLM engine failed mid-run .* Pass --max-engine-restarts N"):
        run_job(cfg(data, out), engine_factory=given(FakeEngine(max_num_seqs=2, fail_after_steps=15)), is_tty=False)
    st = json.loads((out / "status.json").read_text())
    assert st["exit_code"] == 69 and st["state"] == "failed"
    assert st["rows"]["done"] == pq.read_table(out / "parts").num_rows > 0


# -- input changes between attempts -------------------------------------------------------------

def test_resume_after_the_input_changed(write_parquet, tmp_path, cfg, caplog):
    out = tmp_path / "out"
    first = write_parquet({"id": ["a", "b", "c", "d"], "prompt": ["one", "two", "three", "four"]}, "v1.parquet")
    run_job(cfg(first, out), engine_factory=given(FakeEngine()), is_tty=False)
    # b removed, c changed, e added
    second = write_parquet({"id": ["a", "c", "d", "e"], "prompt": ["one", "THREE?", "four", "five"]}, "v2.parquet")
    eng = FakeEngine()
    s = run_job(cfg(second, out), engine_factory=given(eng), is_tty=False)
    assert len(eng.added) == 1  # only e
    rows = s.extra["rows"]
    assert (rows["resumed"], rows["changed"], rows["removed"]) == (3, 1, 1)
    # the input's 4 rows are done; the output also holds b's
    assert (rows["total"], rows["done"], rows["remaining"], rows["ok"]) == (4, 4, 0, 5)
    assert s.line().startswith("overnight: done: 4/4 rows (5 ok, 0 error, 3 already done, 1 no longer in the input)")
    st = json.loads((out / "status.json").read_text())
    assert (st["rows"]["done"], st["rows"]["remaining"]) == (4, 0)
    # the progress counts the input's rows: b's result is not one of them (it showed 5/4 rows, and an ETA of 0
    # from the start of a resume whose input had as many rows left as OUT held gone)
    timeline = json.loads((out / "timeline.json").read_text())
    assert timeline and all(t["rows_done"] <= 4 for t in timeline), timeline
    from overnight.pipeline.tools.status import job_status
    js = job_status(str(out))
    assert (js["rows_done"], js["rows_left"]) == (4, 0), js
    assert "id 'c' at v2.parquet#1: its prompt changed since its result was written" in caplog.text
    assert "1 rows in" in caplog.text and "are no longer in the input (e.g. ids 'b')" in caplog.text
    t = pq.read_table(out / "parts").to_pylist()
    assert sorted(r["id"] for r in t) == ["a", "b", "c", "d", "e"]
    assert all(len(r["prompt_hash"]) == 16 for r in t)
    # ... also where a row's flush (which recounts) comes as it is recorded: counted once (it showed 15/11)
    from overnight.pipeline import progress as P

    seen, update = [], P.Progress.update

    def watched(self, n, t):
        update(self, n, t)
        seen.append((self.done, self.total))

    third = write_parquet({"id": ["a", "c", "d"] + [f"n{i}" for i in range(8)], "prompt": ["one", "THREE?", "four"] +
                           [f"new {i}" for i in range(8)]}, "v3.parquet")
    P.Progress.update = watched
    try:
        run_job(cfg(third, out, output={"flush_rows": 1}), engine_factory=given(FakeEngine()), is_tty=False)
    finally:
        P.Progress.update = update
    assert seen and all(d <= t for d, t in seen), seen


def test_a_file_where_the_parts_folder_belongs_is_named_at_once_not_retried(data, tmp_path, cfg, monkeypatch):
    from overnight.pipeline.output.storage import StorageError

    out = tmp_path / "out"
    out.mkdir()
    (out / "parts").write_text("not a folder")
    monkeypatch.setattr("overnight.pipeline.output.storage.RETRY_DELAYS",
                        (pytest.fail,))  # a retry would call it
    with pytest.raises(StorageError, match=r"parts/part-00000\.parquet: File exists: a file stands where overnight "
                                           r"keeps a folder \(.*/out/parts\)\. Move that file away"):
        run_job(cfg(data, out, output={"flush_rows": 5}), engine_factory=given(FakeEngine()), is_tty=False)


def test_a_run_removes_the_temporary_files_of_a_run_killed_while_it_wrote(data, tmp_path, cfg):
    """SIGKILL between write_atomic's write and its rename leaves .tmp-<hex>-<name>: a glob such as
    OUT/**/*.parquet would read the half part. The next run, holding the lock, removes them (not a lock's own)."""
    out = tmp_path / "out"
    run_job(cfg(data, out, input={"limit": 4}), engine_factory=given(FakeEngine()), is_tty=False)
    hexa = "0123456789abcdef" * 2
    left = [out / "parts" / f".tmp-{hexa}-part-00009.parquet", out / f".tmp-{hexa}-manifest.json"]
    for p in left:
        p.write_bytes(b"half")
    lock_tmp = out / f".tmp-{hexa}-.overnight.lock"
    lock_tmp.write_bytes(b"{}")
    run_job(cfg(data, out), engine_factory=given(FakeEngine()), is_tty=False)
    assert not any(p.exists() for p in left) and lock_tmp.exists()
    assert pq.read_table(out / "parts").num_rows == 24
