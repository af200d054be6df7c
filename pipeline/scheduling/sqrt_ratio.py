"""The sqrt ratio: sqrt(length / predicted) ~ Normal(a + b log(predicted), s), censored as LengthModel (lengths.py)
is, with its interface; SqrtLengthModel's line (length_shapes.py) on the ratio, scaled by each row's prediction.
LengthMixture uses it alone where the rows run longest predicted first and the predictions are a trained
predictor's. Pure numpy.
"""

from __future__ import annotations

import numpy as np

from overnight.pipeline.scheduling.length_shapes import SqrtLengthModel


class SqrtRatioModel(SqrtLengthModel):
    """The square root of actual / predicted ~ Normal(a + b log(predicted), s), censored the same way; the same
    interface as LengthModel. So sqrt(length) ~ Normal((a + b log p) sqrt(p), s sqrt(p)): SqrtLengthModel's shape
    with a spread that scales with the prediction, as the log ratio's does.

    The forecast's where the rows run longest predicted first and the predictions come calibrated from a trained
    predictor (LengthMixture, ``calibrated``). There the rows left are the ones predicted shortest, and a calibrated
    prediction says how long they run; the log ratio's one spread, widened by the few very short answers, then
    over-counts both the rows running and the rows not started. Emulated over the 480 labelled rows with a trained
    predictor fitted out of fold (benchmarks/length_labelled.py, 40 draws each), the tokens to come at 10-50% of rows
    were within 10% at 65% (open workload) and 73% (mixed) of points (68% and 78% before the slope below), the
    log ratio's at 29% and 39%. With the heuristic's predictions (not calibrated: its shortest run 2-3 times what it
    predicted) it did worse than the log ratio, so it is used for trained predictions only.

    The slope b: a predictor calibrated on one mix of prompts, run on another, spreads its predictions wider than it
    knows (its shortest run longer than predicted, its longest shorter), and the rows left late under longest-first
    are the ones predicted shortest. The rows running span enough of the predictions that the run fits b from its
    first rows (-0.14 to +0.02 on the mixed runs of docs/BENCHMARKS.md, stop 35). A prior of prior_weight rows at
    a = prior_mu, s = prior_sigma (at the mean prediction) and one of slope_weight on b at 0 hold the fit until rows
    finish."""

    S_FLOOR, TOL, Y_BIN = 0.02, 1e-5, 0.01

    def __init__(self, max_tokens: int, prior_mu: float = 1.0, prior_sigma: float = 0.4, prior_weight: float = 3.0,
                 slope_weight: float = 10.0):
        super().__init__(max_tokens, prior_weight=prior_weight, slope_weight=slope_weight)
        self.prior_mu, self.prior_sigma = prior_mu, prior_sigma
        self.a, self.s = prior_mu, prior_sigma

    def _y(self, p, a):
        return np.sqrt(a / p)

    def _log_jacobian(self, p, a):
        return np.log(2 * np.sqrt(a * p))  # L = p y^2: dL/dy = 2 p y = 2 sqrt(L p)

    def _prior(self) -> tuple[float, float]:
        return self.prior_mu, self.prior_sigma ** 2

    def _scale(self, p):
        return np.sqrt(p)
