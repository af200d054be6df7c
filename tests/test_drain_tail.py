"""The drain's end (scheduling.forecast.drain with a tail) against a brute-force Monte Carlo of the engine's slots,
under the very length model it is given: what is left is luck, and a fair forecast averages over it."""

import heapq

import numpy as np
import pytest

from overnight.pipeline.scheduling import forecast
from overnight.pipeline.scheduling.forecast import drain
from overnight.pipeline.scheduling.lengths import LengthModel

SLOTS = 64


def lengths(lm, p, rng, above=None):
    """Lengths of rows predicted p from the log ratio (capped at max_tokens); with ``above``, given they exceed it."""
    above = np.zeros(len(p)) if above is None else above
    out = np.full(len(p), np.nan)
    while np.isnan(out).any():
        todo = np.flatnonzero(np.isnan(out))
        x = np.minimum(np.round(p[todo] * np.exp(lm.mu + lm.sigma * rng.standard_normal(len(todo)))), lm.cap)
        ok = x > above[todo]
        out[todo[ok]] = x[ok]
    return out


def greedy(running_left, to_start) -> float:
    heap = list(np.concatenate([running_left, np.zeros(SLOTS - len(running_left))]))
    heapq.heapify(heap)
    for x in to_start:
        heapq.heappush(heap, heapq.heappop(heap) + x)
    return max(heap)


def state(lm, n_rows, share, seed):
    """A job of n_rows rows run over the slots until ``share`` of them finished: the predictions and tokens so far
    of the rows running, and the predictions of the rows to start, in order."""
    rng = np.random.default_rng(seed)
    p = rng.uniform(60, 240, n_rows)
    job = lengths(lm, p, rng)
    heap, starts, ends = [(0.0, j) for j in range(SLOTS)], np.zeros(n_rows), np.zeros(n_rows)
    for i in range(n_rows):
        starts[i], slot = heapq.heappop(heap)
        ends[i] = starts[i] + job[i]
        heapq.heappush(heap, (ends[i], slot))
    now = np.sort(ends)[int(np.ceil(share * n_rows)) - 1]
    running, later = (starts < now) & (ends > now), starts >= now
    return p[running], now - starts[running], p[later]


@pytest.mark.parametrize("n_rows,share", [(150, 0.10), (300, 0.25), (150, 0.50)])
def test_the_drains_end_is_the_mean_end_under_the_lengths_it_is_given(n_rows, share, monkeypatch):
    """At 10% of a 150-row job (a round of the slots still to start) the spread of each slot's last row at its
    expected start counted the drain's end 4% long here (x1.14 on the embedded model's own open-ended lengths,
    benchmarks/drain_tail.py): the engine starts the rows left as the rows running end, the first to end first,
    and a slot whose row runs long takes none. The draws are within 2%."""
    lm = LengthModel(512)
    lm.mu, lm.sigma = 0.1, 0.8
    errors, before = [], []
    for seed in range(3):
        run_p, run_g, later_p = state(lm, n_rows, share, seed)
        rng = np.random.default_rng(100 + seed)
        truth = np.mean([greedy(lengths(lm, run_p, rng, run_g) - run_g, lengths(lm, later_p, rng))
                         for _ in range(300)])
        args = (SLOTS, lm.expected(run_p, run_g), lm.expected(later_p), np.ones(len(later_p)))
        tail = (lm, run_p, run_g, later_p, 0.0)
        d = drain(*args, tail=tail)
        errors.append((d.steps + d.tail_steps) / truth - 1)
        monkeypatch.setattr(forecast, "DRAWN_ROUNDS", 0)  # the last rows' spread, as before
        d = drain(*args, tail=tail)
        before.append((d.steps + d.tail_steps) / truth - 1)
        monkeypatch.undo()
    assert max(abs(e) for e in errors) <= 0.02, errors
    if share == 0.10:
        assert min(before) >= 0.03, before


def test_rows_drawn_to_max_tokens_stay_there_and_the_rest_average_the_layouts_lengths():
    """The tail's model gives the spread; the lengths the drain lays the rows out at give the mean: a model whose
    rows mostly run to max_tokens, with the layout saying they run 100 tokens, ends where the longest does."""
    lm = LengthModel(512)
    lm.mu, lm.sigma = 2.0, 0.3  # predicted 100: nearly every row at the cap
    p = np.full(SLOTS, 100.0)
    d = drain(SLOTS, np.array([]), np.array([500.0]), np.array([SLOTS]), tail=(lm, np.zeros(0), np.zeros(0), p[:1],
                                                                               0.0))
    assert d.steps == 500 and 0 < d.tail_steps <= 12
