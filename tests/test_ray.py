"""Ray workers (--workers W) on a real local Ray cluster, with the echo engine: dynamic units, exactly once,
an actor killed mid-run, the deadline, SIGTERM to the driver."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import overnight_cmd

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")

from overnight.pipeline.cluster.ray_job import run_on_ray  # noqa: E402
from overnight.pipeline.cluster.units import UNITS_PER_WORKER, plan_units  # noqa: E402
from overnight.pipeline.input.source import InputFile  # noqa: E402
from overnight.pipeline.output.lock import LockError  # noqa: E402
from overnight.pipeline.tools.inspection import open_results, summary_lines  # noqa: E402
from overnight.pipeline.tools.status import job_status  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def write_input(folder: Path, files: int, rows: int, row_group_size: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        t = pa.table({"id": [f"f{f}-{i}" for i in range(rows)], "prompt": [f"question {f} {i}" for i in range(rows)]})
        pq.write_table(t, folder / f"part-{f}.parquet", row_group_size=row_group_size)
    return folder


def ids_in(out: Path) -> list:
    if not list(out.glob("workers/*/parts/*.parquet")):
        return []
    return [r[0] for r in duckdb.sql(f"select id from read_parquet('{out}/workers/*/parts/*.parquet')").fetchall()]


def test_units_cover_the_input_in_order_many_more_than_workers():
    files = [InputFile(f"/f{i}", f"f{i}", 1000, pa.schema([]), (500, 500)) for i in range(2)]
    units = plan_units(files, 3)
    assert len(units) >= 3 * UNITS_PER_WORKER
    assert sum(u.num_rows for u in units) == 2000
    # slices of row groups, contiguous and in order
    spans = [(f.file_index, f.row_group, f.rows) for u in units for f in u.fragments]
    assert spans[0] == (0, 0, (0, spans[0][2][1]))
    assert sum(u.num_rows for u in plan_units(files, 3, limit=700)) == 700
    # enough row groups: whole row groups, no slices
    many = [InputFile(f"/f{i}", f"f{i}", 100, pa.schema([]), (50, 50)) for i in range(8)]
    assert all(f.rows is None for u in plan_units(many, 2) for f in u.fragments) and len(plan_units(many, 2)) == 16


def test_an_empty_file_or_row_group_makes_no_unit():
    files = [InputFile("/e", "e", 0, pa.schema([]), (0,)), InputFile("/f", "f", 3, pa.schema([]), (3,))]
    units = plan_units(files, 2)
    assert sum(u.num_rows for u in units) == 3 and all(f.file_index == 1 for u in units for f in u.fragments)


def test_a_lost_worker_leaves_the_jobs_rate_and_eta():
    from overnight.pipeline.cluster.actors import Coordinator

    files = [InputFile("/f", "f", 100, pa.schema([]), (100,))]
    c = Coordinator(plan_units(files, 2))
    c.next(0), c.next(1)
    c.report(0, {"state": "running", "output_tokens_per_s": 100.0})
    c.report(1, {"state": "running", "output_tokens_per_s": 120.0})
    assert c.release(1, "/out/workers/w00001") == 1
    _, statuses = c.snapshot()
    assert statuses[1]["state"] == "lost" and statuses[0]["state"] == "running"


def test_a_worker_the_driver_gave_up_on_writes_nothing_more_and_its_units_go_to_the_others(monkeypatch):
    # unavailable too long (a node cut off): killed, but if its process still runs it must not write the rows
    # that another worker now answers
    from overnight.pipeline.cluster import actors
    from overnight.pipeline.output.checkpoint import OutputDir

    files = [InputFile("/f", "f", 100, pa.schema([]), (100,))]
    c = actors.Coordinator(plan_units(files, 2))
    c.next(0), c.next(1)
    left = len(c.pending)
    assert c.retire(1, "/out/workers/w00001") == 1 and len(c.pending) == left + 1
    reason, count, lost_to = c.stop_state(1)
    assert count >= 2 and "gave this worker up" in lost_to   # an urgent stop, and the folder not its own
    assert c.stop_state(0) == (None, 0, None) == c.stop_state()   # the others go on
    assert c.next(1) is None and c.next(0) is not None   # it takes no unit more, whatever it asks
    c.report(1, {"state": "running", "output_tokens_per_s": 100.0})
    c.progress(1, {"done": 3}, {"eta_s": 10.0}, 0.0)
    assert 1 not in c.snapshot()[1]   # nor counts in the job's rate or ETA
    # the worker's lock asks the coordinator (an actor handle, answered here) before each write
    monkeypatch.setattr(actors, "_ray", lambda: SimpleNamespace(get=lambda x: x))
    handle = SimpleNamespace(stop_state=SimpleNamespace(remote=c.stop_state))
    assert not actors.WorkerLock(OutputDir("memory://gave-up/w1"), handle, 1).confirm()
    from overnight.pipeline.job import _still_ours   # asked again just before its folder's first manifest
    with pytest.raises(LockError, match="gave this worker up"):
        _still_ours(actors.WorkerLock(OutputDir("memory://gave-up/w1"), handle, 1), OutputDir("memory://gave-up/w1"))
    assert actors.WorkerLock(OutputDir("memory://gave-up/w0"), handle, 0).confirm()


def test_a_worker_unavailable_now_and_then_over_a_long_job_is_not_given_up_on():
    # Only unavailability in a row counts: a worker that answered in between (a network blip each hour) keeps its
    # units. The driver's loop, with a Ray of plain calls.
    from overnight.pipeline.cluster import ray_job
    from overnight.pipeline.cluster.actors import Coordinator

    passes = iter(["blip", "ok"] * (ray_job.MAX_ACTOR_RESTARTS + 2) + ["last"])
    coordinator = Coordinator([])
    killed, retired = [], []

    class Call:
        def __init__(self, fn):
            self.fn = fn

    class Handle:   # an actor handle over a plain object: x.method.remote(...) is a call made when it is got
        def __init__(self, obj):
            self.obj = obj

        def __getattr__(self, name):
            return SimpleNamespace(remote=lambda *a: Call(lambda: getattr(self.obj, name)(*a)))

    class Worker:
        def run(self):
            what = next(passes)
            if what == "blip":
                raise ray.exceptions.ActorUnavailableError.__new__(ray.exceptions.ActorUnavailableError)
            return {"state": "completed", "more": what == "ok"}

    def snapshot():   # a unit came back to the queue after each pass but the last: the worker is run again
        return (1 if last_result.get("more") else 0), {}
    last_result: dict = {}

    def get(x, timeout=None):
        if not isinstance(x, Call):
            return x
        r = x.fn()
        if isinstance(r, dict) and "state" in r:
            last_result.clear()
            last_result.update(r)
        return r
    coordinator.snapshot = snapshot
    coordinator.retire = lambda i, url: retired.append(i) or 0
    fake = SimpleNamespace(wait=lambda refs, num_returns, timeout: (refs[:1], refs[1:]), get=get,
                           kill=killed.append, exceptions=ray.exceptions)
    d = ray_job.Driver.__new__(ray_job.Driver)
    d.ray, d.coordinator, d.signals = fake, Handle(coordinator), []
    d.cfg = SimpleNamespace(output=SimpleNamespace(path="/tmp/never-written"))
    d.lock, d.progress = SimpleNamespace(lost=False), SimpleNamespace(close=lambda: None)
    d.num_workers, d._actor = 1, lambda i: Handle(Worker())
    d._drop_unplaced = d._tick = lambda *a: None
    d._install_signals, d._restore_signals = (lambda: {}), (lambda previous: None)
    d._finish = lambda results, failures, restarts: (results, restarts, list(killed))
    results, restarts, killed_in_the_loop = d.run()
    assert restarts == ray_job.MAX_ACTOR_RESTARTS + 2   # more blips than tries, never that many in a row
    assert not retired and not killed_in_the_loop
    assert results[0]["state"] == "completed" and next(passes, None) is None


def test_a_worker_whose_folder_completed_resumes_from_its_parts(tmp_path, cfg, local_ray):
    # one worker: no other folder's ids to resume against, so the worker's own scan is all there is
    inp = write_input(tmp_path / "in", 1, 100, 50)
    out = tmp_path / "out"
    c = cfg(inp, out, engine={"kind": "echo", "echo_step_ms": 1, "max_num_seqs": 8}, sampling={"max_tokens": 4},
            output={"flush_rows": 10})
    assert run_on_ray(c, False, 1, is_tty=False).num_done == 100
    parts = sorted(p.name for p in (out / "workers" / "w00000" / "parts").glob("part-*.parquet"))
    # the same job again (another flush size), and once more over a grown input
    c2 = cfg(inp, out, engine={"kind": "echo", "echo_step_ms": 1, "max_num_seqs": 8}, sampling={"max_tokens": 4},
             output={"flush_rows": 1000})
    again = run_on_ray(c2, False, 1, is_tty=False)
    assert (again.state, again.num_resumed, again.num_done) == ("completed", 100, 100)
    write_input(tmp_path / "in2", 1, 120, 60)
    c3 = cfg(tmp_path / "in2", out, engine={"kind": "echo", "echo_step_ms": 1, "max_num_seqs": 8},
             sampling={"max_tokens": 4}, output={"flush_rows": 1000})
    grown = run_on_ray(c3, False, 1, is_tty=False)
    assert (grown.state, grown.num_resumed, grown.num_done) == ("completed", 100, 120)
    ids = ids_in(out)
    assert len(ids) == len(set(ids)) == 120   # the earlier parts were not written over
    assert set(parts) <= {p.name for p in (out / "workers" / "w00000" / "parts").glob("part-*.parquet")}


def test_a_rerun_with_other_settings_is_refused_before_any_worker_starts(tmp_path, cfg, local_ray):
    from overnight.pipeline.output.checkpoint import OutputError

    inp = write_input(tmp_path / "in", 1, 40, 20)
    out = tmp_path / "out"
    engine = {"kind": "echo", "echo_step_ms": 1, "max_num_seqs": 8}
    assert run_on_ray(cfg(inp, out, engine=engine, sampling={"max_tokens": 4}), False, 2, is_tty=False).num_done == 40
    with pytest.raises(OutputError, match=r"holds results of a run with different settings \(sampling.max_tokens: "
                                          r"4 -> 2\)"):
        run_on_ray(cfg(inp, out, engine=engine, sampling={"max_tokens": 2}), False, 3, is_tty=False)
    assert not (out / "workers" / "w00002").exists()   # no new worker ran the rest with the new settings


def test_workers_get_the_json_schema_itself_and_an_edited_file_is_refused(tmp_path, cfg, local_ray):
    from overnight.pipeline.output.checkpoint import OutputError

    inp = write_input(tmp_path / "in", 1, 20, 10)
    out = tmp_path / "out"
    f = tmp_path / "schema.json"   # a path a worker on another node may not have
    f.write_text('{"type": "object"}')
    c = cfg(inp, out, engine={"kind": "echo", "echo_step_ms": 1, "max_num_seqs": 8},
            sampling={"max_tokens": 4, "json_schema": str(f)})
    assert run_on_ray(c, False, 1, is_tty=False).num_done == 20 and len(set(ids_in(out))) == 20
    manifest = out / "workers" / "w00000" / "manifest.json"
    worker = json.loads(manifest.read_text())
    assert worker["config"]["sampling"]["json_schema"] == '{"type": "object"}'
    f.write_text('{"type": "array"}')
    with pytest.raises(OutputError, match=r"sampling.json_schema.type: 'object' -> 'array'"):
        run_on_ray(c, False, 1, is_tty=False)
    # a folder written before stop 37 fingerprinted the file's path: its workers get the path, and resume
    from overnight.pipeline.output import manifest as mf
    worker["fingerprint_fields"]["sampling"]["json_schema"] = str(f)
    worker["fingerprint"] = mf.fingerprint(worker["fingerprint_fields"])
    manifest.write_text(json.dumps(worker))
    again = run_on_ray(c, False, 1, is_tty=False)
    assert (again.state, again.num_resumed) == ("completed", 20), again.message
    assert json.loads(manifest.read_text())["config"]["sampling"]["json_schema"] == str(f)


def test_a_driver_whose_lock_another_run_took_stops_every_worker(tmp_path, cfg, local_ray, monkeypatch):
    from overnight.pipeline.output import lock as lock_module

    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.2)   # the driver's: it reads its lock back every 0.2 s
    inp = write_input(tmp_path / "in", 2, 400, 50)
    out = tmp_path / "out"
    c = cfg(inp, out, engine={"kind": "echo", "echo_step_ms": 20, "max_num_seqs": 8}, sampling={"max_tokens": 6})

    done = threading.Event()

    def take_over():
        while not list(out.glob("workers/*/parts/*.parquet")):
            time.sleep(0.1)
        lock = json.loads((out / ".overnight.lock").read_text())
        theirs = json.dumps(dict(lock, host="other-host", pid=99, token="theirs"))
        while not done.wait(0.05):  # as the other run's heartbeat would (a beat of the driver's thread may read
            (out / ".overnight.lock").write_text(theirs)  # the lock just before a write of ours, and write after)

    t = threading.Thread(target=take_over, daemon=True)
    t.start()
    s = run_on_ray(c, False, 2, is_tty=False)
    done.set()
    t.join(timeout=5)
    assert (s.state, s.exit_code) == ("failed", 1) and s.num_done < 800
    assert "another run took over" in s.message and "host other-host, pid 99" in s.message
    assert json.loads((out / ".overnight.lock").read_text())["token"] == "theirs"
    assert json.loads((out / "status.json").read_text())["state"] == "running"   # no end state written over theirs
    for w in out.glob("workers/*/status.json"):   # each worker stopped without its end status
        assert json.loads(w.read_text())["state"] == "running", w


def test_two_workers_share_the_units_and_answer_each_id_once(tmp_path, cfg, local_ray):
    inp = write_input(tmp_path / "in", 2, 400, 50)
    out = tmp_path / "out"
    # about 12 s of engine time for one worker, so that both are up long before the units run out
    c = cfg(inp, out, engine={"kind": "echo", "echo_step_ms": 20, "max_num_seqs": 8},
            sampling={"max_tokens": 6})
    s = run_on_ray(c, False, 2, is_tty=False)
    assert (s.state, s.exit_code, s.num_done, s.num_rows) == ("completed", 0, 800, 800)
    ids = ids_in(out)
    assert len(ids) == len(set(ids)) == 800
    per_worker = duckdb.sql(f"select count(*) from read_parquet('{out}/workers/*/parts/*.parquet', filename=true) "
                            f"group by regexp_extract(filename, 'w[0-9]+')").fetchall()
    assert len(per_worker) == 2 and min(n for (n,) in per_worker) > 100   # both took units, not a static half
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "completed" and status["rows"]["done"] == 800 and status["units_pending"] == 0
    # a rerun finds everything done
    again = run_on_ray(c, False, 2, is_tty=False)
    assert again.exit_code == 0 and again.num_resumed == 800 and len(ids_in(out)) == 800
    for w in ("w00000", "w00001"):  # nothing was left, so no worker started an engine
        st = json.loads((out / "workers" / w / "status.json").read_text())
        assert st["engine_started"] is False, (w, st)


def test_a_killed_worker_loses_nothing(tmp_path, cfg, local_ray):
    inp = write_input(tmp_path / "in", 2, 500, 50)
    out = tmp_path / "out"
    c = cfg(inp, out, engine={"kind": "echo", "echo_step_ms": 20, "max_num_seqs": 8},
            sampling={"max_tokens": 8})
    killed = []

    def kill_when_writing(actors):
        def go():
            deadline = time.time() + 60
            while time.time() < deadline:
                for i in range(len(actors)):  # the first worker to have written 3 parts, mid-run
                    if len(list((out / "workers" / f"w{i:05d}" / "parts").glob("part-*.parquet"))) >= 3:
                        ray.kill(actors[i], no_restart=False)  # Ray restarts it; its units go back to the queue
                        killed.append(i)
                        return
                time.sleep(0.05)
        threading.Thread(target=go, daemon=True).start()

    s = run_on_ray(c, False, 2, is_tty=False, on_started=kill_when_writing)
    assert killed, "the worker was never killed"
    assert (s.state, s.exit_code) == ("completed", 0), s.message
    assert s.extra["worker_restarts"] >= 1
    ids = ids_in(out)
    assert len(ids) == len(set(ids)) == 1000


def test_the_deadline_stops_every_worker_then_a_rerun_completes(tmp_path, cfg, local_ray, caplog):
    inp = write_input(tmp_path / "in", 2, 600, 50)
    out = tmp_path / "out"
    # two workers do about 13 rows/s: 1200 rows need 90 s, and the budget (which counts Ray's and the workers'
    # start, 5-20 s on 2 busy cores) is 30 s
    slow = {"kind": "echo", "echo_step_ms": 30, "max_num_seqs": 4}
    with caplog.at_level("WARNING", logger="overnight"):
        s = run_on_ray(cfg(inp, out, engine=slow, sampling={"max_tokens": 20}, scheduler={"time_budget": "30s"}),
                       False, 2, is_tty=False)
    assert (s.state, s.exit_code) == ("partial", 75)
    first = ids_in(out)
    assert 0 < len(first) < 1200 and len(first) == len(set(first))
    # the driver warned, from its workers' forecasts, with the rows it expected to leave undone
    warned = [r.getMessage() for r in caplog.records if "deadline at risk: over 2 workers" in r.getMessage()]
    assert warned, [r.getMessage() for r in caplog.records]
    expected = int(re.search(r"about (\d+) of \d+ remaining rows", warned[0]).group(1))
    assert 0 < expected <= 1200
    con, m = open_results(str(out))   # workers' folders are not shards: the job's total and its rows not done
    assert f"rows: {len(first)} ({len(first)} ok, 0 error, {1200 - len(first)} not done)" in summary_lines(con, m)
    s2 = run_on_ray(cfg(inp, out, engine={"kind": "echo", "max_num_seqs": 64}, sampling={"max_tokens": 20}),
                    False, 2, is_tty=False)
    assert (s2.state, s2.exit_code) == ("completed", 0)
    ids = ids_in(out)
    assert len(ids) == len(set(ids)) == 1200
    # the rows done count every folder's rows, the first attempt's too (each worker took fewer this time)
    st = job_status(str(out))
    assert (st["rows_done"], st["rows_left"]) == (1200, 0) and sum(w["rows_done"] for w in st["per_shard"]) == 1200
    assert json.loads((out / "status.json").read_text())["rows"]["done"] == 1200


def test_sigterm_to_the_driver_drains_every_worker_and_exits_75(tmp_path, tiny_model):
    inp = write_input(tmp_path / "in", 2, 400, 50)
    out = tmp_path / "out"
    args = [*overnight_cmd(), "run", str(inp), "--out", str(out), "--workers", "2", "--engine", "echo",
            "--echo-step-ms", "30", "--max-num-seqs", "4", "--max-tokens", "20", "--model", tiny_model,
            "--flush-rows", "4", "--grace", "5s", "--json"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    status = out / "status.json"
    deadline = time.time() + 120
    while time.time() < deadline:
        if status.exists() and json.loads(status.read_text() or "{}").get("rows", {}).get("done", 0) >= 8:
            break
        time.sleep(0.2)
    running = json.loads(subprocess.run([*overnight_cmd(), "status", str(out), "--json"], capture_output=True,
                                        text=True, check=True).stdout)
    assert running["state"] == "running" and running["workers"] == 2 and running["rows_total"] == 800
    assert {w["state"] for w in running["per_shard"]} <= {"running", "not started"}
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr[-3000:]
    summary = json.loads(stdout)
    assert summary["state"] == "interrupted" and "SIGTERM" in summary["message"]
    ids = ids_in(out)
    assert 0 < len(ids) < 800 and len(ids) == len(set(ids))
    assert json.loads(status.read_text())["exit_code"] == 75
    after = json.loads(subprocess.run([*overnight_cmd(), "status", str(out), "--json"], capture_output=True,
                                      text=True, check=True).stdout)
    assert after["state"] == "interrupted" and after["exit_code"] == 75


def test_workers_the_cluster_has_no_room_for_are_not_waited_for(tmp_path, cfg, local_ray, caplog):
    inp = write_input(tmp_path / "in", 1, 200, 50)
    out = tmp_path / "out"
    c = cfg(inp, out, engine={"kind": "echo", "max_num_seqs": 16}, sampling={"max_tokens": 4})
    with caplog.at_level("INFO", logger="overnight"):
        s = run_on_ray(c, False, 3, is_tty=False)   # the local cluster has 2 CPUs: one worker never starts
    assert (s.state, s.exit_code) == ("completed", 0)
    assert len(ids_in(out)) == 200
    assert "1 workers never started (no room in the cluster)" in caplog.text


def test_a_signal_while_a_ray_job_opens_stops_it_with_75(tmp_path, cfg, local_ray, monkeypatch):
    import os

    import overnight.pipeline.input.source as source
    from overnight.pipeline.api import run_job

    opened = source.open_source

    def open_and_signal(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)   # as the driver lists the input, before any worker exists
        return opened(*a, **k)

    def unhandled(signum, frame):
        raise AssertionError("SIGTERM while the Ray job opened was not recorded")

    monkeypatch.setattr(source, "open_source", open_and_signal)
    inp = write_input(tmp_path / "in", 1, 100, 50)
    before = signal.signal(signal.SIGTERM, unhandled)
    try:
        s = run_job(cfg(inp, tmp_path / "out", engine={"kind": "echo", "echo_step_ms": 20, "max_num_seqs": 4},
                        cluster={"workers": 2}), is_tty=False)
        assert signal.getsignal(signal.SIGTERM) == unhandled
    finally:
        signal.signal(signal.SIGTERM, before)
    assert (s.exit_code, s.state) == (75, "interrupted") and s.num_done < 100
