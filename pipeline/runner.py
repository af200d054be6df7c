"""The job's main loop: source -> resume filter -> predict -> scheduler <-> engine -> checkpoint writer.

    while work remains:
        tick()       # every second: measure, forecast the deadline, switch auto's mode, refresh predictions
        refill()     # read input until the scheduler's lookahead pool is full
        admit()      # hand the scheduler's picks to vLLM
        collect()    # one engine step; finished rows go to the writer and teach the online predictor
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable, Iterator, Optional

import numpy as np

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
from overnight.pipeline.report import EXIT_FAILED, EXIT_OK, EXIT_PARTIAL, Summary, forecast_dict, iso
from overnight.pipeline.scheduler import Mode, Policy, Scheduler
from overnight.pipeline.validate import parse_batch, sampling_defaults

log = logging.getLogger("overnight")

TICK_S = 1.0
FORECAST_S = 2.0
# Re-predict the waiting rows with what the online predictor learned, at most this often.
REFRESH_S = 5.0


class Runner:
    def __init__(self, job: OpenJob, engine, is_tty: Optional[bool] = None, clock: Callable[[], float] = time.time):
        self.job = job
        self.engine = engine
        self.clock = clock
        cfg = job.cfg
        sc = cfg.scheduler
        self.scheduler = Scheduler(engine.max_num_seqs, sc.queue_factor, sc.policy, sc.lookahead_rows, sc.max_wait_s,
                                   has_values="value" in job.source.schema.names)
        self.annotator = LengthAnnotator(make_predictor(cfg.buckets.predictor), cfg.sampling.max_tokens,
                                         cfg.buckets.kind, cfg.buckets.num_buckets)
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
        self.queued_at: dict[str, float] = {}
        self.emitted: set = set()  # ids this run has handed on (or skipped as already done)
        self.num_read = 0
        self.num_resumed = 0
        self.num_duplicates = 0
        self.num_ok = job.scan.num_ok
        self.num_error = job.scan.num_error
        self.num_output_tokens = job.scan.num_output_tokens
        self.attempt_tokens = 0
        self.in_flight_predicted = 0
        self.predicted_sum = 0
        self.predicted_n = 0
        self.started = time.monotonic()
        self.stopping: Optional[str] = None  # why admission stopped early, once it has
        self.exhausted = False  # every input row has been read
        self.num_aborted = 0  # rows aborted in flight at a deadline: not done
        self.forecast: Optional[Forecast] = None
        self._warned_at_risk = False
        self._last_tick = self._last_forecast = self._last_refresh = -1e18
        self.progress = Progress(job.source.num_rows, min(job.scan.num_done, job.source.num_rows),
                                 cfg.output.log_every_seconds, is_tty=is_tty)

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> Summary:
        state, message = mf.RunState.FAILED, None
        try:
            self._loop()
            if self.exhausted and self.scheduler.is_done() and not self.num_aborted:
                state = mf.RunState.COMPLETED
            else:
                state, message = mf.RunState.PARTIAL, self._partial_message()
        except KeyboardInterrupt:
            state, message = mf.RunState.PARTIAL, "interrupted"
            raise
        except BaseException as e:
            message = f"{type(e).__name__}: {e}"
            raise
        finally:
            summary = self._finish(state, message)
        return summary

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
            elif self.job.cfg.scheduler.on_deadline == "abort" or self.tracker.is_past_deadline():
                self._abort_in_flight()
                return
            if self.engine.has_unfinished():
                self._collect()
            elif self.stopping is not None or (self.exhausted and self.scheduler.is_done()):
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
        try:
            finished = self.engine.step()
        except Exception as e:
            raise EngineError(f"The vLLM engine failed mid-run ({type(e).__name__}: {e}). The rows it finished are "
                              f"saved in {self.job.out.url}; rerun the same command to continue.") from e
        if not finished:
            self.writer.maybe_flush()
            return
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

    def _rows(self) -> Iterator[tuple[list[Row], list[Result]]]:
        """Input rows not yet done, parsed, tokenized and predicted; bad rows come back as error results."""
        cfg = self.job.cfg
        for sb in self.job.source.batches():
            self.num_read += sb.batch.num_rows
            parsed, errors = parse_batch(sb, cfg.input, self.defaults, self.passthrough)
            parsed = [p for p in parsed if self._is_new(p.id, p.origin)]
            errors = [e for e in errors if self._is_new_error(e)]
            ready, texts, bad = self.builder.build(parsed)
            self.annotator.annotate(ready, texts)
            for row in ready:
                self.predicted_sum += row.predicted_tokens or 0
            self.predicted_n += len(ready)
            yield ready, errors + bad

    def _is_new_error(self, e: Result) -> bool:
        if e.id is None:  # matched by origin: its message starts with "<file>#<row>"
            return e.error.split(": ", 1)[0] not in self.job.scan.null_id_origins
        return self._is_new(e.id, e.error)

    def _is_new(self, row_id, origin: str) -> bool:
        if row_id in self.job.scan.done_ids and row_id not in self.emitted:
            self.num_resumed += 1
            self.emitted.add(row_id)  # a later duplicate of a resumed id is a duplicate
            return False
        if row_id in self.emitted:
            self.num_duplicates += 1
            if self.num_duplicates <= 5:
                log.warning("duplicate id %r at %s: the first row with this id is kept, this one is skipped",
                            row_id, origin.split(":")[0])
            return False
        self.emitted.add(row_id)
        return True

    # -- deadline ------------------------------------------------------------------------------
    def _tick(self) -> None:
        if self.stopping is None and self.tracker.should_stop():
            self._begin_stop()
        now = self.clock()
        if now - self._last_tick < TICK_S:
            return
        self._last_tick = now
        self.tracker.observe(self.attempt_tokens)
        if now - self._last_refresh >= REFRESH_S and self.annotator.wants_refresh():
            self._last_refresh = now
            self.annotator.refresh(self.scheduler.pending_rows())
            self.scheduler.rekey()
        if now - self._last_forecast >= FORECAST_S:
            self._last_forecast = now
            self._update_forecast()

    def _update_forecast(self) -> None:
        pending = self.scheduler.pending_rows()
        tokens = np.array([r.predicted_tokens or 0 for r in pending], dtype=np.float64)
        if self.scheduler.policy == Policy.AUTO:
            tokens = np.sort(tokens)  # the order auto uses once the deadline is at risk
        else:
            tokens = np.array([r.predicted_tokens or 0 for r in self.scheduler.pending_in_order()], dtype=np.float64)
        # Rows not read yet, less those a previous attempt finished (not met yet in this pass).
        unread = max(0, self.job.source.num_rows - self.num_read - (self.job.scan.num_done - self.num_resumed))
        mean = self.predicted_sum / self.predicted_n if self.predicted_n else 0.0
        f = self.tracker.forecast(self.in_flight_predicted / 2, self.scheduler.num_running, tokens, unread, mean)
        self.forecast = f
        if f.tokens_per_s and self.scheduler.num_running:
            self.scheduler.per_seq_tokens_per_s = f.tokens_per_s / self.scheduler.num_running
        self.progress.set_forecast(f.eta_s, f.time_left_s if self.tracker.deadline else None, f.will_miss)
        if self.tracker.deadline is None:
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

    def _begin_stop(self) -> None:
        self.stopping = "deadline reached"
        self.scheduler.is_admitting = False
        how = ("aborting" if self.job.cfg.scheduler.on_deadline == "abort" else
               f"draining them until {iso(self.tracker.deadline)}")
        log.warning(f"deadline: stopped admitting rows at {iso(self.tracker.stop_at)} (safety margin "
                    f"{self.job.margin_s:.0f} s); {self.scheduler.num_running} rows in flight, {how}")

    def _abort_in_flight(self) -> None:
        ids = self.scheduler.drain_running()
        self.num_aborted += len(ids)
        if ids:
            log.warning(f"deadline: aborting {len(ids)} rows in flight; they are not done and a rerun will redo them")
        self.engine.abort(ids)
        for rid in ids:
            self.queued_at.pop(rid, None)
        self.in_flight_predicted = 0

    def _expire(self) -> None:
        expired = self.scheduler.take_expired(self.clock())
        if expired:
            self._record([Result.failed(r.id, r.passthrough, f"{r.origin}: its deadline {iso(r.deadline_at)} passed "
                                        f"before the row could start", time.time()) for r in expired])

    def _num_left(self) -> int:
        """Input rows not done (duplicate ids are skipped, not left)."""
        return max(0, self.job.source.num_rows - self.num_ok - self.num_error - self.num_duplicates)

    def _partial_message(self) -> str:
        return f"{self.stopping or 'stopped'}: {self._num_left()} rows not done; rerun the same command to continue"

    # -- bookkeeping ---------------------------------------------------------------------------
    def _record(self, results: list[Result]) -> None:
        if not results:
            return
        tokens = 0
        for r in results:
            if r.status == "ok":
                self.num_ok += 1
                tokens += r.output_tokens or 0
            else:
                self.num_error += 1
        self.num_output_tokens += tokens
        self.attempt_tokens += tokens
        self.writer.add(results)
        self.progress.update(len(results), tokens)

    def _on_flush(self, results: list[Result], path: str) -> None:
        m = self.job.manifest
        m["counts"].update(num_done=self.num_ok + self.num_error, num_ok=self.num_ok, num_error=self.num_error,
                           num_output_tokens=self.num_output_tokens, num_parts=m["counts"].get("num_parts", 0) + 1)
        m["updated_at"] = mf.now_iso()
        self.job.out.write_manifest(m)
        self.job.out.write_status(self._status(mf.RunState.RUNNING, None))

    def _status(self, state: mf.RunState, exit_code: Optional[int], message: Optional[str] = None) -> dict:
        elapsed = time.monotonic() - self.started
        done = self.num_ok + self.num_error
        total = self.job.source.num_rows
        return {
            "state": state.value,
            "exit_code": exit_code,
            "message": message,
            "run_id": self.job.run_id,
            "out": self.job.out.url,
            "model": self.job.model.requested,
            "attempt": len(self.job.manifest["attempts"]),
            "rows": {"total": total, "done": done, "ok": self.num_ok, "error": self.num_error,
                     "remaining": self._num_left(), "resumed": self.num_resumed,
                     "duplicates": self.num_duplicates, "in_flight": self.scheduler.num_running},
            "output_tokens": self.num_output_tokens,
            "elapsed_s": round(elapsed, 3),
            "output_tokens_per_s": round(self.attempt_tokens / elapsed, 2) if elapsed > 0 else 0.0,
            "eta_s": self.progress.eta_seconds(),
            "scheduler": {"policy": self.scheduler.policy.value, "predictor": self.annotator.predictor.name,
                          "mode_switches": self.scheduler.stats.num_mode_switches,
                          "aged": self.scheduler.stats.num_aged,
                          "deadline_first": self.scheduler.stats.num_deadline_first,
                          "predictor_seconds": round(self.annotator.seconds + self.annotator.loop_seconds, 3)},
            "forecast": forecast_dict(self.forecast, self.tracker.deadline, self.scheduler.mode.value),
            "updated_at": mf.now_iso(),
        }

    def _finish(self, state: mf.RunState, message: Optional[str]) -> Summary:
        self.progress.close()
        # Rows still in the engine are not done: abort them so a cached engine starts clean.
        self.engine.abort(self.scheduler.drain_running())
        try:
            self.writer.flush()
        except Exception as e:
            log.error("could not flush the last finished rows: %s", e)
            state, message = mf.RunState.FAILED, message or f"flush failed: {e}"
        exit_code = {mf.RunState.COMPLETED: EXIT_OK, mf.RunState.PARTIAL: EXIT_PARTIAL}.get(state, EXIT_FAILED)
        m = self.job.manifest
        m["counts"].update(num_done=self.num_ok + self.num_error, num_ok=self.num_ok, num_error=self.num_error,
                           num_output_tokens=self.num_output_tokens,
                           num_parts=self.job.scan.num_parts + self.writer.num_parts_written)
        mf.end_attempt(m, state, message)
        status = self._status(state, exit_code, message)
        try:
            self.job.out.write_manifest(m)
            self.job.out.write_status(status)
        except Exception as e:
            log.error("could not write the manifest or status file: %s", e)
        return Summary(
            run_id=self.job.run_id, out=self.job.out.url, state=state.value, exit_code=exit_code,
            num_rows=self.job.source.num_rows, num_done=self.num_ok + self.num_error, num_ok=self.num_ok,
            num_error=self.num_error, num_resumed=self.num_resumed, num_duplicates=self.num_duplicates,
            num_output_tokens=self.num_output_tokens, elapsed_s=status["elapsed_s"],
            output_tokens_per_s=status["output_tokens_per_s"], message=message,
            extra={"scheduler": status["scheduler"], "forecast": status["forecast"]})
