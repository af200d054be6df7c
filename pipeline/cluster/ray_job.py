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
import time
from typing import Optional

from overnight.pipeline.cluster.actors import NAMESPACE, Coordinator, Worker, _ray
from overnight.pipeline.cluster.eta import job_forecast, worker_forecast
from overnight.pipeline.cluster.idscan import scan_input_ids
from overnight.pipeline.cluster.preflight import check_worker_folders, connect, nothing_to_do, worker_config
from overnight.pipeline.cluster.units import plan_units
from overnight.pipeline.config import ConfigError, JobConfig
from overnight.pipeline.output.checkpoint import OutputDir
from overnight.pipeline.output.layout import check_layout, job_dirs, worker_out
from overnight.pipeline.output.lock import RunLock
from overnight.pipeline.output.metrics import Published
from overnight.pipeline.progress import Progress, fmt_duration
from overnight.pipeline.report import EXIT_ENGINE, EXIT_FAILED, EXIT_PARTIAL, Summary, eta_for, iso
from overnight.pipeline.scheduling.when import workers_stop_message
from overnight.pipeline.signals import StopRequests

log = logging.getLogger("overnight")

POLL_S = 1.0          # how often the driver looks at its workers
MAX_ACTOR_RESTARTS = 3
UNPLACED_S = 60  # a worker not started by then is one the cluster has no room for


def run_on_ray(cfg: JobConfig, fresh: bool, workers: int, address: Optional[str] = None,
               is_tty: Optional[bool] = None, on_started=None, signals=None, retry_errors: bool = False) -> Summary:
    """Run the job over ``workers`` Ray actors; returns the job's summary (exit codes as for one engine).
    signals: run_job's StopRequests, installed before the job opened: a signal recorded there stops the workers
    as one during the run does."""
    from overnight.pipeline.input.source import open_source
    from overnight.pipeline.job import resolve_deadline
    from overnight.pipeline.input.stage import open_model

    ray = _ray()
    if not cfg.output.path:
        raise ConfigError("No output folder given. Pass --out OUT (or output.path in the config).")
    started = time.time()
    deadline_at, margin = resolve_deadline(cfg.scheduler, started)
    source = open_source(cfg.input)
    model = open_model(cfg)  # a bad model fails here, not in every worker
    check_layout(cfg.output.path, None, ray=True)
    root = OutputDir(cfg.output.path)
    lock = RunLock(root, split="ray")
    lock.acquire()
    try:
        # again, holding the lock: an unsharded run may have ended in OUT, or a shard begun, since the check
        check_layout(cfg.output.path, None, ray=True)
        legacy = check_worker_folders(cfg, fresh, model, retry_errors)
        units = plan_units(source.files, workers, cfg.input.limit)
        ids = scan_input_ids(cfg, source, fresh, units)
        if ids.gone:
            log.warning(f"{ids.gone} rows in {root.shown()} are no longer in the input (e.g. ids "
                        f"{', '.join(repr(i) for i in ids.examples)}); their results are kept")
        if ids.num_duplicates:
            log.warning(f"{ids.num_duplicates} input rows repeat an id met earlier in the input; each is skipped "
                        f"and counted as a duplicate (give every row a unique id)")
        units = [dataclasses.replace(u, skip=ids.skips.get(u.index, ())) for u in units]
        total = sum(u.num_rows for u in units) - ids.num_duplicates   # to answer: a duplicate is neither done nor left
        if total == 0:
            return nothing_to_do(cfg, root, source, model, workers)
        wcfg = worker_config(cfg, deadline_at, margin, legacy)
        connect(ray, address, workers)
        driver = Driver(ray, wcfg, units, total, workers, root, lock, deadline_at, started, is_tty,
                        cfg.output.log_every_seconds, source.files, margin if deadline_at else 0.0, early=signals,
                        done_at_start=ids.done_in_input, num_removed=ids.gone, num_duplicates=ids.num_duplicates,
                        publish=Published(root, cfg.output))
        return driver.run(on_started)
    finally:
        lock.release()


class Driver:
    def __init__(self, ray, cfg, units, total, workers, root, lock, deadline_at, started, is_tty, log_every, files,
                 margin: float = 0.0, early=None, done_at_start: Optional[int] = None, num_removed: int = 0,
                 num_duplicates: int = 0, publish: Optional[Published] = None):
        import uuid

        self.publish = publish or Published(root, None)  # status.json (and the metrics asked for)

        self.early = early  # a signal that came while the job opened, replayed when the driver's handlers start
        self.margin = margin  # the workers stop admitting this long before the deadline

        self.ray, self.cfg, self.total, self.num_workers = ray, cfg, total, workers
        self.root, self.lock, self.deadline_at, self.started = root, lock, deadline_at, started
        self.files = files
        # Names of this job's actors: unique, so that jobs may share a cluster.
        self.prefix = f"overnight-{uuid.uuid4().hex[:8]}"
        self.coordinator_name = f"{self.prefix}-coordinator"
        self.coordinator = ray.remote(Coordinator).options(num_cpus=0, name=self.coordinator_name,
                                                           namespace=NAMESPACE).remote(units)
        # Rows done in each worker folder: from the manifests at the start, then from each worker's status.
        # each worker folder's counts as this run found them (a folder no worker of this run takes, when a rerun
        # has fewer workers, still holds its rows)
        self.counts_before = {d.worker: (d.out.read_manifest() or {}).get("counts", {})
                              for d in job_dirs(cfg.output.path) if d.worker is not None}
        self.done_in = {i: c.get("num_done", 0) for i, c in self.counts_before.items()}
        self.start_in = dict(self.done_in)
        # the job's rows done at the start: the folders' rows whose ids are the input's (not those gone from it)
        self.done_before = min(sum(self.done_in.values()) if done_at_start is None else done_at_start, total)
        self.num_removed = num_removed
        self.num_rows = total + num_duplicates   # the input's rows, as one engine counts them (duplicates too)
        self.progress = Progress(total, min(self.done_before, total), log_every, is_tty=is_tty)
        self.signals: list[str] = []
        self.worker_restarts = 0
        self.warned = self.warned_unplaced = self.told_lost = False
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
        unavailable: dict[int, int] = {}  # times in a row each worker was found unavailable
        previous = self._install_signals()
        try:
            while calls:
                ready, _ = ray.wait(list(calls), num_returns=1, timeout=POLL_S)
                for ref in ready:
                    i = calls.pop(ref)
                    try:
                        results[i] = ray.get(ref)
                        failures.pop(i, None)
                        unavailable.pop(i, None)  # it answered: only tries in a row count towards giving it up
                    except ray.exceptions.ActorUnavailableError as e:
                        # Restarting, or unreachable for now and maybe still working: ask again. A restarted
                        # worker's new incarnation gives back what the dead one held (Coordinator.hello).
                        self.worker_restarts += 1
                        unavailable[i] = unavailable.get(i, 0) + 1
                        log.warning(f"worker w{i} is unavailable ({type(e).__name__}); asking it again")
                        if unavailable[i] <= MAX_ACTOR_RESTARTS and not self.lock.lost:
                            calls[actors[i].run.remote()] = i
                        else:  # given up on: killed, and retired, so that if it still runs (a node cut off) it
                            ray.kill(actors[i])  # writes nothing more; its units go back to the queue for the others
                            n = ray.get(self.coordinator.retire.remote(i, worker_out(self.cfg.output.path, i).url))
                            log.warning(f"worker w{i} stayed unavailable after {unavailable[i]} tries; it is stopped, "
                                        f"its {n} units go back to the queue and what it wrote is kept")
                    except ray.exceptions.RayActorError as e:
                        self.worker_restarts += 1
                        # its new incarnation gave back what it held (Coordinator.hello)
                        if not self.lock.lost and self._restarted(actors[i]):
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
            return self._finish(results, failures, self.worker_restarts)
        finally:
            for a in actors + [self.coordinator]:  # their names are free for the next run on this cluster
                ray.kill(a)
            self.publish.close()

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
        # Wait for them while work is left and the job still runs (a placed worker at it, or none placed yet, or
        # none has been waited for a minute: a worker whose process is still starting has not said hello either,
        # and another that failed at once leaves no placed worker); not after a stop.
        placed_soon = time.time() - self.started < UNPLACED_S
        keep_waiting = not stopped and bool(pending or held) and bool(placed_running or not started or placed_soon)
        if not waiting or keep_waiting:
            if waiting and not placed_soon and not self.warned_unplaced:
                self.warned_unplaced = True
                log.warning(f"{len(waiting)} of {self.num_workers} workers have not started after {UNPLACED_S} s: the "
                            f"Ray cluster has no room for them ({self.ray.cluster_resources()}); the others go on")
            return
        for ref in waiting:
            i = calls.pop(ref)
            self.ray.kill(actors[i])
        why = ("the job stopped before they started" if stopped else "no work is left for them"
               if not (pending or held) else "the cluster had no room for them, and no placed worker is left")
        log.info(f"{len(waiting)} workers never started and are not needed any more ({why})")

    def _rerun_idle(self, calls, actors, results, failures) -> None:
        """Units that came back to the queue go to a worker that finished its pass (not one that stopped)."""
        pending, _ = self.ray.get(self.coordinator.snapshot.remote())
        if not pending or self.signals or self.lock.lost:
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
        now = time.time()
        left = max(0, self.total - done)
        time_left = self.deadline_at - self.margin - now if self.deadline_at else None
        shown_left = max(0.0, self.deadline_at - now) if self.deadline_at else None  # the deadline itself
        # Each worker's own forecast of the rows it holds, and the rows no worker holds yet (eta.py); until a
        # worker has one, the rows per second so far.
        own = [w for w in (worker_forecast(st, now) for st in statuses.values() if st.get("state") == "running")
               if w is not None]
        f = job_forecast(own, left - sum(w.remaining_rows for w in own), time_left)
        if f is not None:
            eta, at_risk, expected_left = f.eta_s, f.will_miss, f.rows_expected_left
            self.progress.set_forecast(eta, shown_left, at_risk, {"rows_expected_left": expected_left,
                                                                  "eta_low_s": f.eta_low_s, "eta_high_s": f.eta_high_s})
        else:
            elapsed = now - self.started
            rate = (done - self.done_before) / elapsed if elapsed > 0 else 0.0
            eta = left / rate if rate > 0 else None
            at_risk = eta is not None and time_left is not None and eta > time_left
            expected_left = max(0, left - int(rate * max(0.0, time_left or 0.0)))
            self.progress.set_forecast(eta, shown_left, at_risk)
        if at_risk and not self.warned and (f is not None or done > self.done_before):
            self.warned = True
            log.warning(f"deadline at risk: over {self.num_workers} workers the job needs {fmt_duration(eta)} but "
                        f"{fmt_duration(time_left)} is left; about {expected_left} of {left} remaining rows will be "
                        f"left undone (the job stops in time and exits {EXIT_PARTIAL}; a rerun continues them)")
        self.lock.heartbeat()
        if self.lock.lost:
            if not self.told_lost:  # every worker stops at once and writes nothing more; nor does the driver
                self.told_lost = True
                self.ray.get(self.coordinator.lose.remote(self.lock.taken_by()))
            return
        self.publish(self._status("running", None, statuses, pending, eta, forecast=f))
        if log.isEnabledFor(logging.DEBUG):
            for i, st in sorted(statuses.items()):
                log.debug(f"w{i}: {st.get('state')} {st.get('rows', {}).get('done')} rows done, "
                          f"{st.get('output_tokens_per_s')} tok/s")

    def _done_now(self, statuses: dict) -> int:
        """Rows done in the job: those done at its start (the folders' rows whose ids are the input's), and what
        each worker folder's running total (its rows ok and error) has grown by since; not a worker's rows done
        of the units it took this attempt, which leaves out rows of its units another folder answered."""
        for i, st in statuses.items():
            rows = st.get("rows", {})
            self.done_in[i] = max(self.done_in.get(i, 0), (rows.get("ok") or 0) + (rows.get("error") or 0))
        new = sum(max(0, n - self.start_in.get(i, 0)) for i, n in self.done_in.items())
        return min(self.done_before + new, self.total)

    def _status(self, state, exit_code, statuses, pending, eta, message=None, forecast=None) -> dict:
        done = self._done_now(statuses)
        f = forecast
        return {"state": state, "exit_code": exit_code, "message": message, "out": self.root.shown(),
                "workers": self.num_workers, "units_pending": pending,
                "rows": {"total": self.num_rows, "done": done, "remaining": max(0, self.total - done),
                         "duplicates": self.num_rows - self.total, "removed": self.num_removed},
                # each running folder's total, and the totals of those no worker runs this time
                "output_tokens": sum(s.get("output_tokens") or 0 for s in statuses.values()) + sum(
                    c.get("num_output_tokens") or 0 for i, c in self.counts_before.items() if i not in statuses),
                "engine_restarts": sum(s.get("engine_restarts") or 0 for s in statuses.values()),
                "worker_restarts": self.worker_restarts,  # found lost or unavailable, and asked again
                "output_tokens_per_s": round(sum(s.get("output_tokens_per_s") or 0 for s in statuses.values()  # (at
                                                 if s.get("state") == "running" or state != "running"), 2),  # end: all)
                "eta_s": eta_for(state, None if eta is None else round(eta, 1)),
                "eta_range_s": None if f is None or f.eta_low_s is None else [round(f.eta_low_s, 1),
                                                                              round(f.eta_high_s, 1)],
                "rows_expected_left": None if f is None else f.rows_expected_left,
                "deadline": iso(self.deadline_at) if self.deadline_at else None,
                "time_left_s": (round(max(0.0, self.deadline_at - self.margin - time.time()), 1)  # to the stop
                                if self.deadline_at and state == "running" else None),
                "per_worker": {f"w{i}": {"state": s.get("state"), "rows_done": s.get("rows", {}).get("done"),
                                         "exit_code": s.get("exit_code")} for i, s in sorted(statuses.items())},
                "updated_at": iso(time.time())}

    def _finish(self, results: dict, failures: dict, restarts: int) -> Summary:
        pending, statuses = self.ray.get(self.coordinator.snapshot.remote())
        done = self._done_now(statuses)
        states = [r["state"] for r in results.values()]
        left = max(0, self.total - done)
        # every unit answered by the workers that completed: a worker that failed on its way (its engine, its node)
        # leaves nothing undone when the others took its units, and the job is complete
        complete = (not pending and bool(states) and all(s == "completed" for s in states)
                    and (not failures or left == 0))
        stop = self.ray.get(self.coordinator.stop_state.remote())[0]
        if stop and stop.startswith("SIG"):  # a signal's name
            stop = f"interrupted by {stop}"
        if (not stop and not complete and not failures and self.deadline_at is not None
                and time.time() >= self.deadline_at - self.margin):  # (workers not yet placed were not told)
            stop = "deadline reached" + ("" if results else " before any worker started")
        if complete:
            state, code, message = "completed", 0, None
            if failures:
                log.warning("every row is done, by the other workers: " + "; ".join(
                    f"worker w{i} failed ({m})" for i, (_, m) in sorted(failures.items())))
        elif stop or self.signals or "partial" in states or "interrupted" in states:
            state, code = ("interrupted" if self.signals else "partial"), EXIT_PARTIAL
            message = workers_stop_message(stop, [r.get("message") for _, r in sorted(results.items())], left)
        elif failures:
            engine = all(kind == "EngineError" for kind, _ in failures.values())
            state, code = "failed", (EXIT_ENGINE if engine else EXIT_FAILED)
            what = "; ".join(sorted({m for _, m in failures.values()}))
            message = (f"{what}; {left} rows not done" + ("; the rows finished are saved, rerun to continue"
                                                           if engine else ""))
        else:
            state, code, message = "failed", EXIT_FAILED, f"{left} rows not done; rerun to continue"
        if not self.lock.confirm():  # OUT is the other run's now: its status file is left alone
            state, code = "failed", EXIT_FAILED
            message = (f"another run took over {self.root.shown()} ({self.lock.taken_by()}): every worker stopped "
                       f"and wrote nothing more there; {left} rows not done. Let that run finish, and give each "
                       f"run its own --out")
            log.error(message)
        else:
            self.publish(self._status(state, code, statuses, pending, 0.0 if complete else None, message))
        # the other folders' counts as they stand now: a worker that failed (its rows saved) or was lost this run,
        # or a folder no worker ran this time
        idle = [(d.out.read_manifest() or {}).get("counts", {}) for d in job_dirs(self.cfg.output.path)
                if d.worker is not None and d.worker not in results]
        ok = sum(r["num_ok"] for r in results.values()) + sum(c.get("num_ok") or 0 for c in idle)
        err = sum(r["num_error"] for r in results.values()) + sum(c.get("num_error") or 0 for c in idle)
        toks = (sum(r["num_output_tokens"] for r in results.values())
                + sum(c.get("num_output_tokens") or 0 for c in idle))
        elapsed = time.time() - self.started
        this_attempt = sum(r["output_tokens_per_s"] * r["elapsed_s"] for r in results.values())
        return Summary(run_id=f"ray-{self.num_workers}-workers", out=self.root.shown(), state=state, exit_code=code,
                       num_rows=self.num_rows, num_done=done, num_ok=ok, num_error=err,
                       num_resumed=sum(r["num_resumed"] for r in results.values()),
                       num_duplicates=sum(r["num_duplicates"] for r in results.values()), num_output_tokens=toks,
                       num_removed=self.num_removed,
                       elapsed_s=round(elapsed, 3),
                       output_tokens_per_s=round(this_attempt / elapsed, 2) if elapsed else 0.0,
                       message=message, extra={"workers": {f"w{i}": r["state"] for i, r in sorted(results.items())},
                                               "worker_restarts": restarts,
                                               "failures": {f"w{i}": m for i, (_, m) in failures.items()}})

    # -- signals ---------------------------------------------------------------------------------
    def _install_signals(self) -> StopRequests:
        stops = StopRequests(on_request=self._on_signal).install()
        if self.early is not None and self.early.first:  # it came while the job opened
            stops.replay(self.early.first)
        return stops

    def _on_signal(self, name: str) -> None:
        self.signals.append(name)
        self.coordinator.stop.remote(name)  # each worker's runner says "interrupted by SIGTERM", as one engine
        log.warning(f"{name}: every worker stops admitting rows and drains (a second signal aborts at once)")

    def _restore_signals(self, stops: StopRequests) -> None:
        stops.restore()
