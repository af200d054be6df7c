"""SIGTERM / SIGINT while a job runs: the first asks it to stop gracefully, the second to stop now.

Airflow's task timeout, Kubernetes and spot preemption send SIGTERM; a person
presses Ctrl-C. The handlers only record the request; the engine loop acts on
it at its next turn (drain within the grace period, abort the rest, flush,
exit 75), so a checkpoint is never written from inside a signal handler.

One stop often arrives twice at once: `scancel`, or Airflow stopping a task,
signals the whole process group, and the wrapper that runs overnight (the Slurm
script, the Airflow task) passes the signal on as well. A second signal of the
same kind within SAME_STOP_S of the first is that same stop, not the second
that aborts; a person pressing Ctrl-C again a moment later does abort.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Callable, Optional

SAME_STOP_S = 0.5


class StopRequests:
    def __init__(self, clock=time.monotonic, on_request: Optional[Callable[[str], None]] = None):
        self.first: Optional[str] = None   # name of the first signal received
        self.count = 0
        self._previous: dict = {}
        self._clock = clock
        self._first_at: Optional[float] = None
        self.on_request = on_request  # called with the signal's name for each request counted

    @property
    def is_urgent(self) -> bool:
        """A second signal: abort what is in flight now."""
        return self.count >= 2

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        now = self._clock()
        if self.first is None:
            self.first, self._first_at = name, now
        elif self.count == 1 and name == self.first and now - self._first_at < SAME_STOP_S:
            return  # the same stop, delivered twice (to the process group, and passed on by a wrapper)
        self.count += 1
        if self.on_request is not None:
            self.on_request(name)

    def replay(self, name: str) -> None:
        """A request that came before these handlers were installed (to another StopRequests)."""
        self._handle(signal.Signals[name].value, None)

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
