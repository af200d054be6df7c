"""Forecast the finish from measured throughput and predicted remaining tokens, against a deadline.

A pure object with an injected clock: the runner feeds it the cumulative
output tokens and the predicted lengths of what is left, in the order the
scheduler would run it; it answers with an ETA, whether the deadline will be
missed, and how many rows would be left. With no deadline it still gives the
ETA for the progress bar and the status file.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from overnight.pipeline.config import ConfigError
from overnight.pipeline.progress import Rate


@dataclass
class Forecast:
    tokens_per_s: float
    # Predicted output tokens still to generate (in flight, pending, not yet read).
    remaining_tokens: float
    remaining_rows: int
    # Seconds to finish everything at the measured rate; None until a rate is known.
    eta_s: Optional[float]
    # Seconds until admission stops (deadline minus safety margin); inf without a deadline.
    time_left_s: float
    will_miss: bool
    rows_expected_left: int


def parse_budget(text: str) -> float:
    """'90m', '1h30m', '45s', '2h', or plain seconds -> seconds."""
    t = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", t):
        return float(t)
    m = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m(?:in)?)?\s*(?:(\d+(?:\.\d+)?)s)?", t)
    if not t or not m or not any(m.groups()):
        raise ConfigError(f"time budget {text!r} is not a duration; use e.g. 90m, 1h30m, 45s or 3600.")
    h, mnt, s = (float(g) if g else 0.0 for g in m.groups())
    return h * 3600 + mnt * 60 + s


def parse_deadline(text: str, now: float) -> float:
    """An ISO time (local when it has no offset) -> seconds since the epoch; must be in the future."""
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigError(f"deadline {text!r} is not an ISO time; use e.g. 2026-11-23T06:00 (local time) "
                          f"or 2026-11-23T06:00+01:00.") from None
    at = when.timestamp()
    if at <= now:
        shown = dt.datetime.fromtimestamp(now).isoformat(timespec="seconds")
        raise ConfigError(f"deadline {text} is in the past (it is now {shown}). Give a later time, "
                          f"or a --time-budget such as 90m.")
    return at


class DeadlineTracker:
    def __init__(self, deadline: Optional[float], margin_s: float = 0.0, clock: Callable[[], float] = time.time,
                 initial_tokens_per_s: Optional[float] = None, window_s: float = 30.0, warmup_s: float = 10.0):
        # warmup_s: the first seconds of a run measure prefill and start-up more than generation; a rate
        # measured over less than this is not trusted (a configured tokens_per_second is used meanwhile).
        self.deadline = deadline
        self.stop_at = None if deadline is None else deadline - margin_s
        self.clock = clock
        self.initial_tokens_per_s = initial_tokens_per_s
        self.rate = Rate(window_s)
        self.warmup_s = warmup_s
        self._first: Optional[float] = None

    def observe(self, total_output_tokens: int) -> None:
        now = self.clock()
        if self._first is None:
            self._first = now
        self.rate.add(now, total_output_tokens)

    @property
    def tokens_per_s(self) -> Optional[float]:
        measured = self.rate.per_second()
        if self._first is not None and self.clock() - self._first >= self.warmup_s and measured > 0:
            return measured
        return self.initial_tokens_per_s

    def should_stop(self) -> bool:
        return self.stop_at is not None and self.clock() >= self.stop_at

    def is_past_deadline(self) -> bool:
        return self.deadline is not None and self.clock() >= self.deadline

    def time_left(self) -> float:
        return math.inf if self.stop_at is None else max(0.0, self.stop_at - self.clock())

    def forecast(self, in_flight_tokens: float, num_in_flight: int, pending_tokens, num_unread: int,
                 mean_tokens_per_row: float, pending_counts=None) -> Forecast:
        """pending_tokens: predicted output tokens of pending rows, in scheduling order; or, with
        pending_counts, distinct lengths in scheduling order and how many rows have each."""
        tps = self.tokens_per_s or 0.0
        values = np.asarray(pending_tokens, dtype=np.float64)
        counts = np.ones(len(values)) if pending_counts is None else np.asarray(pending_counts, dtype=np.float64)
        pending_sum = float(values @ counts) if len(values) else 0.0
        num_pending = int(counts.sum())
        unread_tokens = num_unread * mean_tokens_per_row
        remaining = in_flight_tokens + pending_sum + unread_tokens
        rows = num_in_flight + num_pending + num_unread
        eta = remaining / tps if tps > 0 else None
        left = self.time_left()
        if self.stop_at is None or eta is None:
            return Forecast(tps, remaining, rows, eta, left, False, 0)
        budget = tps * left - in_flight_tokens
        done = num_in_flight if budget >= 0 else 0
        if budget > 0:
            cum = np.cumsum(values * counts)
            k = int(np.searchsorted(cum, budget, side="right"))  # lengths whose rows all fit
            done += int(counts[:k].sum())
            spare = budget - (float(cum[k - 1]) if k else 0.0)
            if k < len(values):  # some of the next length's rows fit
                done += int(min(counts[k], spare // values[k]))
            elif mean_tokens_per_row > 0:
                done += min(num_unread, int(spare // mean_tokens_per_row))
        return Forecast(tps, remaining, rows, eta, left, eta > left, max(0, rows - done))
