"""SIGTERM / SIGINT while a job runs: the first asks it to stop gracefully, the second to stop now.

Airflow's task timeout, Kubernetes and spot preemption send SIGTERM; a person
presses Ctrl-C. The handlers only record the request; the engine loop acts on
it at its next turn (drain within the grace period, abort the rest, flush,
exit 75), so a checkpoint is never written from inside a signal handler.
"""

from __future__ import annotations

import signal
import threading
from typing import Optional


class StopRequests:
    def __init__(self):
        self.first: Optional[str] = None   # name of the first signal received
        self.count = 0
        self._previous: dict = {}

    @property
    def is_urgent(self) -> bool:
        """A second signal: abort what is in flight now."""
        return self.count >= 2

    def _handle(self, signum, frame) -> None:
        self.count += 1
        if self.first is None:
            self.first = signal.Signals(signum).name

    def install(self) -> "StopRequests":
        """Record SIGTERM and SIGINT from now on (once: installed again, it keeps the handlers it replaced)."""
        if not self._previous and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
