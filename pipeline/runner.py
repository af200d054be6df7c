"""The job's main loop: source -> resume filter -> predict -> scheduler <-> engine -> checkpoint writer.

    while not finished:
        tick()       # every second: measure, forecast, let the deadline tracker pick auto's order, heartbeat
        refill()     # take prepared rows from the input thread until the lookahead pool is full
        admit()      # hand the scheduler's picks to the engine
        collect()    # one engine step; finished rows go to the writer and teach the online predictor

A stop (the deadline, SIGTERM or SIGINT) ends refill and admission; rows in flight drain until a hard stop
(the deadline itself, or the signal's grace period), then are aborted. What finished is flushed; exit 75.
Elsewhere: the tick and the stops (clockwork), the input stage (input.stage), the forecast and auto's order
(scheduling.deadline), restarts (engine.supervisor), status and summary (report).
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
import time
from typing import Callable, Optional

from overnight.buckets.annotate import LengthAnnotator
from overnight.buckets.predictors import make_predictor
from overnight.pipeline.clockwork import FORECAST_S, TICK_S, Clockwork
from overnight.pipeline.engine import EngineError
from overnight.pipeline.input.done_rows import after_warm_start
from overnight.pipeline.input.prefetch import PREFETCH_DEPTH, Prefetcher
from overnight.pipeline.input.resume import ResumeFilter, reads_every_row, rows_outside
from overnight.pipeline.input.source import InputError
from overnight.pipeline.input.stage import prepare
from overnight.pipeline.output.writer import CheckpointWriter
from overnight.pipeline.output.manifest import RunState
from overnight.pipeline.output.storage import StorageError
from overnight.pipeline.progress import Progress
from overnight.pipeline.records import ENGINE_INTERNAL_ERROR, Result, Row
from overnight.pipeline.report import Reporter, Summary
from overnight.pipeline.scheduling.deadline import DeadlineTracker
from overnight.pipeline.scheduling.scheduler import Scheduler
from overnight.pipeline.scheduling.when import no_row_started, not_done_message, short_budget_warning
from overnight.pipeline.signals import StopRequests
from overnight.pipeline.tally import Tally

log = logging.getLogger("overnight")


class Runner(Clockwork):
    def __init__(self, job, supervisor, is_tty: Optional[bool] = None, clock: Callable[[], float] = time.time,
                 signals: Optional[StopRequests] = None):
        self.job = job
        self.supervisor = supervisor
        self.engine = None  # started by run(): at once, or on a resume only once a row is left to answer
        self.clock = clock
        cfg, sc = job.cfg, job.cfg.scheduler
        self.scheduler = Scheduler(cfg.engine.max_num_seqs, sc.queue_factor, sc.policy, sc.lookahead_rows,
                                   sc.max_wait_s, "value" in job.source.schema.names, sc.sample_every)
        predictor = make_predictor(cfg.buckets.predictor)
        self.annotator = LengthAnnotator(predictor, cfg.sampling.max_tokens, cfg.buckets.kind,
                                         cfg.buckets.num_buckets, background=True)
        self.tracker = DeadlineTracker(job.deadline_at, job.margin_s, clock, sc.tokens_per_second,
                                       max_tokens=cfg.sampling.max_tokens, calibrated=predictor.calibrated)
        self.tracker.drains, self.tracker.rows_to_learn = sc.on_deadline != "abort", self.annotator.rows_to_learn
        self.tracker.start(self.scheduler)
        scan = job.scan
        t = self.tally = Tally(job.source.num_rows, scan.num_ok, scan.num_error, scan.num_output_tokens,
                               num_outside=rows_outside(job), sees_every_row=job.source.sees_every_row)
        self.progress = Progress(t.num_rows, t.num_done_here, cfg.output.log_every_seconds, is_tty=is_tty)
        self.reporter = Reporter(job, self.tally, self.scheduler, self.annotator, self.tracker, self.progress,
                                 supervisor)
        self.writer = CheckpointWriter(job.out, job.schema, job.run_id, job.row_model, scan.next_index,
                                       cfg.output.flush_rows, cfg.output.flush_seconds,
                                       on_flush=self.reporter.on_flush,
                                       may_write=job.lock.confirm if job.lock is not None else None)
        self.resume = ResumeFilter(scan, self.tally, job.out.url)
        self.reader: Optional[Prefetcher] = None
        self.queued_at: dict[str, float] = {}
        # Engine time per row: each step adds (step time / rows in it) to `share`; a row's engine_seconds is
        # the growth of `share` from its admission to its finish, so the cost is O(1) per step.
        self.share, self.share_at = 0.0, {}
        self.generated_estimate = 0  # output tokens generated in this attempt, counted by step (see _collect)
        self.signals = signals or StopRequests()  # run_job's, installed before the job opened
        self.stopping: Optional[str] = None  # why admission stopped early, once it has
        self.hard_stop_at: Optional[float] = None  # when rows still in flight are aborted
        self.engine_failed = False
        self.engine_dead = False  # it died after a signal: not stepped again
        self.ready_after_stop = False  # the engine was ready only once the deadline's stop had come
        # The input could not be read on (a damaged file): the rows read before it are finished, then it is raised
        self.input_error: Optional[BaseException] = None
        self._last_tick = self._last_forecast = -1e18
        self._forecast_every = FORECAST_S
        self._last_step_end: Optional[float] = None  # for the loop's cycle per engine step
        self._work_ahead = threading.Event()  # a resume's reader holds a row to answer (it learns before handing it)

    def run(self) -> Summary:
        state, message = RunState.FAILED, None
        # The loop wakes from each step needing the GIL; with the input thread busy, Python's default 5 ms
        # switch interval can hold it back for most of a GPU step (measured: 3.8% -> 2.5% of wall time).
        interval = sys.getswitchinterval()
        try:
            sys.setswitchinterval(min(interval, 0.001))
            self.signals.install()
            cfg, model = self.job.cfg, self.job.model
            if self.signals.first:  # asked to stop while the job opened: no engine, nothing run, exit 75
                self.stopping = f"interrupted by {self.signals.first} before the engine started"
            elif not (self.job.lazy_engine and model.context_known) and not self._too_late():
                model = model.with_context(self._start_engine().max_model_len)  # a guessed context: ask the engine
                if self.signals.first:  # it came while the engine started: no row is run (it said "stopped")
                    self.stopping = f"interrupted by {self.signals.first} while the engine started"
            batches = prepare(cfg, self.job.source, model, self.annotator, self.resume,
                              self.job.source.passthrough_columns(), self.tally)
            self.reader = Prefetcher(after_warm_start(batches, cfg, self.job.source, model, self.annotator,
                                                      self.job.scan, self.job.results_url or self.job.out.url,
                                                      self.tally, self._work_ahead.set),
                                     depth=getattr(self.job.source, "prefetch_depth", PREFETCH_DEPTH))
            if not self.signals.first and not self.stopping and (self.engine is not None or self._has_work()):
                if self.engine is not None or not self._too_late():
                    self.engine = self.engine or self._start_engine()
                    self._loop()
            if self.input_error is not None:
                raise self.input_error
            if self._lock_lost():
                state, message = RunState.FAILED, self._lost_message()
            elif self._is_complete() and not self.tally.num_aborted:
                # A full pass: report the rows done before that are no longer in the input.
                self.resume.report_removed(not reads_every_row(self.job.source, cfg.input))
                state = RunState.COMPLETED
            else:
                state = RunState.INTERRUPTED if self.signals.first else RunState.PARTIAL
                message = not_done_message(self.stopping or "stopped", self.tally.num_left,
                                           no_row_started(self.tally, self.stopping, self.ready_after_stop))
        except BaseException as e:
            message = f"{type(e).__name__}: {e}"
            self.engine_failed = isinstance(e, EngineError)
            raise
        finally:
            if self.reader is not None:
                self.reader.close()
            self.annotator.close()
            sys.setswitchinterval(interval)
            try:
                result = self._finish(state, message)
            finally:  # a signal during the last flush is counted, not a KeyboardInterrupt that loses it
                self.signals.restore()
        return result

    # -- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._is_finished():
            self._tick()
            if self.stopping is None:
                self._refill()
                self._admit()
            elif self.signals.is_urgent or self._lock_lost() or self.clock() >= self.hard_stop_at:
                # (a lock lost during a drain: the folder is another run's now, nothing more is written there)
                self._abort_in_flight()
                return
            self._collect()

    def _start_engine(self):
        warning = short_budget_warning(self.reporter.earlier_startup, self.tracker.time_left())
        if warning:
            log.warning(warning)
        began = time.time()
        told, self.signals.on_request = self.signals.on_request, self._signal_while_starting
        try:
            self.engine = self.supervisor.start()
        finally:
            self.signals.on_request = told
        self.tally.engine_start_s = time.time() - began
        self.ready_after_stop = self.tracker.should_stop()  # the start-up took what the budget had left
        self.scheduler.resize(self.engine.max_num_seqs)
        self.tracker.engine_started(self.engine.max_num_seqs, *getattr(self.engine, "context_term", (0.0,)))
        self.tally.started = time.monotonic()  # the attempt's elapsed time and tok/s count from a running engine
        self.progress.rates_from(self.progress.clock())  # (the progress line's too)
        self.tally.engine_ready_at = time.time()
        self.writer.last_flush = self.writer.clock()  # flush_seconds count from a running engine, not its start
        return self.engine

    def _signal_while_starting(self, name: str) -> None:
        """A stop asked for while the engine starts (a minute or more): said at once, done once it is up."""
        if self.signals.count == 1:
            log.warning(f"{name} while the engine starts: the job stops once it is up, before any row runs, and "
                        f"exits 75 (rerun to continue)")

    def _too_late(self) -> bool:
        """The deadline's stop time came while the job opened (its tokenizer, a resume's scan, a lock's wait):
        the engine is not started, as it would be stopped at once after minutes of starting. Exit 75."""
        if self.tracker.should_stop():
            self.stopping = "deadline reached before the engine started"
        return self.stopping is not None

    def _has_work(self) -> bool:
        """On a resume, read until a row is left to answer (or the reader holds one): a rerun that finds all done
        starts no engine. The lock's heartbeat goes on meanwhile, and a signal or the deadline ends the wait."""
        while not self.scheduler.num_pending and not self._work_ahead.is_set():
            batch = self._read(block=True, timeout=TICK_S)
            if self.job.lock is not None:
                self.job.lock.heartbeat()
            if batch is None and self.input_error is not None:
                return False
            if batch is None and not self.reader.is_exhausted:
                if self.signals.first or self.tracker.should_stop():
                    self.stopping = f"interrupted by {self.signals.first}" if self.signals.first else "deadline reached"
                    return False
                continue
            if batch is None:
                log.info("every row is already done: the engine is not started")
                return False
            self._record(batch.errors)
            self.scheduler.add(batch.rows, self.clock())
        return True

    def _read(self, block: bool, timeout: Optional[float] = None):
        """The next batch of rows, or None. A file that cannot be read on ends the input here: the rows read
        before it are answered and written, and run() then raises its error (exit 1)."""
        if self.input_error is not None:
            return None
        try:
            batch = self.reader.get(block=block, timeout=timeout)
            self.tally.num_taken += 0 if batch is None else len(batch.rows) + len(batch.errors)  # for the forecast
            return batch
        except (InputError, StorageError) as e:
            self.input_error = e
            if read := self.scheduler.num_pending + self.scheduler.num_running:
                log.warning(f"the input cannot be read on: the {read} rows read before are answered first, then the "
                            f"job stops with the error")

    def _input_ended(self) -> bool:
        return self.reader.is_exhausted or self.input_error is not None

    def _is_complete(self) -> bool:
        return self.reader is not None and self._input_ended() and self.scheduler.is_done()

    def _is_finished(self) -> bool:
        """The engine is empty (or dead), and a stop began or every row is read and done."""
        if self.engine_dead:
            return self.stopping is not None
        return not self.engine.has_unfinished() and (self.stopping is not None or self._is_complete())

    def _refill(self) -> None:
        while not self._input_ended() and self.scheduler.wants_rows():
            # Wait for input only when the engine would otherwise idle.
            idle = self.scheduler.num_pending == 0 and self.scheduler.num_running == 0
            batch = self._read(block=idle)
            if batch is None:
                return
            self._record(batch.errors)
            self.scheduler.add(batch.rows, self.clock())

    def _admit(self) -> None:
        self._record([Result.expired(r) for r in self.scheduler.take_expired(self.clock())])
        if not self.tracker.probe_done:  # the first steps of a run measure the step cost
            self.scheduler.cap = self.tracker.probe_cap(self.engine.max_num_seqs)
            if self.tracker.probe_done:  # the forecast sets the cap (or lifts it) before more rows go in
                self._last_forecast = -1e18
                self._last_tick = -1e18
                self._tick()
        for a in self.scheduler.schedule(self.clock()):
            self.queued_at[a.request_id] = time.time()
            self.share_at[a.request_id] = self.share
            try:
                self.engine.add(a.request_id, a.row.prompt_token_ids, a.row.sampling,
                                a.priority if self.engine.supports_priority else 0)
            except ValueError as e:  # vLLM's own validation of a request
                self._forget(a.request_id)
                self._record([Result.failed(a.row.id, a.row.passthrough,
                                            f"{a.row.origin}: the engine refused the row: {e}", time.time())])
                continue
            except Exception as e:  # the engine died between steps (vLLM's EngineDeadError): as a failed step
                self._on_engine_failure(e)
                return
            self.tracker.admitted(a.request_id, a.row.forecast_tokens, a.row.num_prompt_tokens,
                                  a.row.sampling.get("n", 1), a.row.sampling.get("max_tokens"))
            if self.tally.first_admitted_at is None:
                self.tally.first_admitted_at = time.time()

    def _collect(self) -> None:
        if self.engine_dead or not self.engine.has_unfinished():
            self._last_step_end = None
            return
        # the sequences in the engine, running or waiting in its queue (a row of n samples is n of them)
        admitted = self.scheduler.running_samples
        running = min(admitted, self.engine.max_num_seqs)
        self.tracker.before_step()
        t0 = time.perf_counter()
        try:
            finished = self.engine.step()
        except Exception as e:
            self._last_step_end = None
            self._on_engine_failure(e)
            return
        step_s = time.perf_counter() - t0
        # The forecast learns from the loop's whole cycle per step: the engine's time and the loop's own.
        end = self.clock()
        cycle = None if self._last_step_end is None else end - self._last_step_end
        self._last_step_end = end
        self.tracker.after_step(cycle, [f.request_id for f in finished])
        self.share += step_s / max(1, admitted)  # per sequence: the rows' engine_seconds add up to the steps'
        # (but for the rows aborted at a stop, not saved); the attempt's cost counts every step the engine ran
        self.tally.engine_seconds += step_s
        # vLLM reports a row's tokens only when it finishes, so the first minutes of a job, before any long
        # row is done, would measure almost nothing. A step gives each running sequence one token: counting
        # those measures the rate from the first step on (it overcounts a little while prompts prefill).
        self.generated_estimate += running
        if finished:
            results, rows, lengths = [], [], []
            for f in finished:
                queued = self.queued_at[f.request_id]
                share = self.share - self.share_at.get(f.request_id, self.share)
                row = self._forget(f.request_id)
                if f.finish_reason == "abort":  # the engine ended it (its process stopping on a signal): not
                    self.tracker.dropped([f.request_id])  # done, and not written; a rerun answers it
                    self.tally.num_aborted += 1
                    if not self.signals.first:
                        log.warning(f"{row.origin}: the engine aborted the row itself (vLLM's finish_reason "
                                    f"\"abort\"); it is not done, and a rerun answers it")
                    continue
                if f.finish_reason == "error":  # vLLM's request-level internal error: an error row, not a text
                    self._record([Result.failed(row.id, row.passthrough, f"{row.origin}: {ENGINE_INTERNAL_ERROR} "
                                                f"(vLLM's finish_reason \"error\", such as a structured output "
                                                f"grammar it could not build)", time.time())])
                    continue
                n = row.sampling.get("n", 1)
                rows.append(row)
                results.append(Result.from_engine(row, f, queued, round(share * n, 6)))
                # predictions are per sequence: a row of n samples teaches its mean sample's length
                lengths.append(f.num_output_tokens if n == 1 else round(f.num_output_tokens / n))
            reasons = [r.finish_reason for r in results]
            self.annotator.observe(rows, lengths, reasons)
            self.tracker.finished([r.forecast_tokens for r in rows], lengths, reasons, [r.drawn for r in rows],
                                  [r.features if r.drawn else None for r in rows])
            self._record(results)
        self.writer.maybe_flush()

    def _abort_in_flight(self, engine_alive: bool = True) -> None:
        ids = self.scheduler.drain_running()
        self.tracker.dropped(ids)
        self.tally.num_aborted += len(ids)
        if ids:
            log.warning(f"aborting {len(ids)} rows in flight; they are not done and a rerun will redo them")
        if engine_alive:
            self.engine.abort(ids)
        self.queued_at.clear()

    def _on_engine_failure(self, e: Exception) -> None:
        if self.signals.first:
            # Ctrl-C reaches the engine's processes too: it stopped with us. What finished is kept.
            log.warning("the engine stopped after %s (%s); rows in flight are not done", self.signals.first, e)
            self._abort_in_flight(engine_alive=False)
            self.engine_dead = True  # never stepped again: its queue may never answer
            if self.stopping is None:
                self._begin_stop(f"interrupted by {self.signals.first}", self.clock())
            self.hard_stop_at = self.clock()  # a drain already under way has nothing left to drain
            return
        self.engine = self.supervisor.restart(e, self.scheduler.num_running)
        self.tracker.engine_started(self.engine.max_num_seqs, *getattr(self.engine, "context_term", (0.0,)))
        self.scheduler.requeue_running(self.clock())
        self.queued_at.clear()

    def _forget(self, request_id: str) -> Row:
        self.queued_at.pop(request_id, None)
        self.share_at.pop(request_id, None)
        return self.scheduler.finish(request_id)

    def _record(self, results: list[Result]) -> None:
        if results:
            tokens = self.tally.record(results)
            self.progress.update(len(results), tokens)  # before a flush the add may make recounts them
            self.writer.add(results)

    def _finish(self, state: RunState, message: Optional[str]) -> Summary:
        self.progress.close()
        if self.engine_dead:  # nor handed to a later job in this process
            try:
                if "timeout" in inspect.signature(self.engine.shutdown).parameters:
                    self.engine.shutdown(timeout=0.5)  # vLLM's: not its 5 s wait for a core that is gone
                else:
                    self.engine.shutdown()  # the engine interface's (engine/__init__.py)
            except Exception as e:
                log.debug("shutting down the engine that stopped with us: %s", e)
        # Rows still in the engine are not done: abort them so a cached engine starts clean.
        try:
            if self.engine is not None:
                self.engine.abort(self.scheduler.drain_running())
        except Exception as e:  # a dead engine cannot abort; nothing is lost by it
            log.debug("abort at the end failed: %s", e)
        try:
            self.writer.flush()
        except Exception as e:
            log.error("could not flush the last finished rows: %s", e)
            state, message = RunState.FAILED, message or f"flush failed: {e}"
        lock = self.job.lock
        if lock is not None and not lock.confirm() and state != RunState.FAILED:
            state, message = RunState.FAILED, self._lost_message()  # found out now: nothing more is written
        self.tally.unsaved(self.writer.buffer + self.writer.unsaved)
        try:
            return self.reporter.finish(state, message, self.engine_failed)
        finally:
            self.reporter.close()
