"""Ray's driver in parts, without a cluster: how the input is cut into units, and what the driver does with a
worker that is lost, given up on, or unavailable now and then (tests/test_ray.py runs whole jobs on a local
cluster)."""

from __future__ import annotations

from types import SimpleNamespace

import pyarrow as pa
import pytest

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")

from overnight.pipeline.cluster.units import UNITS_PER_WORKER, plan_units  # noqa: E402
from overnight.pipeline.input.source import InputFile  # noqa: E402
from overnight.pipeline.output.lock import LockError  # noqa: E402


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
    d.ray, d.coordinator, d.signals, d.worker_restarts = fake, Handle(coordinator), [], 0
    d.cfg = SimpleNamespace(output=SimpleNamespace(path="/tmp/never-written"))
    d.lock, d.progress = SimpleNamespace(lost=False), SimpleNamespace(close=lambda: None)
    d.publish = SimpleNamespace(close=lambda: None)
    d.num_workers, d._actor = 1, lambda i: Handle(Worker())
    d._drop_unplaced = d._tick = lambda *a: None
    d._install_signals, d._restore_signals = (lambda: {}), (lambda previous: None)
    d._finish = lambda results, failures, restarts: (results, restarts, list(killed))
    results, restarts, killed_in_the_loop = d.run()
    assert restarts == ray_job.MAX_ACTOR_RESTARTS + 2   # more blips than tries, never that many in a row
    assert not retired and not killed_in_the_loop
    assert results[0]["state"] == "completed" and next(passes, None) is None


def test_the_job_metrics_slack_counts_to_a_ray_jobs_stop(tmp_path):
    """A Ray job's status gives the time left to its stop (the deadline less the safety margin, where the driver
    judges the risk) beside the deadline: the slack counts to the stop, as one engine's does."""
    import time

    from prometheus_client.parser import text_string_to_metric_families

    from overnight.pipeline.output.metrics import Metrics
    from overnight.pipeline.report import iso

    path = tmp_path / "job.prom"
    Metrics(str(path), None, "out").update({"state": "running", "rows": {"total": 10, "done": 2}, "eta_s": 100.0,
                                            "deadline": iso(time.time() + 400), "time_left_s": 80.0})
    slack = [s.value for fam in text_string_to_metric_families(path.read_text()) for s in fam.samples
             if s.name == "overnight_deadline_slack_seconds"]
    assert slack == [-20.0]


def test_a_ray_job_stopped_by_its_deadline_keeps_what_its_workers_said_took_the_time():
    from overnight.pipeline.scheduling.when import workers_stop_message

    took = ("deadline reached: 40 rows not done; rerun the same command to continue (the engine took 53s to start, "
            "and the stop came before it was ready: a rerun with the same budget will do the same; give a longer "
            "--time-budget or a later --deadline, past the job's opening and the engine's start-up)")
    m = workers_stop_message("deadline reached", [took, took.replace("53s", "49s")], 80)
    assert m.startswith("deadline reached: 80 rows not done; rerun the same command to continue (the engine took "
                        "53s to start") and m.endswith("start-up)")
    # a worker's own reason when the driver has none; a signal's stop carries no deadline explanation
    assert workers_stop_message(None, [took], 80).startswith("deadline reached: 80 rows")
    assert workers_stop_message("interrupted by SIGTERM", [took], 80) == (
        "interrupted by SIGTERM: 80 rows not done; rerun the same command to continue")
    assert workers_stop_message(None, [None], 3) == "stopped: 3 rows not done; rerun the same command to continue"
    # a worker that did rows: the budget was not the start-up's alone, and a rerun will not do the same
    did = "deadline reached: 10 rows not done; rerun the same command to continue"
    for said in ([took, did], [took, None]):   # (None: a worker that completed its units)
        assert workers_stop_message("deadline reached", said, 50) == (
            "deadline reached: 50 rows not done; rerun the same command to continue")


def test_workers_get_a_model_folder_by_its_absolute_path(tmp_path, cfg, write_parquet, tiny_model, monkeypatch):
    """A worker's process may run in another folder than the driver's: a relative --model goes to it as the folder
    the driver read (and fingerprinted), not as typed."""
    import shutil

    from overnight.pipeline.cluster.preflight import worker_config

    shutil.copytree(tiny_model, tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    c = cfg(write_parquet({"prompt": ["x?"]}), tmp_path / "out", engine={"model": "m"})
    w = worker_config(c, None, 0.0, False)
    assert (c.engine.model, w.engine.model) == ("m", str(tmp_path / "m"))
    assert w.output.metrics_file is None and w.scheduler.lookahead_rows <= 2 * c.engine.max_num_seqs


def test_a_workers_flushed_status_carries_its_last_forecasts_time_not_the_flushs(tmp_path):
    """The driver counts a worker's ETA down from the time of its forecast (cluster/eta.worker_forecast). The
    status a worker writes at each part carries the last forecast, so it carries that forecast's time: stamped
    at the flush, the ETA read as up to a forecast's spacing too long."""
    import time

    from overnight.pipeline.cluster.actors import ReportingOutputDir
    from overnight.pipeline.cluster.eta import worker_forecast

    got = []
    coordinator = SimpleNamespace(report=SimpleNamespace(remote=lambda i, st: got.append(st)),
                                  progress=SimpleNamespace(remote=lambda i, rows, f, at: got.append(at)))
    out = ReportingOutputDir(str(tmp_path), coordinator, 0)
    forecast = {"eta_s": 60.0, "tokens_per_s": 100.0, "remaining_tokens_predicted": 6000, "remaining_rows": 10}
    out.report_progress({"remaining": 10}, forecast)
    made = got[-1]
    time.sleep(0.3)
    out.write_status({"state": "running", "rows": {"remaining": 10}, "forecast": forecast})
    assert got[-1]["forecast_at"] == made
    assert worker_forecast(got[-1], made + 20.0).eta_s == pytest.approx(40.0)
