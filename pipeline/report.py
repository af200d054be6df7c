"""What a job tells the operator: status.json and the manifest's counts at every flush, and at the end the
attempt's state, the exit code and the closing summary."""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field
from typing import Optional

from overnight.pipeline.output import manifest as mf
from overnight.pipeline.progress import fmt_duration
from overnight.pipeline.tally import Tally

log = logging.getLogger("overnight")

EXIT_OK = 0
EXIT_FAILED = 1
# sysexits EX_UNAVAILABLE: the engine failed to start or died mid-run; finished rows are saved.
EXIT_ENGINE = 69
# sysexits EX_TEMPFAIL: stopped early (deadline, signal); rerun the same command to continue.
EXIT_PARTIAL = 75


@dataclass
class Summary:
    run_id: str
    out: str
    state: str
    exit_code: int
    num_rows: int
    num_done: int
    num_ok: int
    num_error: int
    num_resumed: int
    num_duplicates: int
    num_output_tokens: int
    elapsed_s: float
    output_tokens_per_s: float
    message: Optional[str] = None
    extra: dict = field(default_factory=dict)
    num_removed: int = 0     # rows in the output whose ids are no longer in the input (counted in ok and error)
    attempt_output_tokens: Optional[int] = None  # of num_output_tokens, this attempt's (its time and rate are)

    def line(self) -> str:
        head = {"completed": "done", "partial": "stopped early (resumable)", "interrupted": "interrupted (resumable)",
                "failed": "FAILED"}.get(self.state, self.state)
        resumed = f", {self.num_resumed} already done" if self.num_resumed else ""
        dup = f", {self.num_duplicates} duplicate ids skipped" if self.num_duplicates else ""
        dup += f", {self.num_removed} no longer in the input" if self.num_removed else ""
        beyond = self.num_ok + self.num_error - self.num_done - (self.num_removed or 0)
        if beyond > 0:
            dup += f"; the output holds {beyond} rows beyond this input's (a lower --limit, or ids no longer in it)"
        tail = f"; {self.message}" if self.message and (self.state in ("partial", "interrupted") or
                                                       not self.num_rows) else ""
        cost = self.extra.get("cost") or {}
        price = ""
        if "cost" in cost:
            per = cost.get("cost_per_1000_rows")
            price = (f", cost {cost['cost']:.4f} ({cost['engine_hours']:.4f} engine-hours"
                     f"{'' if per is None else f', {per:.4f} per 1,000 rows'})")
        mine = self.attempt_output_tokens
        this = f" ({mine} this run)" if mine is not None and mine != self.num_output_tokens else ""
        return (f"overnight: {head}: {self.num_done}/{self.num_rows} rows ({self.num_ok} ok, {self.num_error} error"
                f"{resumed}{dup}), {self.num_output_tokens} output tokens{this} in {fmt_duration(self.elapsed_s)} "
                f"({self.output_tokens_per_s:.0f} tok/s){price} -> {self.out}{tail}")


def iso(t: Optional[float]) -> Optional[str]:
    if t is None:
        return None
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="seconds")


def forecast_dict(f, deadline: Optional[float], mode: str) -> dict:
    if f is None:
        return {"deadline": iso(deadline), "mode": mode}
    return {
        "deadline": iso(deadline),
        "mode": mode,
        "tokens_per_s": round(f.tokens_per_s, 2),
        "remaining_tokens_predicted": round(f.remaining_tokens),
        "remaining_rows": f.remaining_rows,
        "eta_s": None if f.eta_s is None else round(f.eta_s, 1),
        "eta_range_s": None if f.eta_low_s is None else [round(f.eta_low_s, 1), round(f.eta_high_s, 1)],
        # what the forecast learned: actual / predicted output tokens, and seconds per step (fixed, per
        # sequence, per prompt token prefilled)
        "calibration": None if f.calibration is None else round(f.calibration, 3),
        "step_cost_s": None if f.step_cost is None else [round(x, 6) for x in f.step_cost],
        "rows_in_flight_cap": f.cap,
        "time_left_s": None if f.time_left_s == float("inf") else round(f.time_left_s, 1),
        "will_miss": f.will_miss,
        "rows_expected_left": f.rows_expected_left,
    }


def ended_forecast(f: dict, state: str, rows_left: int, now: float, deadline: Optional[float]) -> dict:
    """The forecast block of a run that ended: the outcome in the fields a running job forecasts (nothing left
    and an ETA of 0 when completed; the rows actually left and no ETA when stopped; with a deadline, whether it
    was missed), with the run's last forecast kept beside it under ``last`` for comparison. What the forecast
    learned (calibration, step cost, tokens/s) stays as it was."""
    last = {k: f[k] for k in ("eta_s", "eta_range_s", "remaining_rows", "remaining_tokens_predicted", "will_miss",
                              "rows_expected_left", "time_left_s") if k in f}
    done = state == "completed"
    # missed: the deadline stopped it with rows left; a run stopped before its deadline (a signal, a failure)
    # has not missed it yet, nor met it
    missed = deadline is not None and (True if state == "partial" else False if done else None)
    return dict(f, eta_s=0.0 if done else None, eta_range_s=None, remaining_rows=rows_left,
                remaining_tokens_predicted=0 if done else f.get("remaining_tokens_predicted"),
                will_miss=missed, rows_expected_left=rows_left if deadline is not None else None,
                time_left_s=None if deadline is None else round(max(0.0, deadline - now), 1), last=last or None)


def cost_dict(engine_seconds: float, rows: int, price_per_hour: Optional[float]) -> dict:
    """This attempt's engine time and, with a price, what it cost: the figure to set against a batch API's."""
    hours = engine_seconds / 3600
    out = {"engine_seconds": round(engine_seconds, 3), "engine_hours": round(hours, 6)}
    if price_per_hour is not None:
        out.update(price_per_hour=price_per_hour, cost=round(hours * price_per_hour, 6),
                   cost_per_1000_rows=round(1000 * hours * price_per_hour / rows, 6) if rows else None)
    return out


def exit_code_for(state: mf.RunState, engine_failed: bool) -> int:
    if state == mf.RunState.COMPLETED:
        return EXIT_OK
    if state in (mf.RunState.PARTIAL, mf.RunState.INTERRUPTED):
        return EXIT_PARTIAL
    return EXIT_ENGINE if engine_failed else EXIT_FAILED


def summary(t: Tally, run_id: str, out: str, state: mf.RunState, exit_code: int, message: Optional[str],
            extra: dict) -> Summary:
    return Summary(run_id=run_id, out=out, state=state.value, exit_code=exit_code, num_rows=t.num_rows,
                   num_done=t.num_done_here, num_ok=t.num_ok, num_error=t.num_error, num_resumed=t.num_resumed,
                   num_duplicates=t.num_duplicates, num_output_tokens=t.num_output_tokens,
                   elapsed_s=round(t.elapsed(), 3), output_tokens_per_s=t.tokens_per_s(), message=message,
                   extra=extra, num_removed=t.num_removed or 0, attempt_output_tokens=t.attempt_tokens)


def nothing_to_do(job) -> Summary:
    """An empty input: no engine is started; the run is complete with no rows."""
    src = job.source
    if src.cfg.limit == 0:
        why = "--limit 0 takes no rows"
    elif src.shard is not None:
        why = f"shard {src.shard} of {src.url} has no rows"
    else:
        why = f"{src.url} has no rows"
    message = f"nothing to do: {why}"
    log.info(message)
    mf.end_attempt(job.manifest, mf.RunState.COMPLETED, message)
    job.out.write_manifest(job.manifest)
    status = {"state": "completed", "exit_code": 0, "message": message, "run_id": job.run_id,
              "rows": {"total": 0, "done": 0}, "updated_at": mf.now_iso()}
    job.out.write_status(status)
    _metrics_file(job, status)
    return summary(Tally(0), job.run_id, job.out.shown(), mf.RunState.COMPLETED, 0, message, {})


# status.json's figures of the attempt that ran the engine, which an attempt that finds nothing to do keeps
MEASURED = ("out", "model", "output_tokens", "elapsed_s", "output_tokens_per_s", "cost", "startup", "scheduler")


def already_done(job) -> Summary:
    """A completed job whose input is unchanged (same files, sizes and times): nothing to read, no engine."""
    c = job.manifest.get("counts", {})
    t = Tally(c.get("num_rows", 0), c.get("num_ok", 0), c.get("num_error", 0), c.get("num_output_tokens", 0),
              num_outside=c.get("num_outside") or 0)
    t.num_duplicates, t.num_removed = c.get("num_duplicates", 0), c.get("num_removed")  # as the run that completed
    message = (f"nothing to do: the job completed and {job.source.url} is unchanged since; {t.num_done_here} "
               f"rows are done (--fresh answers them again)")
    log.info(message)
    mf.end_attempt(job.manifest, mf.RunState.COMPLETED, message)
    job.out.write_manifest(job.manifest)
    t.num_resumed = t.num_done_here
    # What the run that completed measured stays (its token rate, which `plan --out` reads; its cost, timings)
    status = {**{k: v for k, v in (job.out.read_status() or {}).items() if k in MEASURED},
              "state": "completed", "exit_code": 0, "message": message, "run_id": job.run_id,
              "attempt": len(job.manifest["attempts"]), "rows": t.rows(0), "eta_s": 0.0, "engine_started": False,
              "updated_at": mf.now_iso()}
    job.out.write_status(status)
    _metrics_file(job, status)
    return summary(t, job.run_id, job.out.shown(), mf.RunState.COMPLETED, 0, message, {})


def _metrics_file(job, status: dict) -> None:
    """--metrics-file for a run that finds nothing to do: it says so too (a file an earlier attempt wrote, exit
    75 say, stayed as it was)."""
    if job.cfg.output.metrics_file:
        from overnight.pipeline.output.metrics import Metrics
        Metrics(job.cfg.output.metrics_file, None, job.out.shown()).update(status)


def eta_for(state: str, eta: Optional[float]) -> Optional[float]:
    """The ETA a status gives: the forecast's while running, 0 once completed, none once stopped (a run's last
    forecast is not a time to anything)."""
    return eta if state == "running" else (0.0 if state == "completed" else None)


class Reporter:
    """Reads the running job's parts (it changes none of them) and writes what they say."""

    def __init__(self, job, tally: Tally, scheduler, annotator, tracker, progress, supervisor):
        self.job = job
        self.supervisor = supervisor
        self.tally = tally
        self.scheduler = scheduler
        self.annotator = annotator
        self.tracker = tracker
        self.progress = progress
        self.num_parts_written = 0
        # Earlier attempts' samples (a resumed job's story goes on), the last 2,000 of them.
        attempt = len(job.manifest["attempts"])
        self.earlier = [s for s in job.out.read_timeline() if s.get("attempt", 0) < attempt][-2000:]
        earlier = job.out.read_status() or {}
        self.earlier_rate = earlier.get("output_tokens_per_s")
        self.earlier_startup = earlier.get("startup")  # the last attempt's: how long the engine took to start
        out = job.cfg.output
        self.metrics = None
        if out.metrics_file or out.metrics_port:
            from overnight.pipeline.output.metrics import Metrics
            self.metrics = Metrics(out.metrics_file, out.metrics_port, job.out.shown())

    def on_flush(self, results, path: str) -> None:
        """After each part: the manifest's counts and a fresh status snapshot."""
        self.num_parts_written += 1
        m = self.job.manifest
        m["counts"] = self._counts()
        m["updated_at"] = mf.now_iso()
        self.job.out.write_manifest(m)
        self._publish(self.status(mf.RunState.RUNNING, None))

    def on_forecast(self) -> None:
        """After each forecast: a Ray worker's folder hands it to the driver, which forecasts the whole job."""
        report = getattr(self.job.out, "report_progress", None)
        if report is not None:
            report(self.tally.rows(self.scheduler.num_running),
                   forecast_dict(self.tracker.last, self.tracker.deadline, self.scheduler.mode.value))

    def _publish(self, status: dict) -> None:
        self.job.out.write_status(status)
        if self.tally.num_removed or self.tally.sees_every_row:  # (as the loop's tick: the rows in OUT whose ids
            # left the input are not done)
            self.progress.recount(self.tally.num_done_here)
        self.progress.sample()
        self.job.out.write_timeline(self.earlier + [dict(s, attempt=len(self.job.manifest["attempts"]))
                                                    for s in self.progress.samples])
        if self.metrics is not None:
            self.metrics.update(status)

    def _counts(self) -> dict:
        return self.tally.counts(self.job.scan.num_parts + self.num_parts_written)

    def status(self, state: mf.RunState, exit_code: Optional[int], message: Optional[str] = None) -> dict:
        a, st = self.annotator, self.scheduler.stats
        return {
            "state": state.value,
            "exit_code": exit_code,
            "message": message,
            "run_id": self.job.run_id,
            "out": self.job.out.shown(),
            "model": self.job.model.requested,
            "attempt": len(self.job.manifest["attempts"]),
            "rows": self.tally.rows(self.scheduler.num_running),
            "output_tokens": self.tally.num_output_tokens,
            "elapsed_s": round(self.tally.elapsed(), 3),
            # an attempt that never started the engine (every row was done) keeps the rate the last one measured
            "output_tokens_per_s": (self.tally.tokens_per_s() if self.supervisor.engine is not None
                                    else self.earlier_rate),
            "cost": cost_dict(self.tally.engine_seconds, self.tally.num_done - self.tally.done_before,
                              self.job.cfg.output.price_per_hour),
            "eta_s": eta_for(state.value, self.progress.eta_seconds()),
            "engine_started": self.supervisor.engine is not None,  # false: a resume found nothing left to do
            "startup": self.tally.startup(),
            "engine_restarts": self.supervisor.num_restarts,
            "scheduler": {"policy": self.scheduler.policy.value, "predictor": a.predictor.name,
                          "mode_switches": st.num_mode_switches, "aged": st.num_aged,
                          "deadline_first": st.num_deadline_first, "drawn_at_random": st.num_sampled,
                          "predictor_seconds": round(a.seconds + a.loop_seconds + a.background_seconds, 3),
                          # where that time went: predicting new rows (input thread), learning in the engine
                          # loop (none with a learner thread), learning and re-predicting (learner thread)
                          "predictor_seconds_by_thread": {"input": round(a.seconds, 3),
                                                          "loop": round(a.loop_seconds, 3),
                                                          "learner": round(a.background_seconds, 3)}},
            "forecast": forecast_dict(self.tracker.last, self.tracker.deadline, self.scheduler.mode.value),
            "updated_at": mf.now_iso(),
        }

    def close(self) -> None:
        """The job has ended: --metrics-port stops serving (its last figures are in status.json)."""
        if self.metrics is not None:
            self.metrics.close()

    def finish(self, state: mf.RunState, message: Optional[str], engine_failed: bool) -> Summary:
        """Close the attempt in the manifest, write the last status, and return the summary."""
        exit_code = exit_code_for(state, engine_failed)
        m = self.job.manifest
        m["counts"] = self._counts()
        if state == mf.RunState.COMPLETED:  # what a rerun over an unchanged input checks before it skips the scan
            try:
                m["parts_digest"] = self.job.out.parts_digest()
            except OSError as e:
                log.debug("listing the parts for their digest: %s", e)
        mf.end_attempt(m, state, message)
        status = self.status(state, exit_code, message)
        status["forecast"] = ended_forecast(status["forecast"], state.value, status["rows"]["remaining"],
                                            self.tracker.clock(), self.tracker.deadline)
        lock = self.job.lock
        if lock is not None and lock.lost:  # the folder is another run's now: its manifest and status are left alone
            log.error(message)
            return summary(self.tally, self.job.run_id, self.job.out.shown(), state, exit_code, message,
                           {"scheduler": status["scheduler"], "forecast": status["forecast"], "rows": status["rows"],
                            "cost": status["cost"]})
        try:
            self.job.out.write_manifest(m)
            self._publish(status)
        except Exception as e:
            log.error("could not write the manifest or status file: %s", e)
        return summary(self.tally, self.job.run_id, self.job.out.shown(), state, exit_code, message,
                       {"scheduler": status["scheduler"], "forecast": status["forecast"], "rows": status["rows"],
                        "cost": status["cost"]})
