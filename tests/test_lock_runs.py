"""A run and its output folder's lock (pipeline/output/lock.py): a run whose lock another run took over stops
and writes nothing more (mid-run, at the last flush, during a drain, while a resume scans); two runs at once
through the job; the lock released after a run. With the fake engine."""

import datetime as dt
import json
import os
import signal
import socket
import time

import pytest

from fakes import FakeEngine, given, write_lock
from overnight.pipeline.api import run_job
from overnight.pipeline.output.checkpoint import OutputDir
from overnight.pipeline.output.lock import LockError, RunLock


@pytest.fixture
def data(write_parquet):
    return write_parquet({"id": [f"q{i:02d}" for i in range(24)], "prompt": [f"question {i}?" for i in range(24)]})


def test_a_takeover_during_a_drain_stops_the_run_at_once(data, tmp_path, cfg, monkeypatch):
    # Ctrl-C began a 60 s drain; then another run took OUT over: the drain ends there, nothing more is written
    from test_reliability_unit import signal_when

    from overnight.pipeline.output import lock as lock_module

    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.01)
    monkeypatch.setattr(RunLock, "_beat_until_released", lambda self: None)
    out = tmp_path / "out"

    class TakenOver(FakeEngine):
        taken = None

        def _step(self):
            if sent and self.taken is None:
                self.taken = self.num_steps
                write_lock(out, host="other-host", pid=99, token="theirs")
            return super()._step()

    eng = TakenOver(max_num_seqs=4, step_sleep=0.02, length_of=lambda ids: 1000)  # a drain of 20 s
    sent = signal_when(eng, 5, signal.SIGINT)
    s = run_job(cfg(data, out, scheduler={"grace_s": 60}), engine_factory=given(eng), is_tty=False)
    assert (s.state, s.exit_code) == ("failed", 1)
    # the loop's next heartbeat (once a second) finds the loss
    assert eng.num_steps - eng.taken < 100, f"stepped {eng.num_steps - eng.taken} more times after the loss"


def test_a_run_whose_lock_another_took_over_stops_and_writes_nothing_more(data, tmp_path, cfg, monkeypatch):
    # This run was held up past the stale heartbeat, and another took OUT over: part numbers would collide.
    from overnight.pipeline.output import lock as lock_module

    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.01)  # every write asks again
    # The loop and the writes beat, on the thread that takes the lock over here. A heartbeat thread beating every
    # 10 ms could read the lock just before the takeover and write its own just after, over the other run's (a
    # window of microseconds at the real 30 s heartbeat, after 120 s held up).
    monkeypatch.setattr(RunLock, "_beat_until_released", lambda self: None)
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


def test_a_takeover_while_a_resume_scans_writes_no_manifest(data, tmp_path, cfg, monkeypatch):
    # A resume scans OUT's parts before it writes its manifest; at millions of rows that takes a while, and a run
    # held up in it may be taken over as stale. It writes nothing then: a Ray worker whose driver gave it up, too.
    from overnight.pipeline.output import lock as lock_module

    out = tmp_path / "out"
    s = run_job(cfg(data, out, input={"limit": 10}), engine_factory=given(FakeEngine()), is_tty=False)
    assert s.state == "completed"
    before = (out / "manifest.json").read_text()
    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.01)
    monkeypatch.setattr(RunLock, "_beat_until_released", lambda self: None)
    scan = OutputDir.scan

    def slow_scan(self, *a, **k):
        result = scan(self, *a, **k)
        time.sleep(0.02)
        write_lock(out, host="other-host", pid=99, token="theirs")
        return result
    monkeypatch.setattr(OutputDir, "scan", slow_scan)
    with pytest.raises(LockError, match=r"another run took over .*\(host other-host, pid 99, .* nothing was written"):
        run_job(cfg(data, out), engine_factory=given(FakeEngine()), is_tty=False)
    assert (out / "manifest.json").read_text() == before
    assert json.loads((out / ".overnight.lock").read_text())["token"] == "theirs"


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
