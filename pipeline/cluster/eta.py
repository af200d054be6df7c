"""The whole job's forecast on Ray, from each worker's own (scheduling.deadline) and the rows no worker holds yet.

Each worker forecasts the rows it holds (its units: in flight, pending, not yet read) with the model it learned
from its own engine: when it will be done, at how many output tokens per second, and how many of its rows a
deadline would leave undone. The rows of units no worker has taken yet go to whichever worker runs out first,
so they are laid over the workers like water: worker i is free from its own ETA on, and works through them at
its own token rate, until they are gone.

    ETA = max(T, max_i eta_i),  where  sum_i rate_i * max(0, T - eta_i) = unassigned rows * tokens per row
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass
class WorkerForecast:
    eta_s: float  # seconds until it has done the rows it holds, as of now
    tokens_per_s: float  # its engine's forecast output tokens per second
    remaining_tokens: float  # expected output tokens of the rows it holds
    remaining_rows: int  # the rows it holds that are not done
    rows_expected_left: int = 0  # of those, the rows its forecast expects the deadline to leave undone
    eta_low_s: Optional[float] = None
    eta_high_s: Optional[float] = None


@dataclass
class JobForecast:
    eta_s: float
    eta_low_s: Optional[float]
    eta_high_s: Optional[float]
    rows_expected_left: int  # with a deadline: the rows expected to be left undone; else 0
    will_miss: bool


def worker_forecast(status: dict, now: float) -> Optional[WorkerForecast]:
    """A worker's forecast from the status it last reported (its ETA less the time since), or None without one."""
    f = status.get("forecast") or {}
    eta, rate = f.get("eta_s"), f.get("tokens_per_s")
    if eta is None or not rate:
        return None
    age = max(0.0, now - status.get("forecast_at", now))
    rng = f.get("eta_range_s")
    low, high = (rng if rng else (None, None))
    shift = (lambda x: None if x is None else max(0.0, x - age))
    return WorkerForecast(max(0.0, eta - age), float(rate), float(f.get("remaining_tokens_predicted") or 0.0),
                          int(f.get("remaining_rows", (status.get("rows") or {}).get("remaining")) or 0),
                          int(f.get("rows_expected_left") or 0),
                          shift(low), shift(high))


def job_forecast(workers: list[WorkerForecast], unassigned_rows: int, time_left_s: Optional[float]) -> Optional[
        JobForecast]:
    """The job's ETA, its 80% range and the rows a deadline ``time_left_s`` from now would leave undone (None:
    no deadline), from the workers' forecasts and the rows no worker holds. None until a worker has a forecast."""
    if not workers:
        return None
    rows = sum(w.remaining_rows for w in workers)
    tokens = sum(w.remaining_tokens for w in workers)
    per_row = tokens / rows if rows else 0.0
    extra = max(0, unassigned_rows) * per_row
    eta = _fill(workers, extra)
    # The range: the workers' own, relative to their ETAs, weighted by the work each holds.
    low = high = None
    ranged = [w for w in workers if w.eta_low_s is not None and w.eta_s > 0]
    if ranged:
        weight = sum(w.remaining_tokens or 1.0 for w in ranged)
        lo = sum((w.remaining_tokens or 1.0) * w.eta_low_s / w.eta_s for w in ranged) / weight
        hi = sum((w.remaining_tokens or 1.0) * w.eta_high_s / w.eta_s for w in ranged) / weight
        low, high = min(eta, eta * lo), max(eta, eta * hi)
    left = 0
    will_miss = time_left_s is not None and eta > time_left_s
    if time_left_s is not None:
        left = sum(w.rows_expected_left for w in workers if w.eta_s > time_left_s)
        spare = sum(w.tokens_per_s * max(0.0, time_left_s - w.eta_s) for w in workers)
        unassigned_done = min(unassigned_rows, int(spare / per_row)) if per_row > 0 else unassigned_rows
        left += max(0, unassigned_rows - unassigned_done)
    return JobForecast(eta, low, high, left if will_miss else 0, will_miss)


def _fill(workers: list[WorkerForecast], extra_tokens: float) -> float:
    """The time T by which the workers, each free from its own ETA on, have also done ``extra_tokens``."""
    latest = max(w.eta_s for w in workers)
    if extra_tokens <= 0:
        return latest
    ws = sorted(workers, key=lambda w: w.eta_s)
    rate = done_by = 0.0
    t = ws[0].eta_s
    for i, w in enumerate(ws):
        # between t and the next worker's ETA, the free workers (rate) work through the extra tokens
        rate += w.tokens_per_s
        nxt = ws[i + 1].eta_s if i + 1 < len(ws) else math.inf
        if rate > 0 and done_by + rate * (nxt - t) >= extra_tokens:
            return max(latest, t + (extra_tokens - done_by) / rate)
        done_by += rate * (nxt - t) if nxt < math.inf else 0.0
        t = nxt
    return math.inf
