"""The sqrt ratio: sqrt(length / predicted) ~ Normal(mu, s), censored as LengthModel (lengths.py) is, with its
interface; SqrtLengthModel's shape (length_shapes.py) scaled by each row's prediction. LengthMixture uses it alone
where the rows run longest predicted first and the predictions are a trained predictor's. Pure numpy.
"""

from __future__ import annotations

import math

import numpy as np

from overnight.pipeline.scheduling.censored import (censored_normal_fit, censored_normal_loglik, censored_points,
                                                   count_into, finished_rows, prior_mean)
from overnight.pipeline.scheduling.length_shapes import SqrtLengthModel


class SqrtRatioModel(SqrtLengthModel):
    """The square root of actual / predicted ~ Normal(mu_y, s_y), censored the same way; the same interface as
    LengthModel. So sqrt(length) ~ Normal(mu_y sqrt(p), s_y sqrt(p)): SqrtLengthModel's shape with a spread that
    scales with the prediction, as the log ratio's does.

    The forecast's where the rows run longest predicted first and the predictions come calibrated from a trained
    predictor (LengthMixture, ``calibrated``). There the rows left are the ones predicted shortest, and a calibrated
    prediction says how long they run; the log ratio's one spread, widened by the few very short answers, then
    over-counts both the rows running and the rows not started. Emulated over the 480 labelled rows with a trained
    predictor fitted out of fold (benchmarks/length_labelled.py, 40 draws each), the tokens to come at 10-50% of rows
    were within 10% at 68% (open workload) and 78% (mixed) of points, the log ratio's at 29% and 39%. With the
    heuristic's predictions (not calibrated: its shortest run 2-3 times what it predicted) it did worse than the log
    ratio, so it is used for trained predictions only. A prior of prior_weight rows at mu_y = prior_mu, s_y =
    prior_sigma holds the fit until rows finish."""

    BIN_R = 0.01  # rows cut at max_tokens are kept as a histogram of sqrt(tokens / predicted), in bins this wide

    def __init__(self, max_tokens: int, prior_mu: float = 1.0, prior_sigma: float = 0.4, prior_weight: float = 3.0):
        super().__init__(max_tokens, prior_weight=prior_weight)
        self.prior_mu, self.prior_sigma = prior_mu, prior_sigma
        self.capped_r: dict[int, int] = {}  # rows cut at max_tokens: round(sqrt(tokens / predicted) / BIN_R) -> rows
        self.n_r, self.s1, self.s2, self.slog_r = 0, 0.0, 0.0, 0.0
        self.mu_y, self.s_y = prior_mu, prior_sigma

    def observe(self, predicted, actual, hit_cap) -> None:
        p, a, cut = finished_rows(predicted, actual, hit_cap, self.cap)
        if not len(p):
            return
        y = np.sqrt(np.minimum(a, self.cap) / p)
        count_into(self.capped_r, y[cut], self.BIN_R)
        free = y[~cut]
        self.n_r += len(free)
        self.s1 += float(free.sum())
        self.s2 += float(free @ free)
        self.slog_r += float(np.log(2 * np.sqrt(a[~cut] * p[~cut])).sum())  # dL/dy = 2 sqrt(L p)
        self.p_sum += float(p.sum())
        self.p_n += len(p)

    def _thresholds(self, running_p, running_g):
        keep = (running_p > 0) & (running_g > 0)
        return censored_points(np.sqrt(running_g[keep] / running_p[keep]), self.capped_r, self.BIN_R)

    def fit(self, running_p: np.ndarray, running_g: np.ndarray, iterations: int = 50,
            rest: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
        """Refit on the finished rows and the rows running now (predicted p, g tokens so far); rest: the sum and
        the count of the predictions of the rows still to start (only for mu and sigma, at their mean)."""
        running_p, running_g = np.asarray(running_p, np.float64), np.asarray(running_g, np.float64)
        self.p_mean = prior_mean(self, running_p, running_g, rest)
        self.x0 = math.log(self.p_mean)
        c, w = self._thresholds(running_p, running_g)
        self.mu_y, self.s_y, self.num_events = censored_normal_fit(
            self.n_r, self.s1, self.s2, c, w, (self.prior_mu, self.prior_sigma, self.prior_weight),
            (self.mu_y, self.s_y), 0.02, iterations, 1e-5)
        return self.mu, self.sigma

    def loglik(self, running_p: np.ndarray, running_g: np.ndarray) -> float:
        """Log-likelihood of the lengths seen (densities of the length itself) and of the censored rows."""
        c, w = self._thresholds(np.asarray(running_p, np.float64), np.asarray(running_g, np.float64))
        return censored_normal_loglik(self.n_r, self.s1, self.s2, -self.slog_r, c, w, self.mu_y, self.s_y)

    def _params(self, predicted, shift: float):
        root = np.sqrt(np.maximum(np.asarray(predicted, dtype=np.float64), 1.0)) * math.exp(shift / 2)
        return self.mu_y * root, self.s_y * root
