"""Forecast the finish from measured throughput and predicted remaining tokens, against a deadline.

A pure object with an injected clock: the runner feeds it the cumulative
output tokens and the predicted lengths of what is left, in the order the
scheduler would run it; it answers with an ETA, whether the deadline will be
missed, and how many rows would be left. With no deadline it still gives the
ETA for the progress bar and the status file.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import re
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from overnight.pipeline.config import ConfigError
from overnight.pipeline.progress import Rate, fmt_duration
from overnight.pipeline.scheduling.scheduler import Mode


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


log = logging.getLogger("overnight")

MODE_MESSAGES = {Mode.DEADLINE: "auto: deadline at risk, now running the most rows (or value) per predicted "
                                "token first",
                 Mode.THROUGHPUT: "auto: deadline safe again, back to longest-first"}

# auto goes back to throughput-first only when the ETA is under this fraction of the time left: without the
# gap, a forecast hovering at the deadline would switch the order back and forth.
SAFE_ETA_FRACTION = 0.8


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
        self.last: Optional[Forecast] = None  # the latest forecast, for the status file
        self.is_warned = False  # the at-risk warning was given (and the deadline is not back on track)

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
        self.last = self._forecast(in_flight_tokens, num_in_flight, pending_tokens, num_unread, mean_tokens_per_row,
                                   pending_counts)
        return self.last

    def _forecast(self, in_flight_tokens, num_in_flight, pending_tokens, num_unread, mean_tokens_per_row,
                  pending_counts) -> Forecast:
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

    def forecast_job(self, scheduler, tally, num_done_before: int, max_num_seqs: int) -> Forecast:
        """The forecast from the job's state: rows in flight (assumed half done), the pending pool in the
        order the policy runs it, and the rows not read yet at the mean prediction so far."""
        # Rows not read yet, less those an earlier attempt finished (not met yet in this pass).
        unread = max(0, tally.num_rows - tally.num_read - (num_done_before - tally.num_resumed))
        lengths, counts = scheduler.pending_in_run_order()
        f = self.forecast(scheduler.running_predicted / 2, scheduler.num_running, lengths, unread,
                          tally.mean_predicted, counts)
        if f.tokens_per_s and scheduler.num_running:
            scheduler.per_seq_tokens_per_s = f.tokens_per_s / min(scheduler.num_running, max_num_seqs)
        return f

    def start(self, scheduler) -> None:
        """Throughput-first needs evidence that the deadline is safe: until a forecast shows it, auto runs the
        most rows per token first."""
        if self.deadline is not None:
            scheduler.set_mode(Mode.DEADLINE, count=False)

    def steer(self, f: Forecast, scheduler) -> None:
        """Act on a forecast: auto's order follows it, and the operator hears once when the deadline comes at
        risk (with the rows expected to be left undone) and again when it is back on track."""
        mode = self.choose_mode(f)
        if mode is not None and scheduler.set_mode(mode):
            log.info(MODE_MESSAGES[mode])
        if f.will_miss and not self.is_warned:
            self.is_warned = True
            log.warning(self.at_risk_message(f))
        elif mode == Mode.THROUGHPUT and self.is_warned:
            self.is_warned = False
            log.info(f"deadline back on track: ETA {fmt_duration(f.eta_s)}, {fmt_duration(f.time_left_s)} left")

    def choose_mode(self, f: Forecast) -> Optional[Mode]:
        """The order auto should run in after forecast ``f``: DEADLINE once the deadline is at risk, THROUGHPUT
        once it is safe with room to spare, None to keep the current one (and always without a deadline)."""
        if self.deadline is None:
            return None
        if f.will_miss:
            return Mode.DEADLINE
        if f.eta_s is not None and f.eta_s < SAFE_ETA_FRACTION * f.time_left_s:
            return Mode.THROUGHPUT
        return None

    def at_risk_message(self, f: Forecast) -> str:
        from overnight.pipeline.report import EXIT_PARTIAL, iso

        return (f"deadline at risk: at {f.tokens_per_s:.0f} output tok/s the remaining ~{f.remaining_tokens:.0f} "
                f"tokens need {fmt_duration(f.eta_s)}, but only {fmt_duration(f.time_left_s)} remain before "
                f"{iso(self.stop_at)}; expect about {f.rows_expected_left} of {f.remaining_rows} remaining rows to "
                f"be left undone (the job will stop in time and exit {EXIT_PARTIAL}; rerun it to continue)")
