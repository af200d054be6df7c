"""Reliability pieces without the engine: locks, retries, failpoints, redaction, signals, engine restarts."""

import datetime as dt
import errno
import json
import os
import signal
import socket
import threading
import time

import pyarrow.parquet as pq
import pytest

from fakes import FakeClock, FakeEngine, given
from overnight.pipeline.output import faults
from overnight.pipeline.api import run_job
from overnight.pipeline.output.checkpoint import OutputDir
from overnight.pipeline.engine import EngineError
from overnight.pipeline.output.lock import LockError, RunLock
from overnight.pipeline.output.storage import redact, with_retries


@pytest.fixture
def data(write_parquet):
    return write_parquet({"id": [f"q{i:02d}" for i in range(24)], "prompt": [f"question {i}?" for i in range(24)]})


# -- locks -------------------------------------------------------------------------------------

def write_lock(out, **info):
    os.makedirs(out, exist_ok=True)
    base = {"host": socket.gethostname(), "pid": os.getpid(), "started_at": "2026-11-22T01:00:00+00:00",
            "run_id": "run-x", "token": "t", "heartbeat": time.time()}
    base.update(info)
    (out / ".overnight.lock").write_text(json.dumps(base))


def fake_time():
    """A fake clock, and a sleep that moves it."""
    clock = FakeClock()
    return clock, lambda s: setattr(clock, "t", clock.t + s)


def test_a_second_run_on_the_same_out_is_refused_naming_the_first(tmp_path, caplog):
    # on another host: its heartbeat is watched, and moves (a live run): refused as soon as it does
    out = tmp_path / "out"
    clock = FakeClock()
    write_lock(out, host="other-host", pid=4242, heartbeat=clock.t - 10)

    def sleep(s):
        clock.t += s
        if clock.t >= 1_900_000_000.0 + 20:   # the holder's thread beats 30 s after its last heartbeat
            write_lock(out, host="other-host", pid=4242, heartbeat=clock.t)

    with pytest.raises(LockError) as e:
        RunLock(OutputDir(str(out)), clock=clock, sleep=sleep).acquire()
    assert str(e.value).startswith(f"{out} is in use by another overnight run: host other-host, pid 4242, started "
                                   f"2026-11-22T01:00:00+00:00 (run-x).")
    assert clock.t - 1_900_000_000.0 == 20   # watched 20 s, in WATCH_S steps
    assert "heartbeat 10 s ago): watching it for up to 110 s" in caplog.text
    # on this host, with its process alive: refused at once
    write_lock(out, pid=os.getppid(), started_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
    with pytest.raises(LockError, match=f"host {socket.gethostname()}, pid {os.getppid()}"):
        RunLock(OutputDir(str(out)), sleep=lambda s: pytest.fail("no need to watch a process on this host")).acquire()


def test_a_lock_of_a_run_killed_on_another_host_is_taken_over_once_its_heartbeat_stays_still(tmp_path, caplog):
    # a Kubernetes pod killed (OOM, a lost node) and retried on another node: its lock is fresh, and never beats
    out = tmp_path / "out"
    clock, sleep = fake_time()
    write_lock(out, host="pod-0-abcde", pid=1, heartbeat=clock.t - 5)
    lock = RunLock(OutputDir(str(out)), clock=clock, sleep=sleep)
    lock.acquire()
    waited = clock.t - 1_900_000_000.0
    assert 115 < waited < 116 + 1, waited   # until the heartbeat was STALE_S old, not a retry's failure at once
    assert json.loads((out / ".overnight.lock").read_text())["token"] == lock.token
    assert "taking over a stale lock" in caplog.text
    lock.release()


def test_a_lock_of_a_dead_process_on_this_host_is_taken_over(tmp_path, caplog):
    out = tmp_path / "out"
    dead = 2 ** 22 + 12345  # above the usual pid_max: no such process
    write_lock(out, pid=dead)
    lock = RunLock(OutputDir(str(out)))
    lock.acquire()
    assert json.loads((out / ".overnight.lock").read_text())["token"] == lock.token
    assert "taking over a stale lock" in caplog.text
    lock.release()
    assert not (out / ".overnight.lock").exists()


def test_a_lock_without_heartbeat_is_stale_anywhere(tmp_path):
    out = tmp_path / "out"
    write_lock(out, host="other-host", pid=1, heartbeat=time.time() - 3600)
    RunLock(OutputDir(str(out))).acquire()


def test_a_lock_whose_pid_was_reused_after_it_is_taken_over(tmp_path):
    import subprocess
    import datetime as dt

    out = tmp_path / "out"
    holder = subprocess.Popen(["sleep", "30"])
    try:
        started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        write_lock(out, pid=holder.pid, started_at=started, heartbeat=time.time())
        with pytest.raises(LockError, match=f"in use by another overnight run: host .*, pid {holder.pid}"):
            RunLock(OutputDir(str(out))).acquire()
        # the same pid, for a lock older than the process: the pid was reused, the holder is gone
        write_lock(out, pid=holder.pid, started_at="2020-01-01T00:00:00+00:00", heartbeat=time.time())
        lock = RunLock(OutputDir(str(out)))
        lock.acquire()
        lock.release()
    finally:
        holder.kill()
        holder.wait()


def test_a_thread_keeps_the_heartbeat_while_the_lock_is_held(tmp_path, monkeypatch):
    from overnight.pipeline.output import lock as lock_module

    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.05)
    out = tmp_path / "out"
    lock = RunLock(OutputDir(str(out)))
    lock.acquire()
    first = json.loads((out / ".overnight.lock").read_text())["heartbeat"]
    deadline = time.time() + 10
    while json.loads((out / ".overnight.lock").read_text())["heartbeat"] == first and time.time() < deadline:
        time.sleep(0.05)
    assert json.loads((out / ".overnight.lock").read_text())["heartbeat"] > first   # nobody called heartbeat()
    lock.release()
    assert not (out / ".overnight.lock").exists() and not lock._thread.is_alive()


def test_a_heartbeat_does_not_write_over_a_lock_another_run_took(tmp_path, caplog):
    out = tmp_path / "out"
    lock = RunLock(OutputDir(str(out)))
    lock.acquire()
    write_lock(out, host="other-host", pid=99, token="theirs")
    lock.last_beat = 0.0
    lock.heartbeat()
    assert lock.lost and "another run took over the lock" in caplog.text
    assert json.loads((out / ".overnight.lock").read_text())["token"] == "theirs"
    lock.release()
    assert json.loads((out / ".overnight.lock").read_text())["token"] == "theirs"   # theirs is left in place


def test_a_run_whose_lock_another_took_over_stops_and_writes_nothing_more(data, tmp_path, cfg, monkeypatch):
    # This run was held up past the stale heartbeat, and another took OUT over: part numbers would collide.
    from overnight.pipeline.output import lock as lock_module

    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.01)  # every write asks again
    out = tmp_path / "out"
    at_takeover = {}

    class TakenOver(FakeEngine):
        def _step(self):
            if self.num_steps == 8:
                write_lock(out, host="other-host", pid=99, token="theirs")
                at_takeover["parts"] = sorted(os.listdir(out / "parts"))
                at_takeover["manifest"] = (out / "manifest.json").read_text()
            return super()._step()

    s = run_job(cfg(data, out), engine_factory=given(TakenOver(step_sleep=0.02)), is_tty=False)
    assert at_takeover["parts"], "the run had written parts before the takeover"
    assert s.state == "failed" and s.exit_code == 1
    assert "another run took over" in s.message and "host other-host, pid 99" in s.message
    assert sorted(os.listdir(out / "parts")) == at_takeover["parts"]            # no part after it
    assert (out / "manifest.json").read_text() == at_takeover["manifest"]     # nor its manifest
    assert json.loads((out / ".overnight.lock").read_text())["token"] == "theirs"   # and theirs stays


def test_a_takeover_found_only_at_the_last_flush_fails_the_run(data, tmp_path, cfg, monkeypatch):
    from overnight.pipeline.output import lock as lock_module

    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.01)
    monkeypatch.setattr(RunLock, "_beat_until_released", lambda self: None)   # only the loop and the writes ask
    out = tmp_path / "out"

    class TakenAtTheEnd(FakeEngine):
        def _step(self):
            done = super()._step()
            if len(self.added) == 24 and not self.has_unfinished():   # the last rows finish: the loop ends
                write_lock(out, host="other-host", pid=99, token="theirs")
            return done

    s = run_job(cfg(data, out, output={"flush_rows": 1000}), engine_factory=given(TakenAtTheEnd(step_sleep=0.02)),
                is_tty=False)
    assert (s.state, s.exit_code) == ("failed", 1) and "(24 finished rows not saved" in s.message
    assert not list(out.glob("parts/*.parquet"))
    assert json.loads((out / "manifest.json").read_text())["state"] == "running"   # as the other run left it


def test_a_lock_removed_while_held_is_lost(tmp_path):
    # the run that took it over finished and removed it: its part numbers may collide with ours
    out = tmp_path / "out"
    lock = RunLock(OutputDir(str(out)))
    lock.acquire()
    (out / ".overnight.lock").unlink()
    lock.last_beat = 0.0
    assert not lock.confirm() and lock.lost and "removed it since" in lock.taken_by()
    lock.release()
    assert not (out / ".overnight.lock").exists()   # not written again


def test_watching_a_lock_survives_read_errors_and_takes_a_corrupt_one(tmp_path, monkeypatch):
    out = tmp_path / "out"
    clock, sleep = fake_time()
    write_lock(out, host="other-host", pid=1, heartbeat=clock.t)
    reads = []
    real = RunLock.holder

    def flaky(self):
        reads.append(clock.t)
        if len(reads) == 2:
            raise OSError("a storage blip")
        if len(reads) == 4:
            (out / ".overnight.lock").write_text("{not json")
        return real(self)

    monkeypatch.setattr(RunLock, "holder", flaky)
    lock = RunLock(OutputDir(str(out)), clock=clock, sleep=sleep)
    lock.acquire()
    assert len(reads) >= 4 and json.loads((out / ".overnight.lock").read_text())["token"] == lock.token
    lock.release()


def test_a_lock_that_cannot_be_read_again_ends_the_watch_with_an_error(tmp_path, monkeypatch):
    out = tmp_path / "out"
    clock, sleep = fake_time()
    write_lock(out, host="other-host", pid=1, heartbeat=clock.t)
    real, reads = RunLock.holder, []

    def failing(self):
        reads.append(clock.t)
        if len(reads) > 1:
            raise PermissionError(13, "Forbidden")
        return real(self)

    monkeypatch.setattr(RunLock, "holder", failing)
    lock = RunLock(OutputDir(str(out)), clock=clock, sleep=sleep)
    with pytest.raises(LockError, match="Cannot read the lock .*Forbidden"):
        lock.acquire()
    assert 120 < clock.t - reads[0] < 126   # the watch's 2 minutes, then the error


def test_a_live_run_is_seen_to_beat_when_the_watchers_clock_is_110_s_ahead(tmp_path):
    # this host's clock 110 s ahead: the holder's heartbeat looks 110 s old, 10 s short of stale
    out = tmp_path / "out"
    clock = FakeClock()
    write_lock(out, host="other-host", pid=4242, heartbeat=clock.t - 110)
    start = clock.t

    def sleep(s):
        clock.t += s
        if clock.t - start >= 30:   # its thread beats 30 s after its last heartbeat
            write_lock(out, host="other-host", pid=4242, heartbeat=clock.t - 110)

    with pytest.raises(LockError, match="host other-host, pid 4242"):
        RunLock(OutputDir(str(out)), clock=clock, sleep=sleep).acquire()


def test_two_runs_at_once_through_the_job(data, tmp_path, cfg):
    out = tmp_path / "out"
    write_lock(out, pid=os.getppid(), started_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
    with pytest.raises(LockError, match=f"in use by another overnight run: host {socket.gethostname()}, "
                                        f"pid {os.getppid()}"):
        run_job(cfg(data, out), engine_factory=given(FakeEngine()), is_tty=False)
    assert not (out / "manifest.json").exists()  # refused before touching anything


def test_the_lock_is_released_after_a_run(data, tmp_path, cfg):
    out = tmp_path / "out"
    run_job(cfg(data, out), engine_factory=given(FakeEngine()), is_tty=False)
    assert not (out / ".overnight.lock").exists()


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


def test_a_second_signal_aborts_at_once_and_leaves_a_consistent_checkpoint(data, tmp_path, cfg):
    out = tmp_path / "out"
    eng = FakeEngine(max_num_seqs=2, step_sleep=0.05, length_of=lambda ids: 200)
    steps_at = signal_when(eng, 10, signal.SIGINT, times=2, gap=0.1)
    s = run_job(cfg(data, out, scheduler={"grace_s": 60}), engine_factory=given(eng), is_tty=False)
    aborted = json.loads((out / "status.json").read_text())["rows"]["aborted"]
    assert s.state == "interrupted" and s.exit_code == 75 and len(eng.aborted) == aborted > 0
    # At once: the engine step under way when the second signal came is the last one (draining the rows in
    # flight would take 200 steps each, with the 60 s grace period allowing it).
    assert len(steps_at) == 2 and eng.num_steps <= steps_at[1] + 1, (steps_at, eng.num_steps)
    done = pq.read_table(out / "parts").num_rows if (out / "parts").exists() else 0
    assert done == s.num_done


def test_an_engine_that_died_on_the_signal_during_the_drain_is_not_stepped_again(data, tmp_path, cfg):
    # Ctrl-C reaches the engine's processes too: a dead engine's next step may block forever (vLLM's output
    # queue), so it is never stepped again, though the 60 s grace period had just begun
    out = tmp_path / "out"

    class DiesOnTheSignal(FakeEngine):
        dead_steps = 0

        def _step(self):
            if sent:
                self.dead_steps += 1
                raise RuntimeError("engine core died")
            return super()._step()

    eng = DiesOnTheSignal(max_num_seqs=2, step_sleep=0.05, length_of=lambda ids: 200)
    sent = signal_when(eng, 10, signal.SIGINT)
    t0 = time.monotonic()
    s = run_job(cfg(data, out, scheduler={"grace_s": 60}), engine_factory=given(eng), is_tty=False)
    assert (s.state, s.exit_code) == ("interrupted", 75) and eng.dead_steps == 1
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
    from overnight.pipeline.tools.status import job_status
    js = job_status(str(out))
    assert (js["rows_done"], js["rows_left"]) == (4, 0), js
    assert "id 'c' at v2.parquet#1: its prompt changed since its result was written" in caplog.text
    assert "1 rows in" in caplog.text and "are no longer in the input (e.g. ids 'b')" in caplog.text
    t = pq.read_table(out / "parts").to_pylist()
    assert sorted(r["id"] for r in t) == ["a", "b", "c", "d", "e"]
    assert all(len(r["prompt_hash"]) == 16 for r in t)
