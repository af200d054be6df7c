"""Rows drawn at random where the rows run by predicted length (Scheduler.sample_every, scheduling/drawn.py), on
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


SEEDS = range(1, 9)


def errors(policy, cost, spread=1.8, sample_every=8, shares=(0.10, 0.25, 0.50)):
    """The ETA's error at each share of rows, one row per seed."""
    out = []
    for seed in SEEDS:
        story = simulate(policy, cost, rows=overconfident(seed, spread=spread), sample_every=sample_every, seed=seed)
        out.append([eta_error(story, share)[0] for share in shares])
    return np.array(out)


@pytest.mark.parametrize("policy,cost", [("longest-first", CPU), ("auto", GPU)], ids=["cpu", "gpu"])
def test_the_rows_left_run_as_the_drawn_rows_among_them_do(policy, cost):
    """With one row in eight drawn at random, over eight seeds: the ETA within 8% at 25% and 50% of the rows
    (3-4% on average), and within 22% at 10%, where few drawn rows have counted (7-8% on average, up to +18%; the
    line alone, before stop 66, 8% and -16%); without, 33-40% short from 10% on. (auto without a deadline runs as longest-first.) The strata's residuals shrunk by a fixed
    8 rows had -11% at 10%: on these rows, whose log ratio is a line on the prediction, they fitted noise that
    happened to help; on the real engine's mixed workload the same noise took the tokens to come at 50% of rows
    to x0.81-0.83, against x0.93 shrunk by the data (docs/BENCHMARKS.md, stop 62)."""
    err = np.abs(errors(policy, cost))
    assert (err.mean(axis=0) <= [0.10, 0.05, 0.05]).all(), err
    assert (err.max(axis=0) <= [0.22, 0.08, 0.08]).all(), err
    plain = simulate(policy, cost, rows=overconfident(3), sample_every=0, seed=3)
    assert all(eta_error(plain, share)[0] < -0.25 for share in (0.10, 0.25, 0.50))


def test_under_shortest_first_the_rows_left_run_as_the_drawn_rows_among_them_do():
    """Under shortest-first the rows left are the ones predicted longest, and the rows seen the shortest. With the
    predictions spread 1.8 times too wide, the weighing of the three length models was 13-23% short at 25-50% of
    rows; with one row in eight drawn at random it is within 10% there on average over eight seeds (10% and 7%), 18%
    at worst. At 10% few drawn rows have finished (the short rows go first), and until 8 count the weighing stands,
    the rows left shifted as the drawn rows running say (censored_shift): no worse there than without them on
    average (18% in mean |error| against 22%), though long (+17% on average, up to +55%, where the weighing alone was
    -10% and 39%; it was -8% and 41% without rows drawn)."""
    drawn, plain = errors("shortest-first", CPU), errors("shortest-first", CPU, sample_every=0)
    assert np.abs(drawn[:, 0]).mean() <= np.abs(plain[:, 0]).mean() + 0.02  # the line's prior there: +86%
    assert (np.abs(drawn[:, 1:]).mean(axis=0) <= 0.10).all(), drawn
    assert (plain[:, 1:].mean(axis=0) < -0.15).all(), plain


def test_under_shortest_first_the_drawn_rows_running_say_how_the_rows_left_run_from_a_tenth_of_the_rows():
    """Predictions 0.6 times as wide as what they know, as the online predictor's are (stop 66): the rows predicted
    shortest, which go first, run shorter than their predictions say of the rest. At a tenth of the rows, before 8
    drawn rows count, the weighed length models alone were 30% short on average over eight seeds (35% at worst);
    with the drawn rows running counted as "at least" (DrawnRows.censored_shift), -4% on average, 10% in mean
    |error|, 16% at worst. Without rows drawn at random, -32% on average."""
    drawn = errors("shortest-first", CPU, spread=0.6, shares=(0.10,))[:, 0]
    assert abs(drawn.mean()) <= 0.08 and np.abs(drawn).mean() <= 0.14 and np.abs(drawn).max() <= 0.25, drawn
    plain = errors("shortest-first", CPU, spread=0.6, sample_every=0, shares=(0.10,))[:, 0]
    assert plain.mean() < -0.2, plain


def test_under_shortest_first_the_rows_not_read_yet_run_as_every_row_read():
    """Rows read as the pool drains, 300 held at a time: under shortest-first the pool's rows left are the ones
    predicted longest, and the rows not read yet are like every row read, not like those. At a tenth of the rows,
    before 8 drawn rows count, they were costed at the pool's mean prediction: +18% on average over eight seeds with
    predictions that know what they say (28% at worst); at every row read's, shifted as every drawn row says (the
    running ones as "at least"), +3% (15%)."""
    out = []
    for seed in SEEDS:
        story = simulate("shortest-first", CPU, rows=overconfident(seed, spread=1.0), sample_every=8, seed=seed,
                         pool=300)
        out.append(eta_error(story, 0.10)[0])
    assert abs(np.mean(out)) <= 0.08 and np.abs(out).max() <= 0.20, out


def test_where_the_predictions_are_narrow_the_drawn_rows_among_the_rows_left_say_how_they_run():
    """Predictions spread 0.15 times as wide as what they know (the online predictor's on GSM8K: the rows left
    within 0.01-0.03 in log, docs/BENCHMARKS.md, stop 65): the rows left, predicted lowest, run well below the
    average row, and no line on the log prediction with a prior on its slope follows them: it had the ETA 11-16% long
    on average at 25% and 50% of rows (up to +27%), and 23% long at 10%. The drawn rows predicted where the rows left
    are, a random sample of them, take it within 8% on average over eight seeds (5-8%), their mean within 6%."""
    err = errors("longest-first", CPU, spread=0.15)
    assert (np.abs(err).mean(axis=0) <= 0.10).all(), err
    assert (np.abs(err.mean(axis=0)) <= 0.08).all(), err


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
    d.release()
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
    d.release()
    shift, _ = d.shift(-0.6, 0.5, [10.0, 20.0], [100, 100])
    mean = (100 * math.log(60 / 62) + 100 * math.log(22 / 65) - 8 * 0.6) / 208
    assert shift == pytest.approx(mean + 0.6, abs=0.05)


def test_the_drawn_rows_predicted_where_the_rows_left_are_say_how_those_run():
    """Predictions within 0.03 in log (250 to 257 tokens) whose rows run from 0.7 to 1.4 times them, the lowest
    shortest: a line on the log prediction with a prior of 0.5 on its slope moves the rows left (250 to 252) by a
    few hundredths. The drawn rows predicted within theirs say what they run, at the shift where the length model
    expects it, whatever cuts the model makes (here lengths cut at 300 tokens)."""
    rng = np.random.default_rng(2)
    d = DrawnRows()
    p = rng.integers(250, 258, 400).astype(np.float64)
    actual = np.minimum(p * np.exp(0.1 * (p - 253.5) + rng.normal(0, 0.1, 400)), 300.0)
    d.observe(p, actual, [True] * 400)
    d.release()
    mu, sigma, left, n = 0.05, 0.3, np.array([250.0, 251.0, 252.0]), [100, 100, 100]
    z = rng.normal(0, 1, 4000)

    def expected(pred, shift):  # a log-normal cut at 300 tokens, by its draws
        return np.minimum(np.asarray(pred)[:, None] * np.exp(mu + shift + sigma * z), 300.0).mean(axis=1)

    line, _ = d.shift(mu, sigma, left, n)
    shift, se = d.shift(mu, sigma, left, n, among=(250.0, 252.0), expected=expected)
    there = p <= 252
    assert float(expected(p[there], shift).sum()) == pytest.approx(float(actual[there].sum()), rel=0.02)
    assert 0 < se < 0.03
    assert float(expected(p[there], line).sum()) > 1.15 * float(actual[there].sum())
    # fewer than PRIOR_ROWS drawn rows there, or no model: the line
    assert d.shift(mu, sigma, left, n, among=(240.0, 245.0), expected=expected) == d.shift(mu, sigma, left, n)
    assert d.shift(mu, sigma, left, n, among=(250.0, 252.0)) == d.shift(mu, sigma, left, n)


def test_drawn_rows_still_running_count_as_at_least_what_they_have_run():
    """Under shortest-first at a tenth of the rows, few drawn rows have finished, and those are the short ones of
    their draws. Sixty drawn rows predicted 100 tokens that run log-normal around their predictions (0.5 in log),
    60 steps in: the few that finished ran under 60 tokens, the rest at least 60. Counted as "at least", they
    put the rows left where they run; the finished ones alone, 0.9 in log below."""
    from overnight.pipeline.scheduling.lengths import LengthModel

    rng = np.random.default_rng(0)
    p = np.full(60, 100.0)
    actual = np.round(p * np.exp(rng.normal(0.0, 0.5, 60)))
    done = actual <= 60
    model = LengthModel(512)
    model.mu, model.sigma = -0.6, 0.5  # what the rows predicted shortest said

    def expected(pred, shift):
        return model.expected(pred, None, shift)

    def shift(running, draws=60):
        d = DrawnRows()
        d.observe(p[done], actual[done], np.flatnonzero(done) + 1)  # held: drawn rows before them run on
        return d.censored_shift(-0.6, 0.5, running, (80.0, 120.0), 512.0, (np.full(500, 100.0), np.ones(500)),
                                expected, 0.05)

    s, se = shift((p[~done], np.full(int((~done).sum()), 60.0)))
    assert 2 <= done.sum() <= 12
    assert s == pytest.approx(0.6, abs=0.15)  # the log ratio of every drawn row: 0 against the model's -0.6
    assert 0 < se < 0.15
    alone, _ = shift((np.zeros(0), np.zeros(0)))
    assert alone < s - 0.5
    # rows drawn outside the rows left's predictions do not count; fewer than MIN_CENSORED: no shift
    d = DrawnRows()
    assert d.censored_shift(-0.6, 0.5, (p[:3], np.full(3, 60.0)), (80.0, 120.0), 512.0, (p, np.ones(60)), expected,
                            0.05) == (0.0, 0.0)
    assert d.censored_shift(-0.6, 0.5, (p, np.full(60, 60.0)), (200.0, 300.0), 512.0, (p, np.ones(60)), expected,
                            0.05) == (0.0, 0.0)


def test_a_drawn_row_counts_once_every_row_drawn_before_it_has_finished():
    """Rows drawn 3 and 4 finished short while row 2, drawn before them, still runs: counted alone they would
    leave out the long ones of their draws. They count when it finishes."""
    d = DrawnRows()
    d.observe([50.0, 50.0, 50.0], [40.0, 10.0, 12.0], [1, 3, 4])
    d.release(first_running=2)
    assert d.num_rows == 1 and [h[0] for h in d.held] == [3, 4]
    d.observe([50.0], [4000.0], [2])
    d.release()  # none running
    assert d.num_rows == 4 and not d.held
    every = DrawnRows()
    every.observe([50.0] * 4, [40.0, 10.0, 12.0, 4000.0], [True] * 4)
    every.release()
    assert d.shift(0.0, 0.5, [50.0], [10]) == pytest.approx(every.shift(0.0, 0.5, [50.0], [10]))
    assert d.shift(0.0, 0.5, [50.0], [10])[0] > 0  # the long one counts


def test_the_drawn_rows_are_predicted_again_with_the_pool():
    """At a re-prediction of the pool, the drawn rows counted, held and running are predicted again: the line
    relates their lengths to the predictions the rows left have now. A row counted while the answer was on its
    way takes its new prediction if it was running at the snapshot; a row still running, when it finishes."""
    d = DrawnRows()
    feats = [object() for _ in range(40)]
    d.observe([50.0] * 20, [30.0] * 20, list(range(1, 21)), feats[:20])
    d.release()
    d.observe([50.0], [30.0], [22], [feats[21]])  # finished, held behind draw 21, which runs
    d.release(first_running=21)
    asked = d.snapshot(running=[feats[20]])
    assert asked == feats[:20] + [feats[20], feats[21]]
    d.observe([50.0], [30.0], [21], [feats[20]])  # 21 finishes before the answer comes: 21 and 22 count
    d.release()
    assert d.num_rows == 22
    d.repredicted(np.array([25.0] * 20 + [20.0, 15.0]))
    assert d.num_rows == 22
    expect = {int(round(math.log(p) / DrawnRows.BIN)): n for p, n in ((25.0, 20), (20.0, 1), (15.0, 1))}
    assert {b: v[0] for b, v in d.bins.items()} == expect
    # a re-prediction whose answer does not match what was asked changes nothing
    d.snapshot()
    d.repredicted(np.array([10.0]))
    assert {b: v[0] for b, v in d.bins.items()} == expect


def test_the_drawn_rows_strata_say_what_a_line_misses():
    """Predictions in clusters whose log ratios no line passes through (the echo engine's job: -0.1 at a log
    prediction of 2.5, 0 at 2.75 and 4.0, -0.75 at 4.25): the rows left at a cluster run as its drawn rows did,
    not as the line says there."""
    rng = np.random.default_rng(1)
    d = DrawnRows()
    for lp, r in ((2.5, -0.1), (2.75, 0.0), (4.0, 0.0), (4.25, -0.75)):
        p = np.full(100, math.exp(lp))
        d.observe(p, p * np.exp(r + rng.normal(0, 0.1, 100)), [True] * 100)
    d.release()
    mu = -0.2
    for lp, r in ((2.5, -0.1), (4.25, -0.75)):
        assert d.shift(mu, 0.5, [math.exp(lp)], [10])[0] == pytest.approx(r - mu, abs=0.05)
