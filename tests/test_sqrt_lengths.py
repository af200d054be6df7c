"""The forecast's length models on the square root of the length (pipeline/scheduling/sqrt_ratio.py and lengths.py):
sqrt(L) on the log of the prediction, and the sqrt ratio for calibrated predictions; their fits from rows still
running and cut at max_tokens, and which tail the mixture takes under longest-first. No engine, no clock."""

import numpy as np
import pytest

from overnight.pipeline.scheduling.lengths import LengthMixture, LengthModel, SqrtLengthModel, SqrtRatioModel

CAP = 512


def against_draws(m, p, roots, gs=(100.0, 300.0, 450.0)):
    """A sqrt model's moments, tokens still to come and tail for rows predicted p, against lengths whose square
    roots are ``roots`` (cut at max_tokens, at least 1)."""
    draws = np.minimum(np.maximum(np.where(roots > 0, roots * roots, 0.0), 1.0), CAP)
    m1, m2 = m.moments(np.array([p]))
    assert m1[0] == pytest.approx(draws.mean(), rel=2e-3)
    assert m2[0] == pytest.approx((draws ** 2).mean(), rel=4e-3)
    for g in gs:
        alive = draws[draws > g]
        assert m.expected(np.array([p]), np.array([g]))[0] == pytest.approx((alive - g).mean(), rel=5e-3)
        assert m.quantile_cdf(50.0, np.array([p]), np.array([g]))[0] == pytest.approx(np.mean(alive - g <= 50),
                                                                                      abs=3e-3)
    assert m.expected(np.array([200.0]), None, 0.1)[0] > m.expected(np.array([200.0]))[0]


def test_sqrt_length_model_against_a_simulation():
    """sqrt(L) ~ Normal(a + b log p, s), cut at max_tokens and at least 1: its moments, its tokens still to come
    and its tail against draws."""
    rng = np.random.default_rng(3)
    m = SqrtLengthModel(CAP)
    m.a, m.b, m.s, m.x0, m.p_mean = 15.0, 2.0, 5.0, np.log(200.0), 200.0
    for p in (100.0, 400.0):
        against_draws(m, p, rng.normal(15.0 + 2.0 * np.log(p / 200.0), 5.0, 2_000_000))


def fitted_at(m, p, lengths, at: float):
    """m fitted when every row has started and run `at` tokens: the rows done by then finished, the rest run on."""
    done = lengths <= at
    m.observe(p[done], lengths[done], lengths[done] >= CAP)
    g = np.full(int((~done).sum()), at)
    m.fit(p[~done], g)
    return m, done, g


def test_the_sqrt_fit_finds_its_line_from_rows_still_running():
    rng = np.random.default_rng(4)
    p = np.round(np.exp(rng.normal(np.log(180), 0.5, 4000)))
    y = rng.normal(14.0 + 2.0 * np.log(p / 180), 5.0)
    lengths = np.clip(np.round(y * y), 1, CAP)
    m, done, g = fitted_at(SqrtLengthModel(CAP), p, lengths, 250.0)
    assert m.b == pytest.approx(2.0, abs=0.25) and m.s == pytest.approx(5.0, rel=0.05)
    assert m.a + m.b * (np.log(180) - m.x0) == pytest.approx(14.0, abs=0.3)
    assert m.expected(p[~done], g).sum() == pytest.approx(float((lengths[~done] - 250).sum()), rel=0.03)


@pytest.mark.parametrize("seed", range(3))
def test_the_tail_under_longest_first_takes_the_likelier_shape(seed):
    """The drain's tail (quantile_cdf) under longest predicted first: from the square root where lengths are
    skewed to the left in log and barely follow their predictions (the embedded model's, docs/BENCHMARKS.md), where
    the log ratio's one spread expects a row that has run long to run on too long; from the log ratio where
    lengths are log-normal around their predictions. The token sums, and the tail of rows not started, stay the log
    ratio's either way."""
    rng = np.random.default_rng(seed)
    p = np.round(np.exp(rng.normal(np.log(180), 0.5, 4000)))
    skewed = np.clip(np.round(rng.normal(15.0 + 1.0 * np.log(p / 180), 5.0) ** 2), 1, CAP)
    follow = np.clip(np.round(p * np.exp(rng.normal(0.2, 0.5, 4000))), 1, CAP)
    order = np.argsort(-p)
    started, left = order[:2000], order[2000:2010]
    at = 200.0
    for lengths, shape in ((skewed, "sqrt"), (follow, "ratio")):
        done, running = started[lengths[started] <= at], started[lengths[started] > at]
        g = np.full(len(running), at)
        model = LengthMixture(CAP)
        model.observe(p[done], lengths[done], lengths[done] >= CAP)
        model.fit(p[running], g, left_shortest=True)
        assert (model.tail is model.sqrt) == (shape == "sqrt")
        ratio_sum = model.ratio.expected(p[running], g).sum()
        assert model.expected(p[running], g).sum() == pytest.approx(ratio_sum)
        # as the drain's tail asks: a grid of remaining lengths against the last rows, running and not started
        rows_p = np.concatenate([p[running[:10]], p[left]])[None, :]
        rows_g = np.concatenate([g[:10], np.zeros(10)])[None, :]
        xs = np.linspace(0.0, 400.0, 64)[:, None] * np.ones((1, 20))
        cdf = model.quantile_cdf(xs, rows_p, rows_g)
        assert cdf.shape == (64, 20)
        np.testing.assert_allclose(cdf[:, 10:], model.ratio.quantile_cdf(xs[:, 10:], rows_p[:, 10:], rows_g[:, 10:]))
        if shape == "sqrt":  # the chance a running row has 100 tokens or fewer to go: the truth, and each shape's
            truth = np.mean(lengths[running] - at <= 100)
            ours = model.quantile_cdf(100.0, p[running], g).mean()
            theirs = model.ratio.quantile_cdf(100.0, p[running], g).mean()
            assert abs(ours - truth) < 0.05 and abs(theirs - truth) > 2 * abs(ours - truth)


def test_rows_cut_short_count_as_at_least_their_own_length():
    """A row cut by its own max_tokens (or the context) below the job's ran at least that long, not at least the
    job's max_tokens: the square root's fit finds the lengths' line from rows cut at 150, 300 and 512 tokens."""
    rng = np.random.default_rng(5)
    p = np.round(np.exp(rng.normal(np.log(180), 0.5, 6000)))
    y = rng.normal(15.0 + 1.0 * np.log(p / 180), 5.0)
    lengths = np.clip(np.round(y * y), 1, None)
    limit = rng.choice([150.0, 300.0, 512.0], len(p))
    cut = lengths >= limit
    m = SqrtLengthModel(CAP)
    m.observe(p, np.minimum(lengths, limit), cut)
    m.fit(np.zeros(0), np.zeros(0))
    assert 0.2 < cut.mean() < 0.6 and len(m.capped) > 100
    assert m.a + m.b * (np.log(180) - m.x0) == pytest.approx(15.0, abs=0.3)
    assert m.b == pytest.approx(1.0, abs=0.3) and m.s == pytest.approx(5.0, rel=0.06)


def test_sqrt_ratio_model_against_a_simulation():
    """sqrt(L / p) ~ Normal(a + b log(p / 200), s), cut at max_tokens and at least 1: its moments, tokens still to
    come and tail against draws, for a short and a long prediction, with and without a slope."""
    rng = np.random.default_rng(6)
    m = SqrtRatioModel(CAP)
    m.a, m.s, m.x0, m.p_mean = 0.95, 0.35, np.log(200.0), 200.0
    against_draws(m, 60.0, rng.normal(0.95, 0.35, 2_000_000) * np.sqrt(60.0), gs=(30.0, 100.0))
    against_draws(m, 300.0, rng.normal(0.95, 0.35, 2_000_000) * np.sqrt(300.0), gs=(30.0, 200.0, 450.0))
    m.b = -0.1
    for p in (60.0, 300.0):
        against_draws(m, p, rng.normal(0.95 - 0.1 * np.log(p / 200.0), 0.35, 2_000_000) * np.sqrt(p),
                      gs=(30.0, 100.0))
    # mu and sigma are the log-normal ones of the same mean and spread at the mean prediction
    m1, m2 = m.moments(np.array([200.0]))
    assert np.exp(m.mu + m.sigma ** 2 / 2) == pytest.approx(m1[0] / 200.0)


def test_the_sqrt_ratio_fit_finds_its_spread_from_rows_still_running_and_cut():
    """Rows still running (at least 250 tokens) and rows cut at max_tokens count as "at least": the fit finds the
    ratio's mean and spread, and the tokens still to come of the rows running."""
    rng = np.random.default_rng(7)
    p = np.round(np.exp(rng.normal(np.log(180), 0.5, 4000)))
    lengths = np.clip(np.round(p * np.maximum(rng.normal(0.95, 0.35, 4000), 0.0) ** 2), 1, CAP)
    m, done, g = fitted_at(SqrtRatioModel(CAP), p, lengths, 250.0)
    assert m.a + m.b * (np.log(180) - m.x0) == pytest.approx(0.95, abs=0.02)
    assert m.b == pytest.approx(0.0, abs=0.02) and m.s == pytest.approx(0.35, rel=0.06)
    truth = float((lengths[~done] - 250).sum())
    assert m.expected(p[~done], g).sum() == pytest.approx(truth, rel=0.03)
    # a finished fit is likelier under the shape that made the lengths than under the log ratio
    ratio = LengthModel(CAP)
    ratio.observe(p[done], lengths[done], lengths[done] >= CAP)
    ratio.fit(p[~done], g)
    assert m.loglik(p[~done], g) > ratio.loglik(p[~done], g) + 10


def test_the_sqrt_ratio_fits_the_slope_of_predictions_spread_wider_than_they_know():
    """A predictor calibrated on another mix: its shortest run longer than predicted, its longest shorter
    (sqrt(L / p) falls 0.1 for every factor e in p). The fit finds that slope, and with it the lengths of the rows
    predicted shortest, which a ratio without a slope puts about 10% low."""
    rng = np.random.default_rng(9)
    p = np.round(np.exp(rng.normal(np.log(180), 0.5, 4000)))
    lengths = np.clip(np.round(p * np.maximum(rng.normal(0.95 - 0.1 * np.log(p / 180), 0.35), 0.0) ** 2), 1, CAP)
    m, done, g = fitted_at(SqrtRatioModel(CAP), p, lengths, 250.0)
    flat, _, _ = fitted_at(SqrtRatioModel(CAP, slope_weight=1e9), p, lengths, 250.0)
    assert m.b == pytest.approx(-0.1, abs=0.02) and flat.b == pytest.approx(0.0, abs=1e-6)
    assert m.a + m.b * (np.log(180) - m.x0) == pytest.approx(0.95, abs=0.02)
    short = p < 120
    truth = float(np.minimum(lengths[short], CAP).sum())
    assert m.moments(p[short])[0].sum() == pytest.approx(truth, rel=0.03)
    assert flat.moments(p[short])[0].sum() < 0.93 * truth
    assert m.expected(p[~done], g).sum() == pytest.approx(float((lengths[~done] - 250).sum()), rel=0.03)


def test_calibrated_predictions_under_longest_first_take_the_sqrt_ratio_alone():
    """A trained predictor's predictions (calibrated) run longest predicted first: every expected length and moment
    of the mixture is the sqrt ratio's, and the drain's tail (quantile_cdf) the log ratio's, fitted on the same
    rows; in any other order, or with predictions not calibrated, the mixture is as before."""
    rng = np.random.default_rng(8)
    p = np.round(np.exp(rng.normal(np.log(180), 0.5, 3000)))
    lengths = np.clip(np.round(p * np.maximum(rng.normal(0.94, 0.35, 3000), 0.0) ** 2), 1, CAP)
    order = np.argsort(-p)
    started, left = order[:1000], order[1000:]
    at = 150.0
    done, running = started[lengths[started] <= at], started[lengths[started] > at]
    g = np.full(len(running), at)
    truth = float((lengths[running] - at).sum() + lengths[left].sum())

    def fitted(calibrated, left_shortest):
        model = LengthMixture(CAP, calibrated=calibrated)
        model.observe(p[done], lengths[done], lengths[done] >= CAP)
        model.fit(p[running], g, left_shortest=left_shortest, rest=(float(p[left].sum()), float(len(left))))
        return model

    told = fitted(True, True)
    assert told.best is told.sqrt_ratio and told.tail is None
    ours = float(told.expected(p[running], g).sum() + told.expected(p[left]).sum())
    np.testing.assert_allclose(told.moments(p[left])[0], told.sqrt_ratio.moments(p[left])[0])
    xs = np.linspace(0.0, 300.0, 16)[:, None]
    assert told.spread is told.ratio
    for gen in (g[:5], np.zeros(5)):   # rows running, and rows still to start
        np.testing.assert_allclose(told.quantile_cdf(xs, p[running[:5]], gen),
                                   told.ratio.quantile_cdf(xs, p[running[:5]], gen))
    untold = fitted(False, True)
    assert untold.sqrt_ratio is None and untold.best is untold.ratio
    # the tail's log ratio is fitted on the rows running too, as the untold mixture's is
    np.testing.assert_allclose((told.ratio.mu, told.ratio.sigma), (untold.ratio.mu, untold.ratio.sigma))
    theirs = float(untold.expected(p[running], g).sum() + untold.expected(p[left]).sum())
    assert abs(ours / truth - 1) < 0.05 and theirs / truth > 1.10, (ours / truth, theirs / truth)
    fifo = fitted(True, False)
    assert fifo.only is None and fifo.spread is None and fifo.best in (fifo.ratio, fifo.normal, fifo.sqrt)
