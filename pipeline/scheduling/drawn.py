"""The rows drawn at random under longest predicted first: how far the rows left run from the log ratio.

Where the rows run longest predicted first (longest-first; auto while the deadline is safe), the log ratio
(lengths.LengthModel) is fitted on the rows predicted longest, and the rows left are the ones predicted shortest.
Where the predictions regress to the mean, those run longer against their predictions: in a 20k-row job on the
echo engine under auto, the rows admitted in the last 40% of the run ran 1.1-1.3 times their predictions and those
in the first half 0.6-1.1, and the forecast counted 57-88% of the tokens to come (docs/BENCHMARKS.md). The
scheduler admits one row in ``sample_every`` drawn at random from its pool (scheduler.py): those span every
prediction. Their log ratio is fitted as a line on the log of the prediction (``shift``), and the rows left are
expected to run as that line says at their predictions: a shift of their log ratio from the log ratio of every
row, with a standard error for the ETA's range. The rows not read yet are a sample of every row read, and take
the line at those predictions. Only the drawn rows that finished count: those still running are few, and, counted
as "at least this long" in an EM fit, they made the shift diverge (+3 to +6 in the echo engine's job).

On tests/test_forecast_drawn.py's simulated engine (1,200 rows, 150 of them drawn), with predictions spread 1.8
times wider than they know, the ETA under longest-first went from 33-40% short at 10-50% of rows to -11% to +1%
(-11% at 10%, where the drawn rows still running are the longest). Where the predictions are right (spread 1.0)
it costs the drawn rows' sampling noise: -2% to +7% became +1% to +10%; where they spread too narrowly (0.6),
+32% to +45% became +8% to +19%. Pure numpy.
"""

from __future__ import annotations

import math

import numpy as np


class DrawnRows:
    BIN = 0.05  # finished drawn rows are kept by the log of their prediction, in bins this wide
    PRIOR_ROWS = 8.0  # the weight of the log ratio of every row, in rows, in the drawn rows' fit
    SLOPE_SD = 0.5  # the prior on the line's slope: Normal(0, this), per unit of log prediction

    def __init__(self):
        self.bins: dict[int, list[float]] = {}  # bin of log(predicted) -> [rows, sum of r, sum of r^2]
        self.num_rows = 0

    def observe(self, predicted, actual, drawn) -> None:
        """Finished rows: predicted and actual output tokens, and whether each was drawn at random. A row cut at
        max_tokens counts at that length: the length models' cap holds it there too."""
        for p, a, d in zip(predicted, actual, drawn):
            if not d or not p or not a or p <= 0 or a <= 0:
                continue
            lp, r = math.log(p), math.log(a / p)
            self.num_rows += 1
            b = self.bins.setdefault(int(round(lp / self.BIN)), [0.0, 0.0, 0.0])
            b[0] += 1
            b[1] += r
            b[2] += r * r

    def shift(self, mu: float, sigma: float, pend_p: np.ndarray, pend_n: np.ndarray) -> tuple[float, float]:
        """The shift from mu (the log ratio of every row) of the log ratio of rows predicted pend_p (pend_n of
        each; their predicted tokens weigh them), and its standard error; (0, 0) before any drawn row finishes.
        The drawn rows' log ratio is a line on the log of the prediction (they span the predictions that one
        fitted on the rows run longest first would be drawn beyond), fitted by least squares with a prior of
        PRIOR_ROWS rows at mu (at their mean log prediction) and one of SLOPE_SD on the slope, and not drawn
        beyond the drawn rows' predictions (the first drawn rows may all have one prediction, the heuristic's).
        The drawn rows still running are left out: they are few (one in sample_every), and censored as "at
        least this long" in an EM fit they made the shift diverge (+3 to +6 on the echo engine's job)."""
        pend_p, pend_n = np.asarray(pend_p, np.float64), np.asarray(pend_n, np.float64)
        keep = (pend_p > 0) & (pend_n > 0)
        if not keep.any() or not self.bins:
            return 0.0, 0.0
        x = np.fromiter(self.bins.keys(), np.float64, len(self.bins)) * self.BIN
        n, s1, s2 = np.asarray(list(self.bins.values()), np.float64).reshape(-1, 3).T
        w0 = self.PRIOR_ROWS
        xbar = float(x @ n / n.sum())
        xc = x - xbar
        a = (float(s1.sum()) + w0 * mu) / (n.sum() + w0)
        var = max((float(s2.sum()) - float(s1.sum()) ** 2 / n.sum() + w0 * sigma ** 2) / (n.sum() + w0), 1e-4)
        sxx = float(n @ xc ** 2)
        b = float(xc @ s1) / (sxx + var / self.SLOPE_SD ** 2)
        fit = a + b * xc  # the spread about the line, for its standard error
        var = max((float(s2.sum() - 2 * fit @ s1 + n @ fit ** 2) + w0 * sigma ** 2) / (n.sum() + w0), 1e-4)
        px = np.clip(np.log(pend_p[keep]), float(x.min()), float(x.max())) - xbar  # not beyond the drawn rows
        tokens = pend_p[keep] * pend_n[keep]
        tokens = tokens / tokens.sum()
        center = float(tokens @ px)
        return (float(np.log(tokens @ np.exp(a + b * px - mu))),
                math.sqrt(var * (1.0 / (n.sum() + w0) + center ** 2 / (sxx + var / self.SLOPE_SD ** 2))))
