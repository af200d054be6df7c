"""`overnight run ... --workers W`: one job over W Ray actors, each owning one engine.

    driver (this process)            coordinator actor                 worker actors w0 .. w(W-1)
    plans units, holds OUT's lock -> hands out units as asked  <-  each runs overnight's own loop (predict,
    forecasts the whole job,         requeues a dead worker's       order, checkpoint) into OUT/workers/w<i>/,
    writes OUT/status.json,          units; carries the stop        pulling its next unit before the current
    drains on SIGTERM                request to every worker        one drains

Losing a worker loses nothing: Ray restarts the actor (or another takes its units), and the rows it already
wrote are left out when its units are read again, so each id is answered once. The deadline is absolute and
the same for every worker; at it every worker stops admitting, drains, flushes, and the job exits 75.
Rerunning the same command continues: every worker resumes against the ids in all of OUT/workers/.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from typing import Optional

from overnight.pipeline.cluster.units import Unit, UnitSource, plan_units
from overnight.pipeline.config import JobConfig
from overnight.pipeline.output.checkpoint import OutputDir, OutputError
from overnight.pipeline.output.layout import check_layout, job_dirs, worker_out
from overnight.pipeline.output.lock import RunLock
from overnight.pipeline.progress import Progress, fmt_duration
from overnight.pipeline.report import EXIT_ENGINE, EXIT_FAILED, EXIT_PARTIAL, Summary, iso

log = logging.getLogger("overnight")

POLL_S = 1.0          # how often the driver looks at its workers
NAMESPACE = "overnight"
MAX_ACTOR_RESTARTS = 3


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
        self.statuses: dict[int, dict] = {}
        self.deaths = 0
        self.started: set[int] = set()  # worker actors the cluster found room for
        self.incarnations: dict[int, str] = {}

    def hello(self, worker: int, incarnation: str, folder: str) -> None:
        """A worker actor was placed and constructed. A new incarnation of a worker (Ray restarted it) means the
        old one died: what it held goes back to the queue."""
        self.started.add(worker)
        if self.incarnations.get(worker, incarnation) != incarnation:
            self.release(worker, folder)
        self.incarnations[worker] = incarnation

    def next(self, worker: int) -> Optional[Unit]:
        if self.stop_reason or not self.pending:
            return None
        unit = self.pending.pop(0)
        self.held.setdefault(worker, []).append(unit)
        return unit

    def release(self, worker: int, folder: str) -> int:
        """A worker died: its units go back to the front of the queue, to be read without what it wrote
        (``folder#n``: the n-th death, so that a worker reading the folder again sees what was written since)."""
        units = self.held.pop(worker, [])
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

    def stop_state(self) -> tuple[Optional[str], int]:
        return self.stop_reason, self.stop_count

    def report(self, worker: int, status: dict) -> None:
        self.statuses[worker] = status

    def snapshot(self) -> tuple[int, dict]:
        return len(self.pending), dict(self.statuses)

    def idle(self) -> tuple[int, int, set]:
        """(units pending, units held by workers, workers placed)."""
        return len(self.pending), sum(len(u) for u in self.held.values()), self.started


class RemoteStop:
    """A worker's stop requests: the driver's (through the coordinator), polled at most once a second. It stands
    in for the runner's signal handlers, which only the main thread of a process may install."""

    def __init__(self, coordinator):
        self.coordinator = coordinator
        self._first: Optional[str] = None
        self._count = 0
        self._last = 0.0

    def _poll(self) -> None:
        now = time.monotonic()
        if now - self._last >= 1.0:
            self._last = now
            reason, self._count = _ray().get(self.coordinator.stop_state.remote())
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

    def write_status(self, status: dict) -> None:
        super().write_status(status)
        self.coordinator.report.remote(self.index, status)


def jobmod_deadline(sc) -> float:
    """The job's absolute deadline (the driver made it one), as seconds since the epoch."""
    from overnight.pipeline.scheduling.deadline import parse_deadline
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
            return {"state": "partial", "exit_code": EXIT_PARTIAL, "message": "deadline reached", "num_ok": 0,
                    "num_error": 0, "num_resumed": 0, "num_duplicates": 0, "num_output_tokens": 0,
                    "output_tokens_per_s": 0.0, "elapsed_s": 0.0}
        job = self._open(lambda: ray.get(self.coordinator.next.remote(self.index)))
        runner = Runner(job, EngineSupervisor(factory_for(self.cfg), job), is_tty=False)
        runner.signals = RemoteStop(self.coordinator)

        def taken(n: int) -> None:
            runner.tally.num_rows += n
        job.source.on_unit = taken
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
        source = UnitSource(cfg.input, next_unit, self._done_in)
        source.files = self.files
        out = ReportingOutputDir(worker_out(cfg.output.path, self.index).url, self.coordinator, self.index)
        model = open_model(cfg)
        fields = mf.fingerprint_fields(cfg, model.requested, model.chat)
        # The job's deadline as the driver fixed it; one that passed while this worker started stops it at once.
        sc = cfg.scheduler
        deadline_at = jobmod_deadline(sc) if sc.deadline else None
        margin = sc.safety_margin_s or 0.0
        job = jobmod._open_locked(cfg, False, source, out, model, fields, RunLock(out), deadline_at, margin)
        job.lazy_engine = True  # a worker may get no unit, or only rows already done
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


def run_on_ray(cfg: JobConfig, fresh: bool, workers: int, address: Optional[str] = None,
               is_tty: Optional[bool] = None, on_started=None) -> Summary:
    """Run the job over ``workers`` Ray actors; returns the job's summary (exit codes as for one engine)."""
    from overnight.pipeline.input.source import ParquetSource
    from overnight.pipeline.job import resolve_deadline
    from overnight.pipeline.input.stage import open_model

    ray = _ray()
    if not cfg.output.path:
        raise OutputError("No output folder given. Pass --out OUT (or output.path in the config).")
    started = time.time()
    deadline_at, margin = resolve_deadline(cfg.scheduler, started)
    source = ParquetSource(cfg.input)
    open_model(cfg)  # a bad model fails here, not in every worker
    check_layout(cfg.output.path, None, ray=True)
    root = OutputDir(cfg.output.path)
    lock = RunLock(root)
    lock.acquire()
    try:
        if fresh:
            for d in job_dirs(cfg.output.path):
                d.out.clear()
        units = plan_units(source.files, workers, cfg.input.limit)
        total = sum(u.num_rows for u in units)
        # Every worker gets the same absolute deadline and margin.
        sc = dataclasses.replace(cfg.scheduler, deadline=iso(deadline_at) if deadline_at else None, time_budget=None,
                                 safety_margin_s=margin if deadline_at else cfg.scheduler.safety_margin_s)
        # A worker holds no more rows than its engine runs plus one refill: what it does not hold stays in the
        # queue for whichever worker frees up first.
        sc = dataclasses.replace(sc, lookahead_rows=min(sc.lookahead_rows, 2 * cfg.engine.max_num_seqs))
        wcfg = dataclasses.replace(cfg, scheduler=sc, output=dataclasses.replace(cfg.output, log_every_seconds=1e9))
        if not ray.is_initialized():
            address = address or os.environ.get("RAY_ADDRESS") or None
            # A local cluster gets a slot for every worker, even beyond the machine's cores (echo engines, or
            # small models sharing the cores); a real cluster offers what it has.
            cpus = None if address else max(os.cpu_count() or 1, workers)
            ray.init(address=address, num_cpus=cpus, include_dashboard=False, log_to_driver=True,
                     configure_logging=False)
        driver = Driver(ray, wcfg, units, total, workers, root, lock, deadline_at, started, is_tty,
                        cfg.output.log_every_seconds, source.files)
        return driver.run(on_started)
    finally:
        lock.release()


class Driver:
    def __init__(self, ray, cfg, units, total, workers, root, lock, deadline_at, started, is_tty, log_every, files):
        import uuid

        self.ray, self.cfg, self.total, self.num_workers = ray, cfg, total, workers
        self.root, self.lock, self.deadline_at, self.started = root, lock, deadline_at, started
        self.files = files
        # Names of this job's actors: unique, so that jobs may share a cluster.
        self.prefix = f"overnight-{uuid.uuid4().hex[:8]}"
        self.coordinator_name = f"{self.prefix}-coordinator"
        self.coordinator = ray.remote(Coordinator).options(num_cpus=0, name=self.coordinator_name,
                                                           namespace=NAMESPACE).remote(units)
        # Rows done in each worker folder: from the manifests at the start, then from each worker's status.
        self.done_in = {d.worker: (d.out.read_manifest() or {}).get("counts", {}).get("num_done", 0)
                        for d in job_dirs(cfg.output.path) if d.worker is not None}
        self.done_before = sum(self.done_in.values())
        self.progress = Progress(total, min(self.done_before, total), log_every, is_tty=is_tty)
        self.signals: list[str] = []
        self.warned = self.warned_unplaced = False
        log.info(f"{len(units)} units of the input ({total} rows, {self.done_before} already done) over {workers} "
                 f"Ray workers; one engine each")

    def _actor(self, i: int):
        ray = self.ray
        gpus = ray.cluster_resources().get("GPU", 0)
        tp = self.cfg.engine.tensor_parallel_size
        opts = {"num_gpus": tp} if gpus >= tp else {"num_cpus": 1}
        cls = ray.remote(Worker).options(max_restarts=MAX_ACTOR_RESTARTS, max_task_retries=0,
                                         name=f"{self.prefix}-w{i:05d}", namespace=NAMESPACE, **opts)
        return cls.remote(self.cfg, i, self.num_workers, self.coordinator_name, self.files)

    def run(self, on_started=None) -> Summary:
        ray = self.ray
        actors = [self._actor(i) for i in range(self.num_workers)]
        calls = {actors[i].run.remote(): i for i in range(self.num_workers)}
        if on_started:
            on_started(actors)
        results: dict[int, dict] = {}
        failures: dict[int, str] = {}
        restarts = 0
        previous = self._install_signals()
        try:
            while calls:
                ready, _ = ray.wait(list(calls), num_returns=1, timeout=POLL_S)
                for ref in ready:
                    i = calls.pop(ref)
                    try:
                        results[i] = ray.get(ref)
                        failures.pop(i, None)
                    except ray.exceptions.ActorUnavailableError as e:
                        # Restarting, or unreachable for now and maybe still working: ask again. A restarted
                        # worker's new incarnation gives back what the dead one held (Coordinator.hello).
                        restarts += 1
                        log.warning(f"worker w{i} is unavailable ({type(e).__name__}); asking it again")
                        if restarts <= MAX_ACTOR_RESTARTS * self.num_workers:
                            calls[actors[i].run.remote()] = i
                    except ray.exceptions.RayActorError as e:
                        restarts += 1
                        if self._restarted(actors[i]):  # its new incarnation gave back what it held (hello)
                            log.warning(f"worker w{i} was lost ({type(e).__name__}) and restarted; its units go "
                                        f"back to the queue and what it wrote is kept")
                            calls[actors[i].run.remote()] = i
                        else:
                            n = ray.get(self.coordinator.release.remote(i, worker_out(self.cfg.output.path, i).url))
                            log.warning(f"worker w{i} was lost for good ({type(e).__name__}); its {n} units go "
                                        f"back to the queue and what it wrote is kept")
                    except ray.exceptions.RayTaskError as e:
                        n = ray.get(self.coordinator.release.remote(i, worker_out(self.cfg.output.path, i).url))
                        cause = getattr(e, "cause", None) or e
                        failures[i] = (type(cause).__name__, str(cause).strip().splitlines()[0])
                        log.error(f"worker w{i} failed ({failures[i][1]}); its {n} units go back to the queue")
                    self._rerun_idle(calls, actors, results, failures)
                self._drop_unplaced(calls, actors)
                self._tick()
        finally:
            self._restore_signals(previous)
            self.progress.close()
        try:
            return self._finish(results, failures, restarts)
        finally:
            for a in actors + [self.coordinator]:  # their names are free for the next run on this cluster
                ray.kill(a)

    def _restarted(self, actor) -> bool:
        """Whether Ray brought a lost worker back (it answers), rather than giving it up."""
        try:
            self.ray.get(actor.ping.remote(), timeout=120)
            return True
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError):
            return False

    def _drop_unplaced(self, calls, actors) -> None:
        """Workers the cluster had no room for are not waited for once no work is left for them: every unit is
        done, the job stopped, or no placed worker is left to go on."""
        pending, held, started = self.ray.get(self.coordinator.idle.remote())
        waiting = [ref for ref, i in calls.items() if i not in started]
        placed_running = len(calls) - len(waiting)
        stopped = self.signals or self.ray.get(self.coordinator.stop_state.remote())[0] or (
            self.deadline_at is not None and time.time() >= self.deadline_at)
        # Wait for them while work is left and the job still runs (a placed worker at it, or none placed yet);
        # not after a stop.
        keep_waiting = not stopped and bool(pending or held) and bool(placed_running or not started)
        if not waiting or keep_waiting:
            if waiting and time.time() - self.started > 60 and not self.warned_unplaced:
                self.warned_unplaced = True
                log.warning(f"{len(waiting)} of {self.num_workers} workers have not started after 60 s: the Ray "
                            f"cluster has no room for them ({self.ray.cluster_resources()}); the others go on")
            return
        for ref in waiting:
            i = calls.pop(ref)
            self.ray.kill(actors[i])
        log.info(f"{len(waiting)} workers never started (no room in the cluster) and are not needed any more")

    def _rerun_idle(self, calls, actors, results, failures) -> None:
        """Units that came back to the queue go to a worker that finished its pass (not one that stopped)."""
        pending, _ = self.ray.get(self.coordinator.snapshot.remote())
        if not pending or self.signals:
            return
        for i, a in enumerate(actors):
            if i not in calls.values() and i not in failures and results.get(i, {}).get("state") == "completed":
                calls[a.run.remote()] = i
                del results[i]
                return

    def _tick(self) -> None:
        pending, statuses = self.ray.get(self.coordinator.snapshot.remote())
        done = self._done_now(statuses)
        tokens = sum(st.get("output_tokens") or 0 for st in statuses.values())
        if done > self.progress.done:
            self.progress.update(done - self.progress.done, max(0, tokens - self.progress.tokens))
        elapsed = time.time() - self.started
        rate = (done - self.done_before) / elapsed if elapsed > 0 else 0.0
        left = max(0, self.total - done)
        eta = left / rate if rate > 0 else None
        time_left = self.deadline_at - time.time() if self.deadline_at else None
        at_risk = eta is not None and time_left is not None and eta > time_left
        self.progress.set_forecast(eta, time_left, at_risk)
        if at_risk and not self.warned and done > self.done_before:
            self.warned = True
            fits = int(rate * max(0.0, time_left))
            log.warning(f"deadline at risk: at {rate:.1f} rows/s over {self.num_workers} workers the job needs "
                        f"{fmt_duration(eta)} but {fmt_duration(time_left)} is left; about {max(0, left - fits)} "
                        f"rows will be left undone (a rerun continues them)")
        self.root.write_status(self._status("running", None, statuses, pending, eta))
        self.lock.heartbeat()
        if log.isEnabledFor(logging.DEBUG):
            for i, st in sorted(statuses.items()):
                log.debug(f"w{i}: {st.get('state')} {st.get('rows', {}).get('done')} rows done, "
                          f"{st.get('output_tokens_per_s')} tok/s")

    def _done_now(self, statuses: dict) -> int:
        for i, st in statuses.items():
            self.done_in[i] = max(self.done_in.get(i, 0), st.get("rows", {}).get("done", 0))
        return sum(self.done_in.values())

    def _status(self, state, exit_code, statuses, pending, eta, message=None) -> dict:
        done = self._done_now(statuses)
        return {"state": state, "exit_code": exit_code, "message": message, "out": self.root.shown(),
                "workers": self.num_workers, "units_pending": pending,
                "rows": {"total": self.total, "done": done, "remaining": max(0, self.total - done)},
                "output_tokens_per_s": round(sum(s.get("output_tokens_per_s") or 0 for s in statuses.values()
                                                 if s.get("state") == "running"), 2),
                "eta_s": eta, "deadline": iso(self.deadline_at) if self.deadline_at else None,
                "per_worker": {f"w{i}": {"state": s.get("state"), "rows_done": s.get("rows", {}).get("done"),
                                         "exit_code": s.get("exit_code")} for i, s in sorted(statuses.items())},
                "updated_at": iso(time.time())}

    def _finish(self, results: dict, failures: dict, restarts: int) -> Summary:
        pending, statuses = self.ray.get(self.coordinator.snapshot.remote())
        done = self._done_now(statuses)
        states = [r["state"] for r in results.values()]
        complete = not pending and bool(states) and all(s == "completed" for s in states) and not failures
        stop = self.ray.get(self.coordinator.stop_state.remote())[0]
        left = max(0, self.total - done)
        if complete:
            state, code, message = "completed", 0, None
        elif stop or self.signals or "partial" in states or "interrupted" in states:
            state, code = ("interrupted" if self.signals else "partial"), EXIT_PARTIAL
            reason = stop or next((r["message"].split(":")[0] for r in results.values() if r.get("message")),
                                  "stopped")
            message = f"{reason}: {left} rows not done; rerun the same command to continue"
        elif failures:
            engine = all(kind == "EngineError" for kind, _ in failures.values())
            state, code = "failed", (EXIT_ENGINE if engine else EXIT_FAILED)
            what = "; ".join(sorted({m for _, m in failures.values()}))
            message = (f"{what}; {left} rows not done" + ("; the rows finished are saved, rerun to continue"
                                                           if engine else ""))
        else:
            state, code, message = "failed", EXIT_FAILED, f"{left} rows not done; rerun to continue"
        self.root.write_status(self._status(state, code, statuses, pending, 0.0 if complete else None, message))
        ok = sum(r["num_ok"] for r in results.values())
        err = sum(r["num_error"] for r in results.values())
        toks = sum(r["num_output_tokens"] for r in results.values())
        elapsed = time.time() - self.started
        this_attempt = sum(r["output_tokens_per_s"] * r["elapsed_s"] for r in results.values())
        return Summary(run_id=f"ray-{self.num_workers}-workers", out=self.root.shown(), state=state, exit_code=code,
                       num_rows=self.total, num_done=done, num_ok=ok, num_error=err,
                       num_resumed=sum(r["num_resumed"] for r in results.values()),
                       num_duplicates=sum(r["num_duplicates"] for r in results.values()), num_output_tokens=toks,
                       elapsed_s=round(elapsed, 3),
                       output_tokens_per_s=round(this_attempt / elapsed, 2) if elapsed else 0.0,
                       message=message, extra={"workers": {f"w{i}": r["state"] for i, r in sorted(results.items())},
                                               "worker_restarts": restarts,
                                               "failures": {f"w{i}": m for i, (_, m) in failures.items()}})

    # -- signals ---------------------------------------------------------------------------------
    def _install_signals(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handle(signum, frame):
            name = signal.Signals(signum).name
            self.signals.append(name)
            self.coordinator.stop.remote(f"interrupted by {name}")
            log.warning(f"{name}: every worker stops admitting rows and drains (a second signal aborts at once)")
        return {s: signal.signal(s, handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _restore_signals(self, previous: dict) -> None:
        for s, h in previous.items():
            signal.signal(s, h)
