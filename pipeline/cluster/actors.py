"""The actors of a job on Ray: the coordinator (the queue of units, the stop request, the workers' statuses)
and the worker (one engine; overnight's own loop over the units it pulls). The driver is in ray_job."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Optional

from overnight.pipeline.cluster.units import Unit, unit_source
from overnight.pipeline.config import JobConfig
from overnight.pipeline.output.checkpoint import OutputDir, OutputError
from overnight.pipeline.output.layout import job_dirs, worker_out
from overnight.pipeline.output.lock import RunLock
from overnight.pipeline.report import EXIT_FAILED, EXIT_PARTIAL

log = logging.getLogger("overnight")

NAMESPACE = "overnight"


def _ray():
    try:
        import ray
    except ImportError:
        raise OutputError("--workers runs on Ray, which is not installed. Install it with "
                          "`pip install 'overnight[ray]'`, or run without --workers.") from None
    return ray


class Coordinator:
    """The queue of units (a Ray actor): what each worker holds, the stop request, each worker's last status."""

    def __init__(self, units: list[Unit]):
        self.pending = list(units)
        self.held: dict[int, list[Unit]] = {}
        self.stop_reason: Optional[str] = None
        self.stop_count = 0
        self.lost_to: Optional[str] = None  # the driver lost OUT's lock to this run: workers write nothing more
        self.statuses: dict[int, dict] = {}
        self.deaths = 0
        self.started: set[int] = set()  # worker actors the cluster found room for
        self.incarnations: dict[int, str] = {}
        # workers the driver gave up on (unavailable too long) and killed: if one still runs (a node cut off
        # while its process lives on), it writes nothing more, for its units are another worker's now
        self.retired: set[int] = set()

    def hello(self, worker: int, incarnation: str, folder: str) -> None:
        """A worker actor was placed and constructed. A new incarnation of a worker (Ray restarted it) means the
        old one died: what it held goes back to the queue."""
        self.started.add(worker)
        if self.incarnations.get(worker, incarnation) != incarnation:
            self.release(worker, folder)
        self.incarnations[worker] = incarnation

    def next(self, worker: int) -> Optional[Unit]:
        if self.stop_reason or worker in self.retired or not self.pending:
            return None
        unit = self.pending.pop(0)
        self.held.setdefault(worker, []).append(unit)
        return unit

    def release(self, worker: int, folder: str) -> int:
        """A worker died: its units go back to the front of the queue, to be read without what it wrote
        (``folder#n``: the n-th death, so that a worker reading the folder again sees what was written since)."""
        units = self.held.pop(worker, [])
        if worker in self.statuses:  # its last status no longer runs: not in the job's tok/s or ETA (a restart
            self.statuses[worker] = dict(self.statuses[worker], state="lost")  # reports anew)
        self.deaths += 1
        mark = f"{folder}#{self.deaths}"
        self.pending[:0] = [dataclasses.replace(u, recheck=u.recheck + (mark,)) for u in units]
        return len(units)

    def finished(self, worker: int) -> None:
        """A worker returned after a full pass: what it held is written."""
        self.held.pop(worker, None)

    def stop(self, reason: str) -> None:
        self.stop_reason = self.stop_reason or reason
        self.stop_count += 1

    def lose(self, to: str) -> None:
        """The driver lost OUT's lock to another run: every worker stops at once and writes nothing more."""
        self.lost_to = to
        self.stop("another run took over the output folder")
        self.stop_count = max(self.stop_count, 2)  # urgent: rows in flight are aborted, not drained

    def retire(self, worker: int, folder: str) -> int:
        """The driver gave this worker up: its units go back to the queue, and it may write nothing more."""
        self.retired.add(worker)
        return self.release(worker, folder)

    def stop_state(self, worker: Optional[int] = None) -> tuple[Optional[str], int, Optional[str]]:
        """(the stop's reason, how many stops were asked, whose the folders are now if not this job's); for a
        worker the driver gave up on, an urgent stop and its folder no longer its own."""
        if worker is not None and worker in self.retired and not self.lost_to:
            return (self.stop_reason or "given up on by the driver", 2,
                    "the job's driver, which gave this worker up and handed its units to the others")
        return self.stop_reason, self.stop_count, self.lost_to

    def report(self, worker: int, status: dict) -> None:
        if worker not in self.retired:  # (a retired worker still running is not in the job's rate or ETA)
            self.statuses[worker] = status

    def progress(self, worker: int, rows: dict, forecast: dict, at: float) -> None:
        """A worker's latest forecast (every few seconds, between its status files): the driver's ETA needs it."""
        if worker in self.retired:
            return
        st = self.statuses.setdefault(worker, {})
        st.update(state="running", rows=rows, forecast=forecast, forecast_at=at)

    def snapshot(self) -> tuple[int, dict]:
        return len(self.pending), dict(self.statuses)

    def idle(self) -> tuple[int, int, set]:
        """(units pending, units held by workers, workers placed)."""
        return len(self.pending), sum(len(u) for u in self.held.values()), self.started


def _not_run(state: str, exit_code: int, message: str) -> dict:
    """A worker's summary of a pass it did not start."""
    return {"state": state, "exit_code": exit_code, "message": message, "num_ok": 0, "num_error": 0,
            "num_resumed": 0, "num_duplicates": 0, "num_output_tokens": 0, "output_tokens_per_s": 0.0,
            "elapsed_s": 0.0}


class WorkerLock(RunLock):
    """A worker folder's lock: the driver's lock on OUT covers it. Before each write it asks the coordinator
    whether the driver lost that lock to another run, whose workers write in these folders now, or gave this
    worker up."""

    def __init__(self, out, coordinator, worker: int):
        super().__init__(out)
        self.coordinator, self.worker = coordinator, worker

    def confirm(self) -> bool:
        if not self.lost:
            lost_to = _ray().get(self.coordinator.stop_state.remote(self.worker))[2]
            if lost_to:
                self.lose(lost_to)
        return not self.lost


class RemoteStop:
    """A worker's stop requests: the driver's (through the coordinator), polled at most once a second. It stands
    in for the runner's signal handlers, which only the main thread of a process may install."""

    def __init__(self, coordinator, lock=None, worker: Optional[int] = None):
        self.coordinator, self.worker = coordinator, worker
        self.lock = lock  # the worker folder's: lost when the driver lost OUT's
        self._first: Optional[str] = None
        self._count = 0
        self._last = 0.0
        self.on_request = None  # (the runner's hook for a signal it hears: a worker hears none, the driver does)

    def _poll(self) -> None:
        now = time.monotonic()
        if now - self._last >= 1.0:
            self._last = now
            reason, self._count, lost_to = _ray().get(self.coordinator.stop_state.remote(self.worker))
            if lost_to and self.lock is not None:
                self.lock.lose(lost_to)
            self._first = self._first or reason

    @property
    def first(self) -> Optional[str]:
        self._poll()
        return self._first

    @property
    def is_urgent(self) -> bool:
        self._poll()
        return self._count >= 2

    def install(self) -> "RemoteStop":
        return self

    def restore(self) -> None:
        pass


class ReportingOutputDir(OutputDir):
    """A worker's folder: each status it writes also goes to the coordinator, for the job's one status."""

    def __init__(self, url: str, coordinator, index: int):
        super().__init__(url)
        self.coordinator, self.index = coordinator, index
        self.forecast_at: Optional[float] = None  # when the last forecast came (the status carries that one)

    def write_status(self, status: dict) -> None:
        super().write_status(status)
        # the forecast's own time, not the flush's: the driver counts its ETA down from it (cluster/eta.py)
        self.coordinator.report.remote(self.index, dict(status, forecast_at=self.forecast_at or time.time()))

    def report_progress(self, rows: dict, forecast: dict) -> None:
        self.forecast_at = time.time()
        self.coordinator.progress.remote(self.index, rows, forecast, self.forecast_at)


def jobmod_deadline(sc) -> float:
    """The job's absolute deadline (the driver made it one), as seconds since the epoch."""
    from overnight.pipeline.scheduling.when import parse_deadline
    return parse_deadline(sc.deadline, 0.0)


class Worker:
    """One engine (a Ray actor). Each ``run`` is an attempt of overnight's own loop over the units it pulls."""

    def __init__(self, cfg: JobConfig, index: int, num_workers: int, coordinator: str, files: list):
        if cfg.engine.kind == "vllm" and cfg.engine.cpu_threads_bind is None and not _ray().get_gpu_ids():
            # vLLM on CPUs: each worker binds its own cores, so that workers on one machine do not contend.
            cores = os.cpu_count() or 1
            per = max(1, cores // num_workers)
            first = (index * per) % cores
            bind = str(first) if per == 1 else f"{first}-{min(cores, first + per) - 1}"
            cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, cpu_threads_bind=bind))
        self.cfg, self.index = cfg, index
        self.files = files  # the driver's listing: units name its files by index
        import uuid

        self.coordinator = _ray().get_actor(coordinator, namespace=NAMESPACE)
        self.coordinator.hello.remote(index, uuid.uuid4().hex, worker_out(cfg.output.path, index).url)
        # What the engine and its libraries print goes to stderr, which Ray forwards to the driver's stderr:
        # the driver's stdout carries only its summary (or --json's one document).
        os.dup2(2, 1)
        self._seen: dict = {}
        logging.getLogger("overnight").setLevel(logging.WARNING)  # the driver speaks for the job

    def run(self) -> dict:
        from overnight.pipeline.engine import factory_for
        from overnight.pipeline.engine.supervisor import EngineSupervisor
        from overnight.pipeline.runner import Runner

        ray = _ray()
        sc = self.cfg.scheduler
        if sc.deadline and jobmod_deadline(sc) <= time.time():  # it started after the job's deadline
            return _not_run("partial", EXIT_PARTIAL, "deadline reached")
        lost_to = ray.get(self.coordinator.stop_state.remote(self.index))[2]
        if lost_to:  # the driver lost OUT to another run, or gave this worker up: not even its manifest is written
            return _not_run("failed", EXIT_FAILED, f"another run took over the output folder ({lost_to})")
        from overnight.pipeline.output.lock import LockError
        try:
            job = self._open(lambda: ray.get(self.coordinator.next.remote(self.index)))
        except LockError as e:  # lost while it scanned the folders, before its manifest: nothing written
            return _not_run("failed", EXIT_FAILED, str(e))
        runner = Runner(job, EngineSupervisor(factory_for(self.cfg), job), is_tty=False)
        runner.signals = RemoteStop(self.coordinator, job.lock, self.index)

        def taken(n: int) -> None:
            runner.tally.num_rows += n

        def skipped(n: int) -> None:  # rows whose id repeats one met earlier in the input (the driver found them)
            runner.tally.num_duplicates += n

        def elsewhere(n: int) -> None:  # rows a dead worker's folder holds: not this worker's (it left them
            runner.tally.num_rows -= n  # "remaining" in its status, and unread in its forecast, to the end)
        job.source.on_unit, job.source.on_duplicates, job.source.on_done_elsewhere = taken, skipped, elsewhere
        summary = runner.run()
        if summary.state == "completed":
            self.coordinator.finished.remote(self.index)
        return dataclasses.asdict(summary)

    def ping(self) -> bool:
        return True

    def _done_in(self, mark: str):
        """What a dead worker's folder holds (``folder#n``: read once per death), as a Scan of compact keys."""
        if mark not in self._seen:
            from overnight.pipeline.output.checkpoint import Scan
            self._seen = {mark: OutputDir(mark.rsplit("#", 1)[0]).scan(self.cfg.input.id_column, into=Scan())}
        return self._seen[mark]

    def _open(self, next_unit):
        """The worker's job: units as its input, its own folder, resuming against every worker folder's ids."""
        from overnight.pipeline import job as jobmod
        from overnight.pipeline.input.stage import open_model
        from overnight.pipeline.output import manifest as mf
        from overnight.pipeline.output.checkpoint import Scan

        cfg = self.cfg
        source = unit_source(cfg.input, next_unit, self._done_in)
        source.files = self.files
        out = ReportingOutputDir(worker_out(cfg.output.path, self.index).url, self.coordinator, self.index)
        model = open_model(cfg)
        fields = mf.fingerprint_fields(cfg, model.requested, model.chat)
        # The job's deadline as the driver fixed it; one that passed while this worker started stops it at once.
        sc = cfg.scheduler
        deadline_at = jobmod_deadline(sc) if sc.deadline else None
        margin = sc.safety_margin_s or 0.0
        # Never the completed-job shortcut: it skips the scan, and this folder's parts would be written over.
        job = jobmod._open_locked(cfg, False, source, out, model, fields, WorkerLock(out, self.coordinator, self.index),
                                  deadline_at, margin, shortcut=False)
        job.lazy_engine = True  # a worker may get no unit, or only rows already done
        job.results_url = cfg.output.path  # the rows done before, in every worker's folder (a resume's warm start)
        own = job.scan
        merged = Scan()
        for d in job_dirs(cfg.output.path):
            if d.worker is not None and d.out.root != out.root:
                d.out.scan(cfg.input.id_column, into=merged)
        if merged.num_parts:
            out.scan(cfg.input.id_column, into=merged)  # the ids of every folder; the counts stay this folder's
            for name in ("num_ok", "num_error", "num_output_tokens", "num_parts", "next_index"):
                setattr(merged, name, getattr(own, name))
            job.scan = merged
        return job
