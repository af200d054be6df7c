"""Two more shapes of how long rows run, fitted as LengthModel (lengths.py) is, with its interface.

    NormalLengthModel  the length itself ~ Normal(m, s), censored the same way, blind to the predictions
    SqrtLengthModel    sqrt(length) ~ Normal(a + b log(predicted), s), censored the same way: the shape of what a
                       row that has run long has left, where lengths are skewed to the left in log

LengthMixture (lengths.py) weighs both with the log ratio in every order but longest predicted first, and there
takes the drain's tail from the second where the run makes it likelier. SqrtRatioModel (sqrt_ratio.py), the square
root's shape scaled by each row's prediction, builds on the second. Pure numpy.
"""

from __future__ import annotations

import math

import numpy as np

from overnight.pipeline.scheduling.censored import (finished_rows, log_tail, mills, norm_cdf, norm_pdf, prior_mean,
                                                   remaining_cdf,
                                                   z_moments)


class NormalLengthModel:
    """Actual output lengths L ~ Normal(m, s), whatever their predictions; the same interface as LengthModel.

    Where predictions barely tell lengths apart, as the embedded model's do (docs/BENCHMARKS.md), scaling each
    row's length by its prediction over-counts: rows predicted long run about as long as the others, and log
    lengths are skewed to the left (a few answers of a handful of tokens widen a log-normal's fit, and with it
    the tail it gives the rows still running). Finished rows give L, rows that hit max_tokens and rows still
    running give "L is at least this" (an EM fit of a censored normal). A prior of prior_weight rows at the
    mean prediction (sd prior_cv of it) holds the fit until rows finish: the mean over every row the job knows,
    those still to start included (``rest``), so that it does not depend on the order the rows run in. (Of the
    rows seen alone, under shortest predicted first, it was the shortest predictions' mean, and the emulation of
    benchmarks/length_early.py said x0.53-0.69 of the tokens to come at 1-3 rows.) ``mu`` and ``sigma`` are the
    log-normal ones of the same mean and spread (against the mean prediction), so that they mean what
    LengthModel's do; ``shift`` scales lengths by exp(shift)."""

    def __init__(self, max_tokens: int, prior_cv: float = 0.8, prior_weight: float = 3.0):
        self.cap = float(max_tokens)
        self.prior_cv, self.prior_weight = prior_cv, prior_weight
        self.n, self.s1, self.s2 = 0, 0.0, 0.0  # rows finished below the cap: count, sum and sum of squares of L
        self.cut_at: dict[int, int] = {}  # rows cut short (at max_tokens, or their own lower limit), by length
        self.p_sum, self.p_n = 0.0, 0  # predictions of the finished rows, for the prior
        self.m, self.s = self.cap / 2, self.prior_cv * self.cap / 2
        self.p_mean = self.cap / 2
        self.num_events = 0.0
        self._fitted = False

    def observe(self, predicted, actual, hit_cap) -> None:
        p, a, cut = finished_rows(predicted, actual, hit_cap, self.cap)
        free = a[~cut]
        self.n += len(free)
        self.s1 += float(free.sum())
        self.s2 += float(free @ free)
        for length in np.minimum(a[cut], self.cap).astype(int).tolist():  # cut at max_tokens, or a row's own limit
            self.cut_at[length] = self.cut_at.get(length, 0) + 1
        self.p_sum += float(p.sum())
        self.p_n += len(p)

    def fit(self, running_p: np.ndarray, running_g: np.ndarray, iterations: int = 50,
            rest: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
        """Refit on the finished rows and the rows running now (predicted p, g tokens so far); rest: the sum and
        the count of the predictions of the rows still to start, for the prior."""
        self.p_mean = prior_mean(self, running_p, running_g, rest)
        m0, s0 = self.p_mean, self.prior_cv * self.p_mean
        keep = (running_p > 0) & (running_g > 0)
        c, w = running_g[keep], np.ones(int(keep.sum()))
        if self.cut_at:
            c = np.append(c, np.fromiter(self.cut_at.keys(), np.float64))
            w = np.append(w, np.fromiter(self.cut_at.values(), np.float64))
        w0 = self.prior_weight
        total = self.n + float(w.sum()) + w0
        m, s = (self.m, self.s) if self._fitted else (m0, s0)
        for _ in range(iterations):
            s = max(s, 1.0)
            if len(c):
                z = (c - m) / s
                lam = mills(z)
                e1 = float(w @ (m + s * lam))
                e2 = float(w @ (m * m + s * s + s * (c + m) * lam))
            else:
                e1 = e2 = 0.0
            new_m = (self.s1 + e1 + w0 * m0) / total
            new_s = math.sqrt(max((self.s2 + e2 + w0 * (s0 * s0 + m0 * m0)) / total - new_m * new_m, 1.0))
            done = abs(new_m - m) < 1e-2 and abs(new_s - s) < 1e-2
            m, s = new_m, new_s
            if done:
                break
        self.m, self.s, self._fitted = m, s, True
        self.num_events = self.n + (float(w @ norm_cdf((c - m) / s)) if len(c) else 0.0)
        return self.mu, self.sigma

    def loglik(self, running_p: np.ndarray, running_g: np.ndarray) -> float:
        m, s = self.m, self.s
        ll = -self.n * math.log(s * math.sqrt(2 * math.pi)) - (self.s2 - 2 * m * self.s1 + self.n * m * m) / (2 * s * s)
        if self.cut_at:
            at = np.fromiter(self.cut_at.keys(), np.float64)
            ll += float(np.fromiter(self.cut_at.values(), np.float64) @ log_tail((at - m) / s))
        keep = (running_p > 0) & (running_g > 0)
        return ll + float(log_tail((running_g[keep] - m) / s).sum())

    @property
    def sigma(self) -> float:
        return math.sqrt(math.log1p((self.s / max(self.m, 1.0)) ** 2))

    @property
    def mu(self) -> float:
        return math.log(max(self.m, 1.0) / self.p_mean) - self.sigma ** 2 / 2

    @property
    def mu_stderr(self) -> float:
        return (self.s / max(self.m, 1.0)) / math.sqrt(self.num_events + self.prior_weight)

    def _params(self, predicted, shift: float):
        p = np.asarray(predicted, dtype=np.float64)
        k = math.exp(shift)
        return np.full(p.shape, self.m * k), np.full(p.shape, self.s * k)

    def expected(self, predicted, generated=None, shift: float = 0.0) -> np.ndarray:
        """E[min(L, cap) - g | L > g] (g = 0: not started, and then L is at least 1)."""
        mm, ss = self._params(predicted, shift)
        g = np.zeros_like(mm) if generated is None else np.minimum(np.asarray(generated, dtype=np.float64),
                                                                     self.cap - 1)
        lo = np.maximum(g, 1.0)
        za, zb = (lo - mm) / ss, (self.cap - mm) / ss
        fa, fb = norm_cdf(za), norm_cdf(zb)
        body = np.maximum(mm * (fb - fa) + ss * (norm_pdf(za) - norm_pdf(zb)), 0.0) + self.cap * (1.0 - fb)
        surv = 1.0 - fa
        cond = np.where(surv > 1e-12, body / np.maximum(surv, 1e-300), lo)  # past the whole tail: about g
        return np.clip(np.where(g > 0, cond, fa + body) - g, 1.0, self.cap - g)

    def moments(self, predicted, shift: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """E[min(L, cap)] and E[min(L, cap)^2] of rows not started (L at least 1)."""
        mm, ss = self._params(predicted, shift)
        za, zb = (1.0 - mm) / ss, (self.cap - mm) / ss
        fa, fb = norm_cdf(za), norm_cdf(zb)
        pa, pb = norm_pdf(za), norm_pdf(zb)
        d = fb - fa
        m1 = fa + mm * d + ss * (pa - pb) + self.cap * (1.0 - fb)
        m2 = (fa + mm * mm * d + 2 * mm * ss * (pa - pb) + ss * ss * (d + za * pa - zb * pb)
              + self.cap ** 2 * (1.0 - fb))
        return m1, np.maximum(m2, m1 * m1)

    def quantile_cdf(self, x, predicted, generated, shift: float = 0.0) -> np.ndarray:
        """P(remaining <= x) for rows (predicted, generated) at remaining lengths x (broadcast)."""
        mm, ss = self._params(predicted, shift)
        g = np.asarray(generated, dtype=np.float64)
        f_g = np.where(g > 0, norm_cdf((g - mm) / ss), 0.0)
        total = g + np.maximum(x, 0.0)
        f_x = np.where(total >= self.cap, 1.0, norm_cdf((total - mm) / ss))
        return remaining_cdf(f_x, f_g, x, total, self.cap)


class SqrtLengthModel:
    """The square root of the length ~ Normal(a + b log(predicted), s), censored the same way; the same interface
    as LengthModel.

    Between the two shapes above: the embedded model's lengths are skewed to the left in log (a few very short
    answers) and the log ratio's one spread gives that width to the right tail as well, so it expects a row that has
    run long to run on 15-39% longer than such rows do; the normal on the length errs as far the other way (-6 to
    -27%). In hindsight over six full runs (benchmarks/length_shape.py) the likelihood of a power of the length
    peaks between the 1/4 and the 3/4 power (at 1/2 on four), and the square root's tail is within -10% to +14%
    there. The prediction enters as a slope the run fits (0 for predictions that do not rank, as the normal
    assumes; about sqrt(p) / 2 where lengths follow them, as the log ratio assumes; 0.9-2.2 on the six runs). A
    prior of prior_weight rows at the mean prediction of every row the job knows (as NormalLengthModel's), and a
    weak one on the slope at 0 (``slope_weight``, in rows a factor e apart in prediction), hold the fit until rows
    finish. ``mu`` and ``sigma`` are the log-normal ones of
    the same mean and spread at the mean prediction; ``shift`` scales lengths by exp(shift)."""

    BIN, Y_BIN = 0.02, 1e-3  # rows cut at max_tokens are kept as a histogram of (log(predicted), y) in bins this wide
    S_FLOOR, TOL = 0.05, 1e-4  # the fit's floor on s, and when its EM stops

    def __init__(self, max_tokens: int, prior_cv: float = 0.8, prior_weight: float = 3.0, slope_weight: float = 3.0):
        self.cap = float(max_tokens)
        self.prior_cv, self.prior_weight, self.slope_weight = prior_cv, prior_weight, slope_weight
        # rows finished below the cap: count, and the sums of x = log(predicted), x^2, y (_y), xy, y^2, log |dL/dy|
        self.n, self.sx, self.sxx, self.sy, self.sxy, self.syy, self.slog = 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
        self.capped: dict[tuple[int, int], int] = {}  # (log(predicted) / BIN, y / Y_BIN) -> rows
        self.p_sum, self.p_n = 0.0, 0
        self.p_mean = self.cap / 2
        self.x0 = math.log(self.p_mean)
        self.a, self.b, self.s = math.sqrt(self.p_mean), 0.0, 0.4 * math.sqrt(self.p_mean)
        self.num_events = 0.0
        self._fitted = False

    def _y(self, p, a):
        """What the normal is on, of each row's length a (predicted p); the sqrt ratio (sqrt_ratio.py) puts it on
        sqrt(a / p) instead."""
        return np.sqrt(a)

    def _log_jacobian(self, p, a):
        """log |d length / d y| of each row: what makes the likelihood a density of the length."""
        return np.log(2 * np.sqrt(a))

    def _prior(self) -> tuple[float, float]:
        """The prior's rows' mean and variance of y: E[L] = p_mean, sd(L) = prior_cv * p_mean."""
        u = self.p_mean * (1.0 - math.sqrt(max(1.0 - self.prior_cv ** 2 / 2, 0.0)))
        return math.sqrt(self.p_mean - u), u

    def _scale(self, p):
        """What y's mean and spread are multiplied by for a row predicted p to be sqrt(length)'s."""
        return np.ones_like(p)

    def observe(self, predicted, actual, hit_cap) -> None:
        p, a, cut = finished_rows(predicted, actual, hit_cap, self.cap)
        x = np.log(p)
        # a row cut short ran at least as long as it did: max_tokens, or less where its own limit or the context's
        # cut it (and a row of n samples gives their mean)
        a_cut = np.minimum(a[cut], self.cap)
        for key in zip(np.round(x[cut] / self.BIN).astype(int).tolist(),
                       np.round(self._y(p[cut], a_cut) / self.Y_BIN).astype(int).tolist()):
            self.capped[key] = self.capped.get(key, 0) + 1
        x, y = x[~cut], self._y(p[~cut], a[~cut])
        self.n += len(y)
        self.sx += float(x.sum())
        self.sxx += float(x @ x)
        self.sy += float(y.sum())
        self.sxy += float(x @ y)
        self.syy += float(y @ y)
        self.slog += float(self._log_jacobian(p[~cut], a[~cut]).sum())
        self.p_sum += float(p.sum())
        self.p_n += len(p)

    def _censored(self, running_p, running_g):
        """x (centred at x0), thresholds in sqrt(length) and weights of the rows known only as "at least"."""
        keep = (running_p > 0) & (running_g > 0)
        xs = [np.log(running_p[keep])]
        ts = [self._y(running_p[keep], running_g[keep])]
        ws = [np.ones(int(keep.sum()))]
        if self.capped:
            keys = np.array(list(self.capped.keys()), np.float64)
            xs.append(keys[:, 0] * self.BIN)
            ts.append(keys[:, 1] * self.Y_BIN)
            ws.append(np.fromiter(self.capped.values(), np.float64))
        return np.concatenate(xs) - self.x0, np.concatenate(ts), np.concatenate(ws)

    def fit(self, running_p: np.ndarray, running_g: np.ndarray, iterations: int = 50,
            rest: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
        """Refit on the finished rows and the rows running now (predicted p, g tokens so far); rest: the sum and
        the count of the predictions of the rows still to start, for the prior."""
        self.p_mean = prior_mean(self, running_p, running_g, rest)
        new_x0 = math.log(self.p_mean)
        if self._fitted:  # the same line about the new centre
            self.a += self.b * (new_x0 - self.x0)
        self.x0 = new_x0
        y0, v0 = self._prior()
        xc, tc, wc = self._censored(running_p, running_g)
        n, x0, w0 = self.n, self.x0, self.prior_weight
        sx = self.sx - n * x0
        sxx = self.sxx - 2 * x0 * self.sx + n * x0 * x0
        sxy = self.sxy - x0 * self.sy
        total = n + float(wc.sum()) + w0
        a, b, s = (self.a, self.b, self.s) if self._fitted else (y0, 0.0, math.sqrt(v0))
        for _ in range(iterations):
            s = max(s, self.S_FLOOR)
            if len(tc):
                m = a + b * xc
                lam = mills((tc - m) / s)
                ey = m + s * lam
                ey2 = m * m + s * s + s * (tc + m) * lam
                c_x, c_xx, c_y, c_xy, c_yy = (float(wc @ xc), float(wc @ (xc * xc)), float(wc @ ey),
                                              float(wc @ (xc * ey)), float(wc @ ey2))
            else:
                c_x = c_xx = c_y = c_xy = c_yy = 0.0
            SX, SXX = sx + c_x, sxx + c_xx
            SY, SXY = self.sy + c_y + w0 * y0, sxy + c_xy
            SYY = self.syy + c_yy + w0 * (y0 * y0 + v0)
            det = total * (SXX + self.slope_weight) - SX * SX
            new_a = (SY * (SXX + self.slope_weight) - SX * SXY) / det
            new_b = (total * SXY - SX * SY) / det
            var = (SYY - 2 * new_a * SY - 2 * new_b * SXY + new_a * new_a * total + 2 * new_a * new_b * SX
                   + new_b * new_b * SXX) / total
            new_s = math.sqrt(max(self._variance(var, total), self.S_FLOOR ** 2))
            done = abs(new_a - a) < self.TOL and abs(new_b - b) < self.TOL and abs(new_s - s) < self.TOL
            a, b, s = new_a, new_b, new_s
            if done:
                break
        self.a, self.b, self.s, self._fitted = a, b, s, True
        self.num_events = n + (float(wc @ norm_cdf((tc - (a + b * xc)) / s)) if len(tc) else 0.0)
        return self.mu, self.sigma

    def _variance(self, var: float, total: float) -> float:
        """The EM step's variance of y from its fitted one over ``total`` rows (prior's included): as it is. A
        variant with a prior of its own on the spread (benchmarks/forecast_variants.py, tried) pulls it here."""
        return var

    def loglik(self, running_p: np.ndarray, running_g: np.ndarray) -> float:
        """Log-likelihood of the lengths seen (densities of the length itself) and of the censored rows."""
        a, b, s, x0, n = self.a, self.b, self.s, self.x0, self.n
        sx = self.sx - n * x0
        sxx = self.sxx - 2 * x0 * self.sx + n * x0 * x0
        sxy = self.sxy - x0 * self.sy
        sse = self.syy - 2 * a * self.sy - 2 * b * sxy + a * a * n + 2 * a * b * sx + b * b * sxx
        ll = -n * math.log(s * math.sqrt(2 * math.pi)) - self.slog - sse / (2 * s * s)
        xc, tc, wc = self._censored(running_p, running_g)
        if len(tc):
            ll += float(wc @ log_tail((tc - (a + b * xc)) / s))
        return ll

    @property
    def _at_mean(self) -> tuple[float, float]:
        m1, m2 = self.moments(np.array([self.p_mean]))
        return float(m1[0]), float(math.sqrt(max(m2[0] - m1[0] ** 2, 0.0)))

    @property
    def sigma(self) -> float:
        mean, sd = self._at_mean
        return math.sqrt(math.log1p((sd / max(mean, 1.0)) ** 2))

    @property
    def mu(self) -> float:
        return math.log(max(self._at_mean[0], 1.0) / self.p_mean) - self.sigma ** 2 / 2

    @property
    def mu_stderr(self) -> float:
        mean, sd = self._at_mean
        return (sd / max(mean, 1.0)) / math.sqrt(self.num_events + self.prior_weight)

    def _params(self, predicted, shift: float):
        """Mean and spread of sqrt(length) per row (shift scales lengths, so their roots by exp(shift / 2))."""
        p = np.maximum(np.asarray(predicted, dtype=np.float64), 1.0)
        k = self._scale(p) * math.exp(shift / 2)
        return (self.a + self.b * (np.log(p) - self.x0)) * k, self.s * k

    def _between(self, m, s, lo, hi, power: int):
        """E[L^power; lo < L < hi] (L = y^2, y ~ N(m, s); lo >= 1, so y > 0 there), as sums of z moments."""
        alpha = (np.sqrt(lo) - m) / s
        beta = (np.sqrt(hi) - m) / s
        z = z_moments(alpha, beta, 2 * power)
        k = 2 * power
        return sum(math.comb(k, j) * m ** (k - j) * s ** j * z[j] for j in range(k + 1))

    def expected(self, predicted, generated=None, shift: float = 0.0) -> np.ndarray:
        """E[min(L, cap) - g | L > g] (g = 0: not started, and then L is at least 1)."""
        m, s = self._params(predicted, shift)
        g = np.zeros_like(m) if generated is None else np.minimum(np.asarray(generated, dtype=np.float64),
                                                                    self.cap - 1)
        lo = np.maximum(g, 1.0)
        f_lo = norm_cdf((np.sqrt(lo) - m) / s)
        f_cap = norm_cdf((math.sqrt(self.cap) - m) / s)
        body = np.maximum(self._between(m, s, lo, self.cap, 1), 0.0) + self.cap * (1.0 - f_cap)
        surv = 1.0 - f_lo
        cond = np.where(surv > 1e-12, body / np.maximum(surv, 1e-300), lo)
        return np.clip(np.where(g > 0, cond, f_lo + body) - g, 1.0, self.cap - g)

    def moments(self, predicted, shift: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """E[min(L, cap)] and E[min(L, cap)^2] of rows not started (L at least 1)."""
        m, s = self._params(predicted, shift)
        one = np.ones_like(m)
        f_lo = norm_cdf((1.0 - m) / s)
        above = 1.0 - norm_cdf((math.sqrt(self.cap) - m) / s)
        m1 = f_lo + np.maximum(self._between(m, s, one, self.cap * one, 1), 0.0) + self.cap * above
        m2 = f_lo + np.maximum(self._between(m, s, one, self.cap * one, 2), 0.0) + self.cap ** 2 * above
        return m1, np.maximum(m2, m1 * m1)

    def quantile_cdf(self, x, predicted, generated, shift: float = 0.0) -> np.ndarray:
        """P(remaining <= x) for rows (predicted, generated) at remaining lengths x (broadcast)."""
        m, s = self._params(predicted, shift)
        g = np.asarray(generated, dtype=np.float64)
        f_g = np.where(g > 0, norm_cdf((np.sqrt(np.maximum(g, 0.0)) - m) / s), 0.0)
        total = g + np.maximum(x, 0.0)
        f_x = np.where(total >= self.cap, 1.0, norm_cdf((np.sqrt(np.maximum(total, 0.0)) - m) / s))
        return remaining_cdf(f_x, f_g, x, total, self.cap)

