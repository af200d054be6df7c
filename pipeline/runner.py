"""The job's main loop: source -> resume filter -> scheduler <-> engine -> checkpoint writer.

    while work remains:
        refill()     # read input until the scheduler has a full refill pending
        admit()      # hand the scheduler's picks to vLLM
        collect()    # one engine step; finished rows go to the writer
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator, Optional

from overnight.pipeline import manifest as mf
from overnight.pipeline.checkpoint import CheckpointWriter
from overnight.pipeline.engine import EngineError
from overnight.pipeline.job import OpenJob
from overnight.pipeline.progress import Progress, fmt_duration
from overnight.pipeline.prompts import PromptBuilder
from overnight.pipeline.records import Result, Row
from overnight.pipeline.scheduler import Scheduler
from overnight.pipeline.validate import parse_batch, sampling_defaults

log = logging.getLogger("overnight")

EXIT_OK = 0
EXIT_FAILED = 1
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

    def line(self) -> str:
        head = {"completed": "done", "partial": "stopped early (resumable)", "failed": "FAILED"}.get(self.state,
                                                                                                      self.state)
        resumed = f", {self.num_resumed} already done" if self.num_resumed else ""
        dup = f", {self.num_duplicates} duplicate ids skipped" if self.num_duplicates else ""
        return (f"overnight: {head}: {self.num_done}/{self.num_rows} rows ({self.num_ok} ok, {self.num_error} error"
                f"{resumed}{dup}), {self.num_output_tokens} output tokens in {fmt_duration(self.elapsed_s)} "
                f"({self.output_tokens_per_s:.0f} tok/s) -> {self.out}")


class Runner:
    def __init__(self, job: OpenJob, engine, is_tty: Optional[bool] = None):
        self.job = job
        self.engine = engine
        cfg = job.cfg
        self.scheduler = Scheduler(engine.max_num_seqs, cfg.scheduler.queue_factor)
        self.builder = PromptBuilder(job.tokenizer, job.chat, cfg.prompt.system_prompt, engine.max_model_len)
        self.writer = CheckpointWriter(job.out, job.schema, job.run_id, job.model.requested, job.scan.next_index,
                                       cfg.output.flush_rows, cfg.output.flush_seconds, on_flush=self._on_flush)
        self.defaults = sampling_defaults(cfg.sampling)
        self.passthrough = job.source.passthrough_columns()
        self.queued_at: dict[str, float] = {}
        self.emitted: set = set()  # ids this run has handed on (or skipped as already done)
        self.num_resumed = 0
        self.num_duplicates = 0
        self.num_ok = job.scan.num_ok
        self.num_error = job.scan.num_error
        self.num_output_tokens = job.scan.num_output_tokens
        self.attempt_tokens = 0
        self.started = time.monotonic()
        self.progress = Progress(job.source.num_rows, min(job.scan.num_done, job.source.num_rows),
                                 cfg.output.log_every_seconds, is_tty=is_tty)

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> Summary:
        state, message = mf.RunState.FAILED, None
        try:
            self._loop()
            state = mf.RunState.COMPLETED
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
        rows = self._rows()
        exhausted = False
        while True:
            while not exhausted and self.scheduler.wants_rows():
                item = next(rows, None)
                if item is None:
                    exhausted = True
                    break
                ready, errors = item
                self._record(errors)
                self.scheduler.add(ready)
            self._admit()
            if not self.engine.has_unfinished():
                if exhausted and self.scheduler.is_done():
                    return
                continue
            self._collect()

    def _admit(self) -> None:
        for request_id, row in self.scheduler.schedule():
            self.queued_at[request_id] = time.time()
            try:
                self.engine.add(request_id, row.prompt_token_ids, row.sampling, row.priority)
            except ValueError as e:  # vLLM's own validation of a request
                self.scheduler.finish(request_id)
                at = self.queued_at.pop(request_id)
                self._record([Result.failed(row.id, row.passthrough, f"{row.origin}: the engine refused the row: {e}",
                                            at)])

    def _collect(self) -> None:
        results = []
        try:
            finished = self.engine.step()
        except Exception as e:
            raise EngineError(f"The vLLM engine failed mid-run ({type(e).__name__}: {e}). The rows it finished are "
                              f"saved in {self.job.out.url}; rerun the same command to continue.") from e
        for fin in finished:
            row = self.scheduler.finish(fin.request_id)
            results.append(Result.from_engine(row, fin, self.queued_at.pop(fin.request_id)))
        if results:
            self._record(results)
        self.writer.maybe_flush()

    def _rows(self) -> Iterator[tuple[list[Row], list[Result]]]:
        """Input rows not yet done, parsed and tokenized; bad rows come back as error results."""
        cfg = self.job.cfg
        for sb in self.job.source.batches():
            parsed, errors = parse_batch(sb, cfg.input, self.defaults, self.passthrough)
            parsed = [p for p in parsed if self._is_new(p.id, p.origin)]
            errors = [e for e in errors if self._is_new_error(e)]
            ready, bad = self.builder.build(parsed)
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
                     "remaining": max(0, total - done), "resumed": self.num_resumed,
                     "duplicates": self.num_duplicates, "in_flight": self.scheduler.num_running},
            "output_tokens": self.num_output_tokens,
            "elapsed_s": round(elapsed, 3),
            "output_tokens_per_s": round(self.attempt_tokens / elapsed, 2) if elapsed > 0 else 0.0,
            "eta_s": self.progress.eta_seconds(),
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
            output_tokens_per_s=status["output_tokens_per_s"], message=message)


def summary_dict(summary: Summary) -> dict:
    return asdict(summary)
