"""Which pending rows go to the engine next: a pure state machine, no engine, clock or I/O.

The scheduler keeps vLLM's waiting queue topped up a little above what the
engine can run (``max_running``), so every slot a step frees is refilled at
once, without pushing the whole dataset into the engine: rows not yet
admitted stay cheap to reorder and need no abort at a deadline.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from overnight.pipeline.records import Row


class Scheduler:
    def __init__(self, max_running: int, queue_factor: float = 1.0):
        # Rows in the engine at once: what it can run plus a waiting margin.
        self.capacity = max(1, int(round(max_running * (1 + queue_factor))))
        self.pending: deque[Row] = deque()
        self.running: dict[str, Row] = {}
        self._next_id = 0

    @property
    def num_pending(self) -> int:
        return len(self.pending)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def wants_rows(self) -> bool:
        """True while fewer rows are pending than one full refill of the engine."""
        return len(self.pending) < self.capacity

    def add(self, rows: Iterable[Row]) -> None:
        self.pending.extend(rows)

    def schedule(self) -> list[tuple[str, Row]]:
        """Rows to admit now, each with its engine request id."""
        admitted = []
        while self.pending and len(self.running) < self.capacity:
            row = self.pending.popleft()
            request_id = str(self._next_id)
            self._next_id += 1
            self.running[request_id] = row
            admitted.append((request_id, row))
        return admitted

    def finish(self, request_id: str) -> Row:
        return self.running.pop(request_id)

    def drain_running(self) -> list[str]:
        """Forget every running row (they are being aborted); return their request ids."""
        ids = list(self.running)
        self.running.clear()
        return ids

    def is_done(self) -> bool:
        return not self.pending and not self.running
