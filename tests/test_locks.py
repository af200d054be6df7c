"""One run at a time per output folder (pipeline/output/lock.py), the lock itself: a second run refused naming
the first; a dead run's lock taken over (on this host at once, elsewhere once its heartbeat stays still); the
heartbeat thread. With fake clocks. A run that loses its lock: tests/test_lock_runs.py."""

import datetime as dt
import json
import os
import socket
import time

import pytest

from fakes import FakeClock, write_lock
from overnight.pipeline.output.checkpoint import OutputDir
from overnight.pipeline.output.lock import SETTLE_S, LockError, RunLock


# -- locks -------------------------------------------------------------------------------------

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
    # until the heartbeat was STALE_S old, not a retry's failure at once; then SETTLE_S before it is read back
    assert 115 + SETTLE_S < waited < 117 + SETTLE_S, waited
    assert json.loads((out / ".overnight.lock").read_text())["token"] == lock.token
    assert "taking over a stale lock" in caplog.text
    lock.release()


def test_of_two_runs_taking_over_one_stale_lock_together_the_last_writer_wins_and_the_other_refuses(tmp_path):
    # Two retried pods watching the same dead run's lock: their watches end together. Y read the stale lock just
    # before X wrote its own, and writes while X waits to read it back.
    out = tmp_path / "out"
    write_lock(out, host="pod-0-abcde", pid=1, token="dead", heartbeat=time.time() - 3600)
    stale = json.loads((out / ".overnight.lock").read_text())
    y = RunLock(OutputDir(str(out)), sleep=lambda s: None)
    y.holder = _first_then_real(y, stale)
    settles = []

    def x_sleep(s):
        settles.append(s)
        y.acquire()   # Y's write lands between X's write and X's read back

    x = RunLock(OutputDir(str(out)), sleep=x_sleep)
    with pytest.raises(LockError, match="was just locked by another run"):
        x.acquire()
    assert settles == [SETTLE_S]
    assert y.is_held and not x.is_held
    assert json.loads((out / ".overnight.lock").read_text())["token"] == y.token
    y.release()


def test_a_new_lock_is_created_whole_and_only_once(tmp_path, monkeypatch):
    # linked in place once written: a run reading it never finds it empty (taken for corrupt, and taken over)
    out = tmp_path / "out"
    a = RunLock(OutputDir(str(out)))
    a.acquire()
    assert json.loads((out / ".overnight.lock").read_text())["token"] == a.token
    assert os.listdir(out) == [".overnight.lock"]   # no file of its own left beside it
    with pytest.raises(LockError, match="was just locked by another run"):
        RunLock(OutputDir(str(out)))._write(exclusive=True)
    a.release()

    def no_links(*_):
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(os, "link", no_links)   # a file system without hard links: O_EXCL, as before
    c = RunLock(OutputDir(str(out)))
    c.acquire()
    assert json.loads((out / ".overnight.lock").read_text())["token"] == c.token and len(os.listdir(out)) == 1
    with pytest.raises(LockError, match="was just locked by another run"):
        RunLock(OutputDir(str(out)))._write(exclusive=True)
    c.release()


def _first_then_real(lock, first):
    """lock.holder that answers `first` once (a read made before another run wrote), then reads the file."""
    answers = [dict(first)]
    real = lock.holder
    return lambda: answers.pop() if answers else real()


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


def test_a_lock_of_another_container_on_a_host_of_the_same_name_is_watched_not_taken(tmp_path):
    # host networking: the same host name, another pid namespace; its pid means nothing here, its heartbeat does
    out = tmp_path / "out"
    clock = FakeClock(time.time())
    write_lock(out, pid=2 ** 22 + 12345, ns="another-boot:4026531836", heartbeat=clock.t - 1)

    def sleep(s):   # the other container's run is alive: it beats
        clock.t += s
        write_lock(out, pid=2 ** 22 + 12345, ns="another-boot:4026531836", heartbeat=clock.t)

    with pytest.raises(LockError, match=f"in use by another overnight run: host {socket.gethostname()}"):
        RunLock(OutputDir(str(out)), clock=clock, sleep=sleep).acquire()
    # the same pid namespace: a dead pid is a dead run, taken over at once
    mine = RunLock(OutputDir(str(out)))
    write_lock(out, pid=2 ** 22 + 12345, ns=mine.info["ns"], heartbeat=time.time())
    mine.acquire()
    mine.release()


def test_two_jobs_in_one_process_do_not_take_each_others_lock(tmp_path):
    # a notebook, or an Airflow worker running two tasks on threads: the first job's lock is live
    out = OutputDir(str(tmp_path / "out"))
    first = RunLock(out)
    first.acquire()
    with pytest.raises(LockError, match=f"pid {os.getpid()}"):
        RunLock(out).acquire()
    assert first.confirm()
    first.release()
    # an earlier job of this process that ended without releasing its lock (killed thread): stale
    left = RunLock(out)
    left.acquire()
    left._stop.set()
    from overnight.pipeline.output import lock as lock_module
    lock_module._HELD.discard(left.token)
    again = RunLock(out)
    again.acquire()
    again.release()


def test_a_lock_that_cannot_be_read_back_is_removed_and_named(tmp_path, monkeypatch):
    out = OutputDir("memory://read-back/out")
    lock = RunLock(out, sleep=lambda s: None)
    holder, reads = RunLock.holder, []

    def flaky(self):
        reads.append(1)
        if len(reads) == 2:   # the read-back, after our write
            raise ConnectionResetError(104, "Connection reset by peer")
        return holder(self)
    monkeypatch.setattr(RunLock, "holder", flaky)
    with pytest.raises(LockError, match="Cannot read back the lock memory://read-back/out/.overnight.lock"):
        lock.acquire()
    assert not out.fs.exists(out.path(".overnight.lock"))   # not left to be watched as a live run's


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


def test_a_lock_written_over_with_garbage_while_held_is_lost_and_says_so(tmp_path, caplog):
    out = tmp_path / "out"
    lock = RunLock(OutputDir(str(out)))
    lock.acquire()
    (out / ".overnight.lock").write_text("{not json")
    lock.last_beat = 0.0
    assert not lock.confirm() and lock.lost
    assert lock.taken_by() == "a lock file this run cannot read (not JSON), written over its own"
    assert "host None" not in caplog.text
    lock.release()
    assert (out / ".overnight.lock").read_text() == "{not json"   # not ours to remove


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


def test_the_lock_names_its_run_before_the_manifest_is_written(tmp_path, cfg, write_parquet):
    """A run refused while the holder opens names the holder's run id, not an empty one (it was written at the
    heartbeat 30 s later)."""
    from overnight.pipeline.job import open_job

    inp = write_parquet({"id": ["a"], "prompt": ["hi"]})
    job = open_job(cfg(inp, tmp_path / "out"))
    try:
        held = json.loads((tmp_path / "out" / ".overnight.lock").read_text())
        assert held["run_id"] == job.manifest["run_id"] != ""
    finally:
        job.lock.release()


def test_a_full_disk_leaves_no_lock_file_behind_and_says_to_free_space(tmp_path, monkeypatch):
    import errno

    import overnight.pipeline.output.lock as lockmod

    class Full:
        def __new__(cls, path, mode="r", *a, **k):
            return super().__new__(cls) if "w" in mode else open(path, mode, *a, **k)

        def __init__(self, path, mode="r", *a, **k):
            self.f = open(path, mode)   # made, as the file system makes it before the write fails

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    out = tmp_path / "out"
    monkeypatch.setattr(lockmod, "open", Full, raising=False)
    with pytest.raises(LockError, match=r"Cannot write the lock .*\.overnight\.lock: No space left on device\. Free "
                                        r"space there, or choose another --out\."):
        RunLock(OutputDir(str(out))).acquire()
    assert os.listdir(out) == []
