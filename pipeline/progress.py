"""Progress: a tqdm bar on a terminal, plain log lines elsewhere (cron, Airflow)."""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from typing import Callable, Optional

log = logging.getLogger("overnight")


def fmt_duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "?"
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class Rate:
    """Events per second over a sliding window."""

    def __init__(self, window: float = 30.0):
        self.window = window
        self.points: deque[tuple[float, int]] = deque()

    def add(self, t: float, total: int) -> None:
        self.points.append((t, total))
        while len(self.points) > 2 and t - self.points[0][0] > self.window:
            self.points.popleft()

    def per_second(self, now: Optional[float] = None) -> float:
        """From the window's first point to its last; with ``now``, to now, from the last point at or before the
        window's start: a rate fed only when events come (rows finishing) falls while none comes, and a burst of
        them is not counted over the moments between its own events."""
        if now is not None:
            while len(self.points) > 1 and self.points[1][0] <= now - self.window:
                self.points.popleft()
            if not self.points:
                return 0.0
            t0, v0 = self.points[0]
            return (self.points[-1][1] - v0) / (now - t0) if now > t0 else 0.0
        if len(self.points) < 2:
            return 0.0
        (t0, v0), (t1, v1) = self.points[0], self.points[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else 0.0


MAX_SAMPLES = 2000


class Progress:
    def __init__(self, total: int, initial: int, log_every: float, is_tty: Optional[bool] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.total = total
        self.done = initial
        self.skipped = 0  # rows neither done nor left: duplicate ids (the runner's tick keeps it)
        self.initial = initial
        self.tokens = 0
        self.clock = clock
        self.started = clock()
        self.log_every = log_every
        self.last_log = self.started
        self.row_rate = Rate()
        self.token_rate = Rate()  # output tokens of the rows finished
        self.gen_rate = Rate()  # output tokens generated, rows running included (the loop's feed, when it feeds)
        self.num_generated = 0
        self.rates_from(self.started)
        self.is_tty = sys.stderr.isatty() if is_tty is None else is_tty
        self.bar = None
        self.forecast_eta: Optional[float] = None
        self.eta_range: Optional[tuple[float, float]] = None
        self._deadline_left: Optional[float] = None
        self._forecast_at = 0.0  # when the last forecast came (the progress's clock)
        self.deadline_at_risk = False
        # The job's story over time, for `overnight report`: a sample at each forecast (every 2 s), thinned to
        # every other one whenever MAX_SAMPLES is reached, so a night's run keeps ~1,000-2,000 points.
        self.samples: list[dict] = []
        self.sample_every = 0.0
        if self.is_tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="row", dynamic_ncols=True, smoothing=0.1,
                            file=sys.stderr, desc="overnight")

    def rates_from(self, t: float) -> None:
        """Count the rates from ``t``: the job's start, then the engine's (its start-up generates nothing)."""
        self.row_rate.points.clear()
        self.token_rate.points.clear()
        self.row_rate.add(t, self.done)
        self.token_rate.add(t, self.tokens)
        self.gen_rate.points.clear()
        self.gen_rate.add(t, self.num_generated)

    def generated(self, total: int) -> None:
        """The output tokens the engine generated so far (a token a running sequence a step), at each tick: the
        rate shown, where the tokens of rows as they finish come in bursts and silences."""
        self.num_generated = total
        self.gen_rate.add(self.clock(), total)

    def tokens_per_s(self) -> float:
        """Output tokens per second over the last half minute: generated, where the loop feeds it; else those of
        the rows finished."""
        rate = self.gen_rate if len(self.gen_rate.points) > 1 else self.token_rate
        return rate.per_second(self.clock())

    def recount(self, done: int) -> None:
        """The rows done of this input, as the tally knows them: at the start every row in OUT counts, until a
        pass over the input finds some whose ids left it (a resume over an input that changed)."""
        delta = done - self.done
        if delta:
            self.done = done
            self.row_rate.points = type(self.row_rate.points)((t, v + delta) for t, v in self.row_rate.points)
            if self.bar is not None:
                self.bar.n = done
                self.bar.refresh()

    def update(self, num_rows: int, num_tokens: int) -> None:
        now = self.clock()
        self.done += num_rows
        self.tokens += num_tokens
        self.row_rate.add(now, self.done)
        self.token_rate.add(now, self.tokens)
        if self.bar is not None:
            self.bar.update(num_rows)
            self.bar.set_postfix_str(self.postfix(), refresh=False)
        else:
            self.tick(now)

    def tick(self, now: Optional[float] = None) -> None:
        """The plain progress line, every --log-every seconds: from the loop's tick too, so that a log shows the
        job going on while no row finishes (long answers on a GPU)."""
        now = self.clock() if now is None else now
        if self.bar is None and now - self.last_log >= self.log_every:
            self.last_log = now
            log.info(self.line(), extra={"counters": self.counters()})

    def set_forecast(self, eta_s: Optional[float], deadline_left_s: Optional[float], at_risk: bool,
                     detail: Optional[dict] = None) -> None:
        """The deadline tracker's ETA (from predicted tokens) replaces the row-rate estimate. ``detail``: what
        the forecast rests on (remaining tokens, rate, rows expected left), kept in the timeline."""
        self.forecast_eta = eta_s
        self.eta_range = None if not detail or detail.get("eta_low_s") is None else (detail["eta_low_s"],
                                                                                     detail["eta_high_s"])
        self._deadline_left, self._forecast_at = deadline_left_s, self.clock()
        self.deadline_at_risk = at_risk
        self.sample(detail)

    def _since_forecast(self, seconds: Optional[float]) -> Optional[float]:
        """A time from the last forecast, counted down since: forecasts may be far apart (one over a pool of 10k
        rows costs 10-40 ms of CPU, so the next comes 5-20 s later), and a 20k-row job's ETA shown at 10% of its
        rows was the one from its first seconds, 3.3 times the time left."""
        return None if seconds is None else max(0.0, seconds - (self.clock() - self._forecast_at))

    @property
    def deadline_left(self) -> Optional[float]:
        """The time to the deadline now."""
        return self._since_forecast(self._deadline_left)

    @property
    def all_done(self) -> bool:
        return bool(self.total) and self.done + self.skipped >= self.total

    @property
    def eta_range_now(self) -> Optional[tuple[float, float]]:
        if self.eta_range is None or self.all_done:  # (every row done: no range)
            return None
        return self._since_forecast(self.eta_range[0]), self._since_forecast(self.eta_range[1])

    def sample(self, detail: Optional[dict] = None) -> None:
        now = time.time()
        if self.samples and self.sample_every and now - self.samples[-1]["t"] < self.sample_every:
            return
        self.samples.append({"t": round(now, 3), "rows_done": self.done, "output_tokens": self.tokens,
                             "output_tokens_per_s": round(self.tokens_per_s(), 2),
                             "eta_s": self.eta_seconds(), "deadline_left_s": self.deadline_left,
                             "at_risk": self.deadline_at_risk, **(detail or {})})
        if len(self.samples) >= MAX_SAMPLES:
            self.samples = self.samples[::2]
            self.sample_every = 2 * max(self.sample_every, 1.0)

    def postfix(self) -> str:
        text = f"{self.tokens_per_s():.0f} tok/s, ETA {fmt_duration(self.eta_seconds())}"
        if self.eta_range_now is not None and self.forecast_eta is not None:
            low, high = self.eta_range_now
            text += f" ({fmt_duration(low)}-{fmt_duration(high)})"
        if self.deadline_left is not None:
            text += f", deadline in {fmt_duration(self.deadline_left)}{' AT RISK' if self.deadline_at_risk else ''}"
        return text

    def eta_seconds(self) -> Optional[float]:
        if self.all_done:  # every row done: the last forecast's ETA is past
            return 0.0
        if self.forecast_eta is not None:
            return self._since_forecast(self.forecast_eta)
        rate = self.row_rate.per_second(self.clock())
        remaining = max(0, self.total - self.done - self.skipped)
        if remaining == 0:
            return 0.0
        return remaining / rate if rate > 0 else None

    def line(self) -> str:
        pct = 100.0 * self.done / self.total if self.total else 100.0
        return f"{self.done}/{self.total} rows ({pct:.0f}%), {self.postfix().replace('tok/s', 'output tok/s', 1)}"

    def counters(self) -> dict:
        """What a progress line says, as numbers (the JSON log lines carry them)."""
        return {"rows_done": self.done, "rows_total": self.total,
                "output_tokens_per_s": round(self.tokens_per_s(), 2), "eta_s": self.eta_seconds(),
                "eta_range_s": None if self.eta_range_now is None else [round(x, 1) for x in self.eta_range_now],
                "deadline_left_s": self.deadline_left, "deadline_at_risk": self.deadline_at_risk}

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
