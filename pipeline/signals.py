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

import os
import signal
import threading
import time
from typing import Callable, Optional

SAME_STOP_S = 0.5

# The signals recorded from the process's start (the console script's, ``record_from_start``), until a command
# takes the record over (the run's StopRequests) or gives it back (``release_from_start``).
_from_start: Optional["StopRequests"] = None


def record_from_start() -> None:
    """The console script's first act: SIGTERM / SIGINT are recorded, not fatal, while the command's modules load
    and its options are read (before, the signal's default ended a run in its first half second with 143, not
    75). A run takes the record over as it installs its own handlers; another command gives it back."""
    global _from_start
    if _from_start is None:
        _from_start = StopRequests().install()


def release_from_start() -> None:
    """For a command that handles no signal itself: the handlers from before the process's start back, and a
    signal that came meanwhile delivered again, to end the command as it would have."""
    global _from_start
    early, _from_start = _from_start, None
    if early is not None:
        early.restore()
        if early.first is not None:
            os.kill(os.getpid(), signal.Signals[early.first].value)


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
        """Record SIGTERM and SIGINT from now on (once: installed again, it keeps the handlers it replaced). It
        takes over the record kept from the process's start, if any: what came then counts as come now."""
        global _from_start
        if not self._previous and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
            early, _from_start = _from_start, None
            if early is not None:  # restoring ours then puts back what was there before the process's record
                self._previous, early._previous = early._previous, {}
                if early.first is not None:
                    if self.first is None:
                        self.first, self._first_at = early.first, early._first_at
                    self.count += early.count
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
