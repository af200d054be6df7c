"""Run the input stage in a background thread, a few batches ahead of the engine loop.

Reading Parquet, validating, tokenizing and predicting lengths take the
Python side tens of microseconds per row. The engine loop spends most of its
time waiting on vLLM's engine process (in ``step()``, which releases the
GIL), so doing that work in a thread overlaps it with generation instead of
adding it to the wall time. The queue is bounded, so memory stays flat.
"""

from __future__ import annotations

import queue
import threading
from typing import Iterator, Optional


PREFETCH_DEPTH = 4  # prepared batches held ahead of the engine loop


class _End:
    pass


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher:
    def __init__(self, items: Iterator, depth: int = PREFETCH_DEPTH, name: str = "overnight-reader"):
        self._items = items
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self.is_exhausted = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for item in self._items:
                if not self._put(item):
                    return
            self._put(_End())
        except BaseException as e:  # surfaces in the engine loop's thread
            self._put(_Failed(e))

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def get(self, block: bool, timeout: Optional[float] = None) -> Optional[object]:
        """The next item; None when none is ready (block=False, or after ``timeout`` seconds) or the input is
        exhausted."""
        if self.is_exhausted:
            return None
        try:
            item = self._queue.get(block=block, timeout=timeout if block else None)
        except queue.Empty:
            return None
        if isinstance(item, _End):
            self.is_exhausted = True
            return None
        if isinstance(item, _Failed):
            self.is_exhausted = True
            raise item.error
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
