"""The writer of a run's finished rows: it buffers them and flushes a new part (``OutputDir.write_part``) every N
rows or T seconds, asking first whether the run still holds OUT."""

from __future__ import annotations

import time
from typing import Callable, Optional

from overnight.pipeline.output.checkpoint import OutputDir
from overnight.pipeline.output.schema import OutputSchema
from overnight.pipeline.records import Result


class CheckpointWriter:
    """Buffers results and flushes them as a new part every N rows or T seconds."""

    def __init__(self, out: OutputDir, schema: OutputSchema, run_id: str, model: str, first_index: int,
                 flush_rows: int, flush_seconds: float, clock: Callable[[], float] = time.monotonic,
                 on_flush: Optional[Callable[[list[Result], str], None]] = None,
                 may_write: Optional[Callable[[], bool]] = None):
        self.out = out
        self.schema = schema
        self.run_id = run_id
        self.model = model
        self.next_index = first_index
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self.clock = clock
        self.on_flush = on_flush
        self.may_write = may_write  # asked before each part: False once another run took the folder over
        self.unsaved: list[Result] = []  # results not written because of it
        self.buffer: list[Result] = []
        self.last_flush = clock()

    @property
    def num_unsaved(self) -> int:
        return len(self.unsaved)

    def add(self, results: list[Result]) -> None:
        self.buffer.extend(results)
        if len(self.buffer) >= self.flush_rows:
            self.flush()

    def maybe_flush(self) -> None:
        if self.buffer and self.clock() - self.last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        self.last_flush = self.clock()
        if not self.buffer:
            return
        results, self.buffer = self.buffer, []
        if self.may_write is not None and not self.may_write():
            self.unsaved.extend(results)
            return
        table = self.schema.table(results, self.run_id, self.model)
        try:
            path = self.out.write_part(self.next_index, table)
        except Exception:
            self.buffer = results + self.buffer  # keep them: a later flush may succeed
            raise
        self.next_index += 1
        if self.on_flush:
            self.on_flush(results, path)
