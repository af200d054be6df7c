"""The rows drawn at random where the rows run by predicted length: how far the rows left run from the log ratio.

Where the rows run longest predicted first (longest-first; auto while the deadline is safe), the log ratio
(lengths.LengthModel) is fitted on the rows predicted longest, and the rows left are the ones predicted shortest.
Where the predictions regress to the mean, those run longer against their predictions: in a 20k-row job on the
echo engine under auto, the rows admitted in the last 40% of the run ran 1.1-1.3 times their predictions and those
in the first half 0.6-1.1, and the forecast counted 57-88% of the tokens to come (docs/BENCHMARKS.md). The
scheduler admits one row in ``sample_every`` drawn at random from its pool (scheduler.py): those span every
prediction. Their log ratio is fitted as a line on the log of the prediction (``shift``), with what each stratum of
the prediction's drawn rows runs off that line, and the rows left are expected to run as those say at their
predictions: a shift of their log ratio from the log ratio of every row, with a standard error for the ETA's range.
The rows not read yet are a sample of every row read, and take the same at those predictions. Under shortest-first
it is the other way round (the rows left are the ones predicted longest), and the same line serves once as many
drawn rows count as its prior weighs (estimate.py): the short rows finish long before the first drawn ones do.
Until then the drawn rows within the rows left's predictions, those still running counted as "at least" what they
have run, shift the rows left from what the weighed length models expect (``censored_shift``).

Three things keep the drawn rows a fair sample of the rows left:
- A drawn row counts once every row drawn before it has finished (``release``): those finished after a row still
  running are the short ones of their draws. (Counted as "at least this long" in an EM fit instead, the rows
  still running made the shift diverge: +3 to +6 in the echo engine's job.)
- At each re-prediction of the pool by the online predictor (buckets/annotate.py), the drawn rows are predicted
  again with it (``snapshot``, ``repredicted``): the line relates their lengths to the predictions the rows left
  have now, not to those the predictor gave when each started.
- The strata: where the predictions fall in clusters (the echo engine's job: 2.5, 2.75, 4.0 and 4.25 in log), no
  line passes through the clusters' log ratios (-0.1, 0, 0, -0.75 there). Each stratum's mean residual about the
  line counts as far as the strata's means spread beyond what their rows' own spread explains; where they lie on
  the line (the real engine's mixed workload) they count for nothing, and a fixed weight there fitted noise.
On the echo engine's 20k-row job the three took the tokens to come at 25% of rows from x0.89-0.94 to x0.97-1.01
(docs/BENCHMARKS.md, stop 62). A drawn row also goes to vLLM's queue in its turn (scheduler.py): with its own
prediction as its priority it waited there, and held every row drawn after it uncounted.

Beside the line, the drawn rows predicted within the rows left's predictions (``among``): each was drawn from a
pool that held every row still left, so they are a random sample of those, whatever the predictions' scale. The
shift at which the length model expects what they ran weighs against the line's as far as the two differ beyond
their noise. Where the predictions are narrow (the online predictor's on GSM8K: the rows left within 0.01-0.03 in
log, running some 0.2 below the average row), no line with a prior on its slope per unit of log prediction follows
them: GSM8K's ETA at half its rows under auto went from +16-17% to +4-11% (docs/BENCHMARKS.md, stop 66), and on
the simulated engine with predictions 0.3 times as wide as they know, from +9% to +22% on average at 10-75% of rows
to within 3% (benchmarks/drawn_spread.py).

On tests/test_forecast_drawn.py's simulated engine (1,200 rows, 150 of them drawn), with predictions spread 1.8
times wider than they know, the ETA under longest-first and auto went from 33-40% short at 10-50% of rows to -13%
to +2%. Where the predictions are right (spread 1.0) it costs the drawn rows' sampling noise: -2% to +7% became
-1% to +11%; where they spread too narrowly (0.6), +32% to +45% became +8% to +19%. Pure numpy.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Optional

import numpy as np

from overnight.pipeline.scheduling.censored import mills, norm_cdf


class DrawnRows:
    BIN = 0.001  # finished drawn rows are kept by the log of their prediction, in bins this wide (a token to 1000)
    PRIOR_ROWS = 8.0  # the weight of the log ratio of every row, in rows, in the drawn rows' fit
    SLOPE_SD = 0.5  # the prior on the line's slope: Normal(0, this), per unit of log prediction
    STRATUM = 0.25  # the strata of the log prediction whose residuals about the line are kept

    KEEP = 8192  # the newest finished drawn rows whose features are kept, to be predicted again with the pool
    MAX_APART = 3.0  # the drawn rows among the rows left move them at most this far from the line, in log
    # Under shortest-first before PRIOR_ROWS count (censored_shift): the drawn rows it takes at least, the weight of
    # the log ratio of every row on their line's level (in rows), and the prior on its slope per standard deviation
    # of their log predictions
    MIN_CENSORED = 4
    CENSORED_PRIOR = 1.0
    SLOPE_SPREAD = 0.5

    def __init__(self):
        self.bins: dict[int, list[float]] = {}  # bin of log(predicted) -> [rows, sums of r, r^2, e^r, e^2r]
        self.num_rows = 0
        self.held: list = []  # (draw's number, features, predicted, actual) of finished rows not counted yet
        self.kept: deque = deque(maxlen=self.KEEP)  # (features, actual) of the drawn rows counted, newest last
        self._asked: Optional[tuple[list, list]] = None  # what a re-prediction was asked for: kept rows, the rest
        self._since: list = []  # (features, predicted, actual) of the drawn rows counted since then
        self._again: dict[int, tuple] = {}  # id(features) -> (features, new prediction): rows not counted then
        self.censored_rows = 0  # the drawn rows the last censored_shift rested on, finished or running

    def observe(self, predicted, actual, drawn, features=None) -> None:
        """Finished rows: predicted and actual output tokens, each one's draw (its number, from 1; 0 or False:
        not drawn), and their predictor features (to be predicted again: snapshot). They count once every row
        drawn before them has finished (release). A row cut at max_tokens counts at that length: the length
        models' cap holds it there too."""
        for i, (p, a, d) in enumerate(zip(predicted, actual, drawn)):
            if d and p and a and p > 0 and a > 0:
                self.held.append((int(d), features[i] if features is not None else None, p, a))

    def release(self, first_running: Optional[int] = None) -> None:
        """Count the finished rows drawn before the first drawn row still running (its draw's number; None: none
        runs). A row drawn after it that finished is a short one: counting it alone would leave the long ones of
        its draws out."""
        if first_running is None:
            ready, self.held = self.held, []
        else:
            ready = [h for h in self.held if h[0] < first_running]
            self.held = [h for h in self.held if h[0] >= first_running]
        for _, f, p, a in ready:
            if f is not None:
                p = self._again.pop(id(f), (None, p))[1]  # predicted again since it started
                self.kept.append((f, a))
            self._add(p, a)
            if self._asked is not None:
                self._since.append((f, p, a))
                if len(self._since) > self.KEEP:  # no answer is coming (the predictor stopped learning)
                    self._asked, self._since = None, []

    def _add(self, p: float, a: float) -> None:
        lp, r = math.log(p), math.log(a / p)
        self.num_rows += 1
        b = self.bins.setdefault(int(round(lp / self.BIN)), [0.0] * 5)
        e = a / p
        b[0] += 1
        b[1] += r
        b[2] += r * r
        b[3] += e
        b[4] += e * e

    def snapshot(self, running=()) -> list:
        """The features of the rows counted (kept), of those held and of the drawn rows still running
        (``running``), for the online predictor to predict again with the pool (an annotator's refresh), which
        hands the new predictions to repredicted(). The line relates the drawn rows' lengths to the predictions
        the rows left have now, not to those the predictor gave when each started."""
        rest = [f for f in running if f is not None] + [h[1] for h in self.held if h[1] is not None]
        self._asked, self._since = (list(self.kept), rest), []
        return [f for f, _ in self._asked[0]] + rest

    def repredicted(self, predicted) -> None:
        """The snapshot's rows predicted again, in the forecast's currency: the bins are the kept rows', and
        those of the rows counted since, at the new prediction where they were held or running at the snapshot;
        those still held or running take it when they count."""
        asked, since = self._asked, self._since
        self._asked, self._since = None, []
        if asked is None or len(predicted) != len(asked[0]) + len(asked[1]):
            return
        k = len(asked[0])
        self._again = {id(f): (f, float(p)) for f, p in zip(asked[1], predicted[k:]) if p > 0}
        self.bins, self.num_rows = {}, 0
        for p, (_, a) in zip(predicted[:k], asked[0]):
            if p > 0:
                self._add(float(p), a)
        for f, p, a in since:
            self._add(self._again.pop(id(f), (None, p))[1] if f is not None else p, a)

    def shift(self, mu: float, sigma: float, pend_p: np.ndarray, pend_n: np.ndarray,
              among: Optional[tuple[float, float]] = None, expected=None) -> tuple[float, float]:
        """The shift from mu (the log ratio of every row) of the log ratio of rows predicted pend_p (pend_n of
        each; their predicted tokens weigh them), and its standard error; (0, 0) before any drawn row finishes.
        The drawn rows' log ratio is a line on the log of the prediction (they span the predictions that one
        fitted on the rows run longest first would be drawn beyond), fitted by least squares with a prior of
        PRIOR_ROWS rows at mu (at their mean log prediction) and one of SLOPE_SD on the slope, and not drawn
        beyond the drawn rows' predictions (the first drawn rows may all have one prediction, the heuristic's);
        and each stratum's mean residual about the line, shrunk to it (empirical Bayes). Only the rows counted
        (release) are in it. ``among``: the predictions (lowest, highest) of the pool's rows left, where those run by
        predicted length, and ``expected``, the length model's expected tokens of rows at predictions p shifted by
        s (p, s): the drawn rows predicted within them are a sample of them, and the shift at which the model
        expects what those ran counts beside the line's (``_among``)."""
        pend_p, pend_n = np.asarray(pend_p, np.float64), np.asarray(pend_n, np.float64)
        keep = (pend_p > 0) & (pend_n > 0)
        if not keep.any() or not self.bins:
            return 0.0, 0.0
        x = np.fromiter(self.bins.keys(), np.float64, len(self.bins)) * self.BIN
        n, s1, s2, e1, e2 = np.asarray(list(self.bins.values()), np.float64).reshape(-1, 5).T
        w0 = self.PRIOR_ROWS
        xbar = float(x @ n / n.sum())
        xc = x - xbar
        a = (float(s1.sum()) + w0 * mu) / (n.sum() + w0)
        var = max((float(s2.sum()) - float(s1.sum()) ** 2 / n.sum() + w0 * sigma ** 2) / (n.sum() + w0), 1e-4)
        sxx = float(n @ xc ** 2)
        b = float(xc @ s1) / (sxx + var / self.SLOPE_SD ** 2)
        fit = a + b * xc  # the spread about the line, for its standard error
        var = max((float(s2.sum() - 2 * fit @ s1 + n @ fit ** 2) + w0 * sigma ** 2) / (n.sum() + w0), 1e-4)
        # where the predictions are not on one line, the drawn rows' strata say what it misses: each stratum's mean
        # residual about the line, shrunk to the line by how far the strata's means spread beyond what their rows'
        # spread explains (empirical Bayes: none where they lie on the line, as on the real engine's mixed workload)
        strata, inv = np.unique(np.round(x / self.STRATUM).astype(np.int64), return_inverse=True)
        rn = np.bincount(inv, n, len(strata))
        rs = np.bincount(inv, s1 - n * fit, len(strata))
        between = float(rs @ (rs / rn))  # sum over strata of rows * mean residual^2
        within = max((float((s2 - 2 * fit * s1 + n * fit ** 2).sum()) - between) / max(n.sum() - len(strata), 1.0),
                     1e-4)
        tau2 = max(0.0, (between - (len(strata) - 2) * within) / n.sum()) if len(strata) > 2 else 0.0
        k = within / tau2 if tau2 > 0 else math.inf  # a stratum's line, in rows
        off = rs / (rn + k)
        lp = np.clip(np.log(pend_p[keep]), float(x.min()), float(x.max()))  # not beyond the drawn rows
        at = np.clip(np.searchsorted(strata, np.round(lp / self.STRATUM).astype(np.int64)), 0, len(strata) - 1)
        hit = strata[at] == np.round(lp / self.STRATUM)
        px = lp - xbar
        tokens = pend_p[keep] * pend_n[keep]
        tokens = tokens / tokens.sum()
        center = float(tokens @ px)
        share = np.bincount(at[hit], tokens[hit], len(strata))  # the rows left's tokens in each stratum
        line_var = var * (1.0 / (n.sum() + w0) + center ** 2 / (sxx + var / self.SLOPE_SD ** 2))
        off_var = float(share ** 2 @ (within * rn / (rn + k) ** 2))
        value = a + b * px + np.where(hit, off[at], 0.0)
        shift, se = float(np.log(tokens @ np.exp(value - mu))), math.sqrt(line_var + off_var)
        if among is None or expected is None:
            return shift, se
        return self._among(x, n, e1, e2, among, shift, se, expected)

    def _among(self, x, n, e1, e2, among, shift, se, expected) -> tuple[float, float]:
        """The line's shift and standard error, with the shift at which the length model (``expected``) expects
        the tokens that the drawn rows predicted within ``among`` ran. Under longest predicted first the rows left
        are the pool's lowest predictions; every drawn row was drawn from a pool that held every row still left, so
        those drawn within the rows left's predictions are a random sample of them. Where the predictions are
        narrow, no line on their log is: the online predictor's on GSM8K spread the rows left over 0.01-0.03 in
        log, while those rows ran some 0.2 below the average row (docs/BENCHMARKS.md, stops 65-66). The two weigh
        as far as they differ beyond their noise (empirical Bayes: the line's bias there); with fewer than
        PRIOR_ROWS drawn rows there, the line. Matched in the model's own terms, which cut its log-normal at
        max_tokens: their mean log ratio had the mixed workload's tokens to come x0.81-0.86 (the rows left's own
        spread of log ratios left out), and their tokens over those predicted, matched to the log-normal's uncut
        mean, x0.63-0.76 (stop 66)."""
        lo, hi = (int(round(math.log(v) / self.BIN)) if v > 0 else -(2 ** 62) for v in among)
        keys = np.round(x / self.BIN)
        inside = (keys >= lo) & (keys <= hi)
        rows = n[inside]
        if float(rows.sum()) < self.PRIOR_ROWS:  # too few to say the line misses
            return shift, se
        p = np.exp(x[inside])  # a row's predicted tokens
        ran = float(p @ e1[inside])  # the tokens they ran
        if ran <= 0:
            return shift, se
        ratio = ran / float(p @ rows)
        v_among = max(float(p ** 2 @ (e2[inside] - 2 * ratio * e1[inside] + ratio ** 2 * rows)) / ran ** 2, 1e-6)
        value = _matched(lambda s: float(rows @ expected(p, s)), ran, shift)
        if value is None:
            return shift, se
        value = min(max(value, shift - self.MAX_APART), shift + self.MAX_APART)
        return _weighed(shift, se ** 2, value, v_among)

    def censored_shift(self, mu: float, sigma: float, running: tuple[np.ndarray, np.ndarray],
                       among: Optional[tuple[float, float]], cap: float, pend: tuple[np.ndarray, np.ndarray],
                       expected, model_se: float) -> tuple[float, float]:
        """Under shortest-first before PRIOR_ROWS drawn rows count, the shift of the rows left (predicted pend[0],
        pend[1] of each) from what the length model expects of them (``expected``: tokens of rows at predictions p
        shifted by s; ``model_se``: the standard error of its level), and its standard error; (0, 0) with fewer than
        MIN_CENSORED drawn rows within ``among`` (the rows left's lowest and highest predictions).

        The short rows finish long before the first drawn ones do: at a tenth of the rows few drawn rows have
        finished, and those few are the short ones of their draws. Every drawn row within the rows left's
        predictions, finished or not, is a sample of them (shift), and one still running (``running``: the drawn
        rows running, predicted p, g tokens so far) or cut at max_tokens says its length is at least what it has
        run: their log ratio is a line on the log prediction, fitted to them censored (a Tobit line, by EM, its
        spread held at the log ratio's sigma; the slope's prior is per standard deviation of their log predictions,
        which are narrow where the online predictor's are) with CENSORED_PRIOR rows at mu. The tokens that line
        expects of the rows left give the shift at which the model expects as much, which weighs against none as
        far as the two differ beyond their noise (empirical Bayes, as in _among). (Counted as "at least" in the
        line's own fit once PRIOR_ROWS count, the rows running made it diverge: release.)

        At a tenth of the rows on tests/test_forecast_drawn.py's simulated engine, over eight seeds, the ETA's mean
        error went from -32% to -4% (mean |error| 32% to 10%) with predictions 0.6 times as wide as they know, and
        from -48% to +3% at 0.15; where they know what they say (1.0), 3% to 5% in mean |error|; too wide (1.8),
        -10% to +17% (20% to 18%). On the real engine the ETA at 10% of rows under shortest-first went from -30% and
        -36% to -9% on the mixed workload, and from -21% to -15% on the open one; with the pool held to 150 rows,
        +36% on the mixed one, where 8-13 drawn rows, none finished, gave a shift of 0.4-0.9 with a standard error
        of 0.5 that this weighing took at 0.7 (docs/BENCHMARKS.md, stop 67)."""
        lo, hi = (math.log(v) if v > 0 else -math.inf for v in among) if among else (-math.inf, math.inf)
        lo, hi = lo - self.BIN / 2, hi + self.BIN / 2
        x, n, s1 = [], [], []
        cx, cc = [], []  # the log predictions and log ratios of the rows known only as "at least"
        for k, b in self.bins.items():
            if lo <= k * self.BIN <= hi:
                x.append(k * self.BIN)
                n.append(b[0])
                s1.append(b[1])
        for _, _, p, a in self.held:
            lp = math.log(p)
            if lo <= lp <= hi:
                if a >= cap:
                    cx.append(lp)
                    cc.append(math.log(cap / p))
                else:
                    x.append(lp)
                    n.append(1.0)
                    s1.append(math.log(a / p))
        rp, rg = (np.asarray(v, np.float64) for v in running)
        keep = (rp > 0) & (rg > 0)
        lrp = np.log(np.where(keep, rp, 1.0))
        keep &= (lrp >= lo) & (lrp <= hi)
        cx = np.concatenate([np.asarray(cx, np.float64), lrp[keep]])
        cc = np.concatenate([np.asarray(cc, np.float64), np.log(rg[keep] / rp[keep])])
        x, n, s1 = (np.asarray(v, np.float64) for v in (x, n, s1))
        pp, pn = (np.asarray(v, np.float64) for v in pend)
        left = (pp > 0) & (pn > 0)
        self.censored_rows = int(n.sum()) + len(cc)
        if self.censored_rows < self.MIN_CENSORED or not left.any():
            return 0.0, 0.0
        a, b, xbar, info = _tobit_line(x, n, s1, cx, cc, (mu, sigma, self.CENSORED_PRIOR), self.SLOPE_SPREAD)
        allx = np.concatenate([x, cx])  # the line is not drawn beyond the drawn rows' predictions
        m = a + b * (np.clip(np.log(pp[left]), float(allx.min()), float(allx.max())) - xbar) + np.log(pp[left])
        lc, s2 = math.log(cap), sigma * sigma  # E[min(L, cap)] of a log-normal at m, sigma
        want = float(pn[left] @ (np.exp(m + s2 / 2) * norm_cdf((lc - m - s2) / sigma)
                                 + cap * (1.0 - norm_cdf((lc - m) / sigma))))
        value = _matched(lambda s: float(pn[left] @ expected(pp[left], s)), want, 0.0)
        if value is None:
            return 0.0, 0.0
        value = min(max(value, -self.MAX_APART), self.MAX_APART)
        return _weighed(0.0, model_se ** 2, value, s2 / (info + self.CENSORED_PRIOR))


def _matched(total, want: float, start: float) -> Optional[float]:
    """The shift at which total(shift), which grows with it, is ``want`` (secant steps from ``start``); None
    where it is not finite."""
    if want <= 0:
        return None
    s0, f0 = start, total(start) - want
    s1 = start + (math.log(want / (want + f0)) if want + f0 > 0 else 0.0)
    for _ in range(8):
        f1 = total(s1) - want
        if abs(f1) <= 1e-4 * want or f1 == f0:
            break
        s0, s1, f0 = s1, s1 - f1 * (s1 - s0) / (f1 - f0), f1
    return s1 if math.isfinite(s1) else None


def _weighed(base: float, v_base: float, value: float, v_value: float) -> tuple[float, float]:
    """``value`` (variance v_value) weighed against ``base`` (v_base) as far as the two differ beyond their noise
    (empirical Bayes: the base's bias), and the result's standard error."""
    bias2 = max(0.0, (value - base) ** 2 - v_base - v_value)
    w = (v_base + bias2) / (v_base + bias2 + v_value)
    return base + w * (value - base), math.sqrt(w * w * v_value + (1 - w) ** 2 * (v_base + bias2))


def _tobit_line(x, n, s1, cx, cc, prior: tuple[float, float, float], slope_spread: float, iterations: int = 200):
    """EM fit of r = a + b (x - xbar) + Normal(0, sigma) to exact rows (bins at log prediction x: n rows, sums of
    r) and to rows known only as r > cc (at cx), with ``prior``: (mu, sigma, weight in rows) on the level, sigma
    held, and Normal(0, slope_spread / sd of x) on the slope. Returns a, b, xbar and the rows the fit rests on (the
    exact ones, and the censored ones by how much of their tail they cut). With sigma free, the few exact rows of
    the lower tail, under the many censored ones, drew it in and the level with it: x0.79 of the tokens of 60
    rows 60 steps in, x1.01 held (tests/test_forecast_drawn.py); at a tenth of the rows under shortest-first on
    the simulated engine, the mean |error| of the ETA went from 9-19% to 5-18% over four spreads."""
    mu, sigma, w0 = prior
    total = float(n.sum()) + len(cc)
    xbar = (float(x @ n) + float(cx.sum())) / total
    xc, cxc = x - xbar, cx - xbar
    sdx = math.sqrt(max((float(n @ xc ** 2) + float(cxc @ cxc)) / total, 1e-6))
    sx = float(n @ xc) + float(cxc.sum())
    sxx = float(n @ xc ** 2) + float(cxc @ cxc) + (sigma * sdx / slope_spread) ** 2  # with the slope's prior
    det = (total + w0) * sxx - sx * sx
    a, b = mu, 0.0
    for _ in range(iterations):
        fc = a + b * cxc
        e1 = fc + sigma * mills((cc - fc) / sigma)  # E[r | r > c]
        sy = float(s1.sum()) + float(e1.sum()) + w0 * mu
        sxy = float(xc @ s1) + float(cxc @ e1)
        na, nb = (sy * sxx - sx * sxy) / det, ((total + w0) * sxy - sx * sy) / det
        done = abs(na - a) < 1e-5 and abs(nb - b) < 1e-5
        a, b = na, nb
        if done:
            break
    return a, b, xbar, float(n.sum()) + float(norm_cdf((cc - a - b * cxc) / sigma).sum())
