"""The job's main loop: source -> resume filter -> predict -> scheduler <-> engine -> checkpoint writer.

    while work remains:
        tick()       # every second: measure, forecast the deadline, switch auto's mode, heartbeat, signals
        refill()     # take prepared rows from the input thread until the lookahead pool is full
        admit()      # hand the scheduler's picks to vLLM
        collect()    # one engine step; finished rows go to the writer and teach the online predictor

A stop (the deadline, SIGTERM or SIGINT) ends admission; rows in flight drain
until a hard stop time (the deadline itself, or the signal's grace period),
then are aborted. Everything finished is flushed, and the job exits 75.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable, Iterator, Optional

from overnight.buckets.annotate import LengthAnnotator
from overnight.buckets.predictors import make_predictor
from overnight.pipeline import manifest as mf
from overnight.pipeline.checkpoint import CheckpointWriter
from overnight.pipeline.deadline import DeadlineTracker, Forecast
from overnight.pipeline.engine import EngineError
from overnight.pipeline.job import OpenJob
from overnight.pipeline.prefetch import Prefetcher
from overnight.pipeline.progress import Progress, fmt_duration
from overnight.pipeline.prompts import PromptBuilder
from overnight.pipeline.records import Result, Row
from overnight.pipeline.resume import ResumeFilter
from overnight.pipeline.report import EXIT_PARTIAL, Summary, forecast_dict, iso
from overnight.pipeline.scheduler import Mode, Policy, Scheduler
from overnight.pipeline.signals import StopRequests
from overnight.pipeline.tally import Tally, exit_code_for, summary
from overnight.pipeline.validate import parse_batch, sampling_defaults

log = logging.getLogger("overnight")

TICK_S = 1.0
FORECAST_S = 2.0
# Re-predict the waiting rows with what the online predictor learned, at most this often.
REFRESH_S = 5.0


class Runner:
    def __init__(self, job: OpenJob, engine, is_tty: Optional[bool] = None, clock: Callable[[], float] = time.time,
                 engine_factory: Optional[Callable[[], object]] = None):
        self.job = job
        self.engine = engine
        self.engine_factory = engine_factory
        self.clock = clock
        cfg = job.cfg
        sc = cfg.scheduler
        self.scheduler = Scheduler(engine.max_num_seqs, sc.queue_factor, sc.policy, sc.lookahead_rows, sc.max_wait_s,
                                   has_values="value" in job.source.schema.names)
        self.annotator = LengthAnnotator(make_predictor(cfg.buckets.predictor), cfg.sampling.max_tokens,
                                         cfg.buckets.kind, cfg.buckets.num_buckets, background=True)
        self.tracker = DeadlineTracker(job.deadline_at, job.margin_s, clock, sc.tokens_per_second)
        if job.deadline_at is not None:
            # Throughput-first needs evidence that the deadline is safe: until a forecast shows it, auto
            # runs the most rows per token first.
            self.scheduler.set_mode(Mode.DEADLINE, count=False)
        self.builder = PromptBuilder(job.tokenizer, job.chat, cfg.prompt.system_prompt, engine.max_model_len)
        self.writer = CheckpointWriter(job.out, job.schema, job.run_id, job.model.requested, job.scan.next_index,
                                       cfg.output.flush_rows, cfg.output.flush_seconds, on_flush=self._on_flush)
        self.defaults = sampling_defaults(cfg.sampling)
        self.passthrough = job.source.passthrough_columns()
        self.tally = Tally(job.source.num_rows, job.scan.num_ok, job.scan.num_error, job.scan.num_output_tokens)
        self.queued_at: dict[str, float] = {}
        self.resume = ResumeFilter(job.scan, self.tally, job.out.url)
        self.in_flight_predicted = 0
        self.generated_estimate = 0  # output tokens generated in this attempt, counted by step (see _collect)
        self.predicted_sum = 0
        self.predicted_n = 0
        self.signals = StopRequests()
        self.stopping: Optional[str] = None  # why admission stopped early, once it has
        self.hard_stop_at: Optional[float] = None  # when rows still in flight are aborted
        self.exhausted = False  # every input row has been read
        self.engine_failed = False
        self.forecast: Optional[Forecast] = None
        self._warned_at_risk = False
        self._last_tick = self._last_forecast = self._last_refresh = -1e18
        self.progress = Progress(job.source.num_rows, min(job.scan.num_done, job.source.num_rows),
                                 cfg.output.log_every_seconds, is_tty=is_tty)

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> Summary:
        state, message = mf.RunState.FAILED, None
        self.signals.install()
        try:
            self._loop()
            if self.exhausted and self.scheduler.is_done() and not self.tally.num_aborted:
                state = mf.RunState.COMPLETED
            else:
                state = mf.RunState.INTERRUPTED if self.signals.first else mf.RunState.PARTIAL
                message = f"{self.stopping or 'stopped'}: {self.tally.num_left} rows not done; rerun the same " \
                          f"command to continue"
        except BaseException as e:
            message = f"{type(e).__name__}: {e}"
            self.engine_failed = isinstance(e, EngineError)
            raise
        finally:
            self.signals.restore()
            result = self._finish(state, message)
        return result

    def _loop(self) -> None:
        # The engine loop wakes from each step needing the GIL; with the input thread busy, Python's default
        # 5 ms switch interval can hold it back for most of a GPU step (measured: 3.8% -> 2.5% of wall time).
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, 0.001))
        reader = Prefetcher(self._rows())
        try:
            self._drive(reader)
        finally:
            reader.close()
            self.annotator.close()
            sys.setswitchinterval(interval)

    def _drive(self, reader: Prefetcher) -> None:
        while True:
            self._tick()
            if self.stopping is None:
                while not self.exhausted and self.scheduler.wants_rows():
                    # Wait for input only when the engine would otherwise idle.
                    idle = self.scheduler.num_pending == 0 and self.scheduler.num_running == 0
                    item = reader.get(block=idle)
                    if item is None:
                        self.exhausted = reader.is_exhausted
                        break
                    ready, errors = item
                    self._record(errors)
                    self.scheduler.add(ready, self.clock())
                self._expire()
                self._admit()
            elif self.signals.is_urgent or self.clock() >= self.hard_stop_at:
                self._abort_in_flight()
                return
            if self.engine.has_unfinished():
                self._collect()
            elif self.stopping is not None or (self.exhausted and self.scheduler.is_done()):
                if self.exhausted and self.scheduler.is_done():
                    self.resume.report_removed(self.job.cfg.input.limit is not None)
                return

    def _admit(self) -> None:
        for a in self.scheduler.schedule(self.clock()):
            self.queued_at[a.request_id] = time.time()
            self.in_flight_predicted += a.row.predicted_tokens or 0
            try:
                self.engine.add(a.request_id, a.row.prompt_token_ids, a.row.sampling,
                                a.priority if self.engine.supports_priority else 0)
            except ValueError as e:  # vLLM's own validation of a request
                self._forget(a.request_id)
                self._record([Result.failed(a.row.id, a.row.passthrough,
                                            f"{a.row.origin}: the engine refused the row: {e}", time.time())])

    def _collect(self) -> None:
        running = min(self.scheduler.num_running, self.engine.max_num_seqs)
        try:
            finished = self.engine.step()
        except Exception as e:
            self._on_engine_failure(e)
            return
        # vLLM reports a row's tokens only when it finishes, so the first minutes of a job, before any long
        # row is done, would measure almost nothing. A step gives each running sequence one token: counting
        # those measures the rate from the first step on (it overcounts a little while prompts prefill).
        self.generated_estimate += running
        if finished:
            results, rows = [], []
            for fin in finished:
                queued = self.queued_at[fin.request_id]
                row = self._forget(fin.request_id)
                rows.append(row)
                results.append(Result.from_engine(row, fin, queued))
            self.annotator.observe(rows, [r.output_tokens for r in results], [r.finish_reason for r in results])
            self._record(results)
        self.writer.maybe_flush()

    def _forget(self, request_id: str) -> Row:
        self.queued_at.pop(request_id, None)
        row = self.scheduler.finish(request_id)
        self.in_flight_predicted -= row.predicted_tokens or 0
        return row

    def _on_engine_failure(self, e: Exception) -> None:
        if self.signals.first:
            # Ctrl-C reaches the engine's processes too: it stopped with us. What finished is kept.
            log.warning("the engine stopped after %s (%s); rows in flight are not done", self.signals.first, e)
            self._abort_in_flight(engine_alive=False)
            self.stopping = self.stopping or f"interrupted by {self.signals.first}"
            return
        restarts_left = self.job.cfg.engine.max_restarts - self.tally.num_engine_restarts
        if self.engine_factory is None or restarts_left <= 0:
            hint = "" if self.engine_factory is None else " Pass --max-engine-restarts N to restart it in-process."
            raise EngineError(f"The vLLM engine failed mid-run ({type(e).__name__}: {e}). The rows it finished are "
                              f"saved in {self.job.out.url}; rerun the same command to continue.{hint}") from e
        self.tally.num_engine_restarts += 1
        n = self.scheduler.num_running
        log.error(f"the vLLM engine failed mid-run ({type(e).__name__}: {e}); restarting it "
                  f"({self.tally.num_engine_restarts} of {self.job.cfg.engine.max_restarts}); {n} rows in flight "
                  f"go back to the queue")
        self.scheduler.requeue_running(self.clock())
        self.queued_at.clear()
        self.in_flight_predicted = 0
        try:
            self.engine = self.engine_factory()
        except Exception as e2:
            raise EngineError(f"The vLLM engine failed mid-run and could not be restarted ({e2}). The rows it "
                              f"finished are saved in {self.job.out.url}; rerun the same command to continue.") from e2

    def _rows(self) -> Iterator[tuple[list[Row], list[Result]]]:
        """Input rows not yet done, parsed, tokenized and predicted; bad rows come back as error results.
        Runs in the input thread."""
        cfg = self.job.cfg
        for sb in self.job.source.batches():
            self.tally.num_read += sb.batch.num_rows
            parsed, errors = parse_batch(sb, cfg.input, self.defaults, self.passthrough)
            parsed = [p for p in parsed if self.resume.is_new(p.id, p.origin, p.prompt_hash)]
            errors = [e for e in errors if self.resume.is_new_error(e)]
            ready, texts, bad = self.builder.build(parsed)
            self.annotator.annotate(ready, texts)
            self.predicted_sum += sum(row.predicted_tokens or 0 for row in ready)
            self.predicted_n += len(ready)
            yield ready, errors + bad

    # -- time, signals, deadline -----------------------------------------------------------------
    def _tick(self) -> None:
        now = self.clock()
        if self.stopping is None:
            if self.signals.first:
                self._begin_stop(f"interrupted by {self.signals.first}", now + self.job.cfg.scheduler.grace_s)
            elif self.tracker.should_stop():
                hard = self.tracker.stop_at if self.job.cfg.scheduler.on_deadline == "abort" else self.tracker.deadline
                self._begin_stop("deadline reached", hard)
        if now - self._last_tick < TICK_S:
            return
        self._last_tick = now
        self.tracker.observe(self.generated_estimate)
        if self.job.lock is not None:
            self.job.lock.heartbeat()
        # Re-predicting the pool happens in the learner thread; the loop only snapshots it and applies the answer.
        if now - self._last_refresh >= REFRESH_S and self.annotator.wants_refresh():
            self._last_refresh = now
            self.annotator.request_refresh(self.scheduler.pending_entries())
        done = self.annotator.take_refresh()
        if done is not None:
            self.scheduler.repredict(*done)
        if now - self._last_forecast >= FORECAST_S:
            self._last_forecast = now
            self._update_forecast()

    def _update_forecast(self) -> None:
        lengths, counts = self.scheduler.pending_lengths()
        policy = self.scheduler.policy
        if policy == Policy.LONGEST_FIRST:
            lengths, counts = lengths[::-1], counts[::-1]
        elif policy in (Policy.FIFO, Policy.PRIORITY) and counts:
            # Input or priority order is blind to length: expect rows of the pending mean.
            n = sum(counts)
            lengths, counts = [sum(t * c for t, c in zip(lengths, counts)) / n], [n]
        # auto forecasts with the order it uses once the deadline is at risk: shortest first.
        t = self.tally
        # Rows not read yet, less those an earlier attempt finished (not met yet in this pass).
        unread = max(0, t.num_rows - t.num_read - (self.job.scan.num_done - t.num_resumed))
        mean = self.predicted_sum / self.predicted_n if self.predicted_n else 0.0
        f = self.tracker.forecast(self.in_flight_predicted / 2, self.scheduler.num_running, lengths, unread, mean,
                                  counts)
        self.forecast = f
        if f.tokens_per_s and self.scheduler.num_running:
            self.scheduler.per_seq_tokens_per_s = f.tokens_per_s / min(self.scheduler.num_running,
                                                                       self.engine.max_num_seqs)
        self.progress.set_forecast(f.eta_s, f.time_left_s if self.tracker.deadline else None, f.will_miss)
        if self.tracker.deadline is None or self.stopping:
            return
        if f.will_miss:
            if self.scheduler.set_mode(Mode.DEADLINE):
                log.info("auto: deadline at risk, now running the most rows (or value) per predicted token first")
            if not self._warned_at_risk:
                self._warned_at_risk = True
                log.warning(f"deadline at risk: at {f.tokens_per_s:.0f} output tok/s the remaining ~"
                            f"{f.remaining_tokens:.0f} tokens need {fmt_duration(f.eta_s)}, but only "
                            f"{fmt_duration(f.time_left_s)} remain before {iso(self.tracker.stop_at)}; expect about "
                            f"{f.rows_expected_left} of {f.remaining_rows} remaining rows to be left undone "
                            f"(the job will stop in time and exit {EXIT_PARTIAL}; rerun it to continue)")
        elif f.eta_s is not None and f.eta_s < 0.8 * f.time_left_s:
            if self.scheduler.set_mode(Mode.THROUGHPUT):
                log.info("auto: deadline safe again, back to longest-first")
            if self._warned_at_risk:
                self._warned_at_risk = False
                log.info(f"deadline back on track: ETA {fmt_duration(f.eta_s)}, {fmt_duration(f.time_left_s)} left")

    def _begin_stop(self, reason: str, hard_stop_at: float) -> None:
        self.stopping = reason
        self.hard_stop_at = hard_stop_at
        self.scheduler.is_admitting = False
        n = self.scheduler.num_running
        how = "aborting them" if hard_stop_at <= self.clock() else f"draining them until {iso(hard_stop_at)}"
        log.warning(f"{reason}: stopped admitting rows; {n} rows in flight, {how} (a second signal aborts at once)")

    def _abort_in_flight(self, engine_alive: bool = True) -> None:
        ids = self.scheduler.drain_running()
        self.tally.num_aborted += len(ids)
        if ids:
            log.warning(f"aborting {len(ids)} rows in flight; they are not done and a rerun will redo them")
        if engine_alive:
            self.engine.abort(ids)
        for rid in ids:
            self.queued_at.pop(rid, None)
        self.in_flight_predicted = 0

    def _expire(self) -> None:
        expired = self.scheduler.take_expired(self.clock())
        if expired:
            self._record([Result.failed(r.id, r.passthrough, f"{r.origin}: its deadline {iso(r.deadline_at)} passed "
                                        f"before the row could start", time.time()) for r in expired])

    # -- bookkeeping ---------------------------------------------------------------------------
    def _record(self, results: list[Result]) -> None:
        if results:
            tokens = self.tally.record(results)
            self.writer.add(results)
            self.progress.update(len(results), tokens)

    def _num_parts(self) -> int:
        return self.job.scan.num_parts + self.writer.num_parts_written

    def _on_flush(self, results: list[Result], path: str) -> None:
        m = self.job.manifest
        m["counts"] = self.tally.counts(self._num_parts())
        m["updated_at"] = mf.now_iso()
        self.job.out.write_manifest(m)
        self.job.out.write_status(self._status(mf.RunState.RUNNING, None))

    def _status(self, state: mf.RunState, exit_code: Optional[int], message: Optional[str] = None) -> dict:
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
            "output_tokens_per_s": self.tally.tokens_per_s(),
            "eta_s": self.progress.eta_seconds(),
            "engine_restarts": self.tally.num_engine_restarts,
            "scheduler": {"policy": self.scheduler.policy.value, "predictor": self.annotator.predictor.name,
                          "mode_switches": self.scheduler.stats.num_mode_switches,
                          "aged": self.scheduler.stats.num_aged,
                          "deadline_first": self.scheduler.stats.num_deadline_first,
                          "predictor_seconds": round(self.annotator.seconds + self.annotator.loop_seconds
                                                     + self.annotator.background_seconds, 3)},
            "forecast": forecast_dict(self.forecast, self.tracker.deadline, self.scheduler.mode.value),
            "updated_at": mf.now_iso(),
        }

    def _finish(self, state: mf.RunState, message: Optional[str]) -> Summary:
        self.progress.close()
        # Rows still in the engine are not done: abort them so a cached engine starts clean.
        try:
            self.engine.abort(self.scheduler.drain_running())
        except Exception as e:  # a dead engine cannot abort; nothing is lost by it
            log.debug("abort at the end failed: %s", e)
        try:
            self.writer.flush()
        except Exception as e:
            log.error("could not flush the last finished rows: %s", e)
            state, message = mf.RunState.FAILED, message or f"flush failed: {e}"
        exit_code = exit_code_for(state, self.engine_failed)
        m = self.job.manifest
        m["counts"] = self.tally.counts(self._num_parts())
        mf.end_attempt(m, state, message)
        status = self._status(state, exit_code, message)
        try:
            self.job.out.write_manifest(m)
            self.job.out.write_status(status)
        except Exception as e:
            log.error("could not write the manifest or status file: %s", e)
        return summary(self.tally, self.job.run_id, self.job.out.shown(), state, exit_code, message,
                       {"scheduler": status["scheduler"], "forecast": status["forecast"], "rows": status["rows"]})
