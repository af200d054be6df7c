"""Rows drawn at random under longest predicted first (Scheduler.sample_every, scheduling/drawn.py), on
tests/test_forecast.py's simulated engine and alone.

A predictor that spreads its predictions wider than it knows (the online one, fitted on few rows, does): the
rows predicted longest run shorter than predicted and the ones predicted shortest longer. Under longest-first
the log ratio is fitted on the first, and the rows left are the second."""

import math

import numpy as np
import pytest

from overnight.pipeline.scheduling.drawn import DrawnRows
from test_forecast import CPU, GPU, eta_error, simulate


def overconfident(seed, n=1200, spread=1.8):
    """Lengths around a signal; predictions spread `spread` times wider than it in log (1: calibrated)."""
    rng = np.random.default_rng(seed)
    signal = rng.normal(4.6, 0.45, n)
    actual = np.clip(np.round(np.exp(signal + rng.normal(0, 0.35, n))), 1, 512)
    return np.clip(np.round(np.exp(4.6 + spread * (signal - 4.6))), 1, 512), actual


@pytest.mark.parametrize("policy,cost", [("longest-first", CPU), ("auto", GPU)], ids=["cpu", "gpu"])
def test_the_rows_left_run_as_the_drawn_rows_among_them_do(policy, cost):
    """With one row in eight drawn at random, the ETA is within 10% at 25% and 50% of the rows, and within 12% at
    10%, where the drawn rows still running, left out, are the longest (-11% to +1% here); without, 33-40% short
    from 10% on. (auto without a deadline runs as longest-first.)"""
    for seed in (3, 4):
        rows = overconfident(seed)
        drawn = simulate(policy, cost, rows=rows, sample_every=8, seed=seed)
        plain = simulate(policy, cost, rows=rows, sample_every=0, seed=seed) if seed == 3 else None
        for share, bound in ((0.10, 0.12), (0.25, 0.10), (0.50, 0.10)):
            err, f, left = eta_error(drawn, share)
            assert abs(err) <= bound, (seed, share, err, f.eta_s, left)
            assert plain is None or eta_error(plain, share)[0] < -0.25


def test_the_drawn_rows_line_is_evaluated_at_the_rows_left():
    """Drawn rows whose log ratio falls by 0.5 per unit of log prediction: the rows left, predicted short, are
    shifted by the line at their predictions less mu; not beyond the drawn rows' predictions; none drawn: no
    shift."""
    rng = np.random.default_rng(0)
    d = DrawnRows()
    assert d.shift(0.0, 0.5, [20.0], [10]) == (0.0, 0.0)
    p = np.exp(rng.uniform(2.0, 6.0, 400))
    r = -0.5 * (np.log(p) - 4.0) + rng.normal(0, 0.1, 400)
    d.observe(p, p * np.exp(r), np.ones(400, bool))
    d.observe([50.0], [5000.0], [False])  # a row the policy ran is not a drawn one
    assert d.num_rows == 400
    mu = -0.3  # the log ratio of every row, fitted mostly on the rows predicted longest
    shift, se = d.shift(mu, 0.5, [math.exp(2.5)], [100])
    assert shift == pytest.approx(0.75 - mu, abs=0.05)
    assert 0 < se < 0.03
    # a prediction below every drawn row's takes the line where they end (2.0), not beyond
    assert d.shift(mu, 0.5, [math.exp(0.5)], [100])[0] == pytest.approx(1.0 - mu, abs=0.05)


def test_drawn_rows_of_one_prediction_give_the_line_no_slope():
    """The first drawn rows may all have the heuristic's one prediction (64 here): their mean, not a slope
    between two neighbouring bins, which said x15 of the tokens to come in a replay."""
    d = DrawnRows()
    d.observe([62.0] * 100 + [65.0] * 100, [60.0] * 100 + [22.0] * 100, [True] * 200)
    shift, _ = d.shift(-0.6, 0.5, [10.0, 20.0], [100, 100])
    mean = (100 * math.log(60 / 62) + 100 * math.log(22 / 65) - 8 * 0.6) / 208
    assert shift == pytest.approx(mean + 0.6, abs=0.05)
