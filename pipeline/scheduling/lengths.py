"""How long rows really run, against their predictions, fitted during a run.

    LengthModel        log(actual / predicted) ~ Normal(mu, sigma), fitted on finished rows and on rows still
                       running, which count as "at least this long" (censored), so the long rows still running
                       early in a job are not missed; a row that hit max_tokens is censored at it too
    NormalLengthModel  the length itself ~ Normal(m, s), censored the same way, blind to the predictions
    SqrtLengthModel    sqrt(length) ~ Normal(a + b log(predicted), s), censored the same way: the shape of what a
                       row that has run long has left, where lengths are skewed to the left in log
    LengthMixture      the forecast's: the first two, weighed by how likely each makes what the run has seen; the
                       log ratio alone where the rows run longest predicted first, and there the drain's tail of the
                       rows running from the square root where the run makes it likelier

Pure numpy; the deadline tracker (scheduling/deadline.py) feeds it finished rows, and its forecast
(scheduling/estimate.py) asks it what the rows left will generate. The drain that uses it is in scheduling/forecast.py.
"""

from __future__ import annotations

import math

import numpy as np

_SQRT2 = math.sqrt(2.0)


def norm_cdf(x):
    """The standard normal CDF, vectorised (Abramowitz and Stegun 7.1.26, error under 1.5e-7)."""
    x = np.asarray(x, dtype=np.float64)
    z = np.abs(x) / _SQRT2
    t = 1.0 / (1.0 + 0.3275911 * z)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf = 1.0 - poly * np.exp(-z * z)
    return 0.5 * (1.0 + np.sign(x) * erf)


def norm_pdf(x):
    x = np.asarray(x, dtype=np.float64)
    return np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def finished_rows(predicted, actual, hit_cap, cap: float):
    """Finished rows' predictions and lengths (rows without either left out), and whether max_tokens cut each."""
    p = np.asarray([x or 0 for x in predicted], dtype=np.float64)
    a = np.asarray([x or 0 for x in actual], dtype=np.float64)
    keep = (p > 0) & (a > 0)
    return p[keep], a[keep], np.asarray(hit_cap, dtype=bool)[keep] | (a[keep] >= cap)


# -- lengths -----------------------------------------------------------------------------------------
class LengthModel:
    """Actual output lengths against predicted ones: r = log(actual / predicted) ~ Normal(mu, sigma).

    Finished rows give r exactly; rows that hit max_tokens and rows still running give "r is at least this"
    (censored), which an EM fit of a censored normal uses. A prior (mu 0, sigma prior_sigma, worth
    prior_weight rows) holds the fit until rows finish."""

    BIN = 0.02  # censored points at the cap are kept as a histogram of r, in bins this wide

    def __init__(self, max_tokens: int, prior_sigma: float = 0.8, prior_weight: float = 3.0):
        self.cap = float(max_tokens)
        self.prior_sigma, self.prior_weight = prior_sigma, prior_weight
        self.n = 0
        self.s1 = 0.0
        self.s2 = 0.0
        self.log_a = 0.0  # sum of log(actual) of those rows, for the likelihood (the density of L, not of r)
        self.capped: dict[int, int] = {}
        self.mu, self.sigma = 0.0, prior_sigma
        self.num_events = 0.0  # rows whose r is known exactly, for the fit's standard error

    def observe(self, predicted, actual, hit_cap) -> None:
        p, a, cut = finished_rows(predicted, actual, hit_cap, self.cap)
        if not len(p):
            return
        r = np.log(a / p)
        for k in np.round(r[cut] / self.BIN).astype(int).tolist():
            self.capped[k] = self.capped.get(k, 0) + 1
        free = r[~cut]
        self.n += len(free)
        self.s1 += float(free.sum())
        self.s2 += float(free @ free)
        self.log_a += float(np.log(a[~cut]).sum())

    def fit(self, running_p: np.ndarray, running_g: np.ndarray, iterations: int = 25) -> tuple[float, float]:
        """Refit on the finished rows and the rows running now (predicted p, g tokens so far)."""
        keep = (running_p > 0) & (running_g > 0)
        thresholds = [np.log(running_g[keep] / running_p[keep])]
        weights = [np.ones(int(keep.sum()))]
        if self.capped:
            ks = np.fromiter(self.capped.keys(), np.float64)
            thresholds.append(ks * self.BIN)
            weights.append(np.fromiter(self.capped.values(), np.float64))
        c = np.concatenate(thresholds)
        w = np.concatenate(weights)
        w0 = self.prior_weight
        mu, sigma = (self.mu, self.sigma) if self.n else (0.0, self.prior_sigma)
        total = self.n + w.sum() + w0
        for _ in range(iterations):
            sigma = max(sigma, 0.05)
            if len(c):
                a = (c - mu) / sigma
                tail = np.clip(1.0 - norm_cdf(a), 1e-12, None)
                lam = norm_pdf(a) / tail
                ex = mu + sigma * lam
                ex2 = mu * mu + sigma * sigma + sigma * (c + mu) * lam
                e1, e2 = float(w @ ex), float(w @ ex2)
            else:
                e1 = e2 = 0.0
            new_mu = (self.s1 + e1 + w0 * 0.0) / total
            new_var = (self.s2 + e2 + w0 * self.prior_sigma ** 2) / total - new_mu * new_mu
            new_sigma = math.sqrt(max(new_var, 0.05 ** 2))
            done = abs(new_mu - mu) < 1e-4 and abs(new_sigma - sigma) < 1e-4
            mu, sigma = new_mu, new_sigma
            if done:
                break
        self.mu, self.sigma = mu, sigma
        # Censored rows inform the fit less than finished ones: count them by how much of their tail they cut.
        informed = float(w @ norm_cdf((c - mu) / sigma)) if len(c) else 0.0
        self.num_events = self.n + informed
        return mu, sigma

    @property
    def mu_stderr(self) -> float:
        return self.sigma / math.sqrt(self.num_events + self.prior_weight)

    def loglik(self, running_p: np.ndarray, running_g: np.ndarray) -> float:
        """Log-likelihood of the lengths seen (as densities of the length itself) and of the censored rows."""
        mu, s = self.mu, self.sigma
        ll = (-self.n * math.log(s * math.sqrt(2 * math.pi)) - self.log_a
              - (self.s2 - 2 * mu * self.s1 + self.n * mu * mu) / (2 * s * s))
        if self.capped:
            ks = np.fromiter(self.capped.keys(), np.float64) * self.BIN
            ll += float(np.fromiter(self.capped.values(), np.float64) @ _log_tail((ks - mu) / s))
        keep = (running_p > 0) & (running_g > 0)
        return ll + float(_log_tail((np.log(running_g[keep] / running_p[keep]) - mu) / s).sum())

    def expected(self, predicted, generated=None, shift: float = 0.0) -> np.ndarray:
        """Expected tokens still to come for rows with these predictions that have generated ``generated`` so far
        (0: not started): E[min(L, cap) - g | L > g]."""
        p = np.maximum(np.asarray(predicted, dtype=np.float64), 1.0)
        g = np.zeros_like(p) if generated is None else np.minimum(np.asarray(generated, dtype=np.float64),
                                                                    self.cap - 1)
        m = np.log(p) + self.mu + shift
        s = self.sigma
        lc = math.log(self.cap)
        lg = np.log(np.maximum(g, 1e-9))
        above_cap = 1.0 - norm_cdf((lc - m) / s)
        # E[min(L, cap) * 1{L > g}]
        part = np.exp(m + s * s / 2) * (norm_cdf((lc - m - s * s) / s) - norm_cdf((lg - m - s * s) / s))
        part = np.maximum(part, 0.0) + self.cap * above_cap
        survive = np.clip(1.0 - norm_cdf((lg - m) / s), 1e-12, None)
        cond = np.where(g > 0, part / survive, part)
        return np.clip(cond - g, 1.0, self.cap - g)

    def moments(self, predicted, shift: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """E[min(L, cap)] and E[min(L, cap)^2] of rows with these predictions, not started."""
        p = np.maximum(np.asarray(predicted, dtype=np.float64), 1.0)
        m = np.log(p) + self.mu + shift
        s = self.sigma
        lc = math.log(self.cap)
        above = 1.0 - norm_cdf((lc - m) / s)
        m1 = np.exp(m + s * s / 2) * norm_cdf((lc - m - s * s) / s) + self.cap * above
        m2 = np.exp(2 * m + 2 * s * s) * norm_cdf((lc - m - 2 * s * s) / s) + self.cap ** 2 * above
        return m1, m2

    def quantile_cdf(self, x, predicted, generated, shift: float = 0.0) -> np.ndarray:
        """P(remaining <= x) for rows (predicted, generated) at remaining lengths x (broadcast)."""
        p = np.maximum(np.asarray(predicted, dtype=np.float64), 1.0)
        g = np.asarray(generated, dtype=np.float64)
        m = np.log(p) + self.mu + shift
        s = self.sigma
        f_g = np.where(g > 0, norm_cdf((np.log(np.maximum(g, 1e-9)) - m) / s), 0.0)
        total = g + np.maximum(x, 0.0)
        f_x = np.where(total >= self.cap, 1.0, norm_cdf((np.log(np.maximum(total, 1e-9)) - m) / s))
        return np.clip((f_x - f_g) / np.clip(1.0 - f_g, 1e-12, None), 0.0, 1.0)


def _log_tail(z) -> np.ndarray:
    return np.log(np.clip(1.0 - norm_cdf(z), 1e-300, None))


def _prior_mean(model, running_p: np.ndarray, running_g: np.ndarray, rest: tuple[float, float]) -> float:
    """The mean prediction of every row the job knows (finished, running, still to start: ``rest``, their sum and
    count), within 1..max_tokens; half max_tokens before any: where NormalLengthModel and SqrtLengthModel put their
    priors."""
    keep = (running_p > 0) & (running_g > 0)
    total_p = model.p_sum + float(running_p[keep].sum()) + float(rest[0])
    count_p = model.p_n + int(keep.sum()) + float(rest[1])
    return min(max(total_p / count_p, 1.0), model.cap) if count_p else model.cap / 2


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
        self.n_cap = 0  # rows that hit it
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
        self.n_cap += int(cut.sum())
        self.p_sum += float(p.sum())
        self.p_n += len(p)

    def fit(self, running_p: np.ndarray, running_g: np.ndarray, iterations: int = 50,
            rest: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
        """Refit on the finished rows and the rows running now (predicted p, g tokens so far); rest: the sum and
        the count of the predictions of the rows still to start, for the prior."""
        self.p_mean = _prior_mean(self, running_p, running_g, rest)
        m0, s0 = self.p_mean, self.prior_cv * self.p_mean
        keep = (running_p > 0) & (running_g > 0)
        c, w = running_g[keep], np.ones(int(keep.sum()))
        if self.n_cap:
            c, w = np.append(c, self.cap), np.append(w, float(self.n_cap))
        w0 = self.prior_weight
        total = self.n + float(w.sum()) + w0
        m, s = (self.m, self.s) if self._fitted else (m0, s0)
        for _ in range(iterations):
            s = max(s, 1.0)
            if len(c):
                z = (c - m) / s
                lam = _mills(z)
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
        if self.n_cap:
            ll += self.n_cap * float(_log_tail((self.cap - m) / s))
        keep = (running_p > 0) & (running_g > 0)
        return ll + float(_log_tail((running_g[keep] - m) / s).sum())

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
        return np.clip((f_x - f_g) / np.clip(1.0 - f_g, 1e-12, None), 0.0, 1.0)


def _z_moments(alpha, beta, k: int) -> list:
    """The integrals of z^j phi(z) over (alpha, beta), j = 0..k (beta may be +inf)."""
    pa, pb = norm_pdf(alpha), np.where(np.isinf(beta), 0.0, norm_pdf(np.where(np.isinf(beta), 0.0, beta)))
    bb = np.where(np.isinf(beta), 0.0, beta)
    out = [norm_cdf(beta) - norm_cdf(alpha), pa - pb]
    for j in range(2, k + 1):
        out.append(alpha ** (j - 1) * pa - bb ** (j - 1) * pb + (j - 1) * out[j - 2])
    return out


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

    BIN = 0.02  # rows cut at max_tokens are kept as a histogram of (log(predicted), tokens they ran)

    def __init__(self, max_tokens: int, prior_cv: float = 0.8, prior_weight: float = 3.0, slope_weight: float = 3.0):
        self.cap = float(max_tokens)
        self.prior_cv, self.prior_weight, self.slope_weight = prior_cv, prior_weight, slope_weight
        # rows finished below the cap: count, and the sums of x = log(predicted), x^2, y = sqrt(length), xy, y^2, log 2y
        self.n, self.sx, self.sxx, self.sy, self.sxy, self.syy, self.slog = 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
        self.capped: dict[tuple[int, int], int] = {}  # (log(predicted) / BIN, tokens) -> rows
        self.p_sum, self.p_n = 0.0, 0
        self.p_mean = self.cap / 2
        self.x0 = math.log(self.p_mean)
        self.a, self.b, self.s = math.sqrt(self.p_mean), 0.0, 0.4 * math.sqrt(self.p_mean)
        self.num_events = 0.0
        self._fitted = False

    def observe(self, predicted, actual, hit_cap) -> None:
        p, a, cut = finished_rows(predicted, actual, hit_cap, self.cap)
        x = np.log(p)
        # a row cut short ran at least as long as it did: max_tokens, or less where its own limit or the context's
        # cut it (and a row of n samples gives their mean)
        for key in zip(np.round(x[cut] / self.BIN).astype(int).tolist(),
                       np.round(np.minimum(a[cut], self.cap)).astype(int).tolist()):
            self.capped[key] = self.capped.get(key, 0) + 1
        x, y = x[~cut], np.sqrt(a[~cut])
        self.n += len(y)
        self.sx += float(x.sum())
        self.sxx += float(x @ x)
        self.sy += float(y.sum())
        self.sxy += float(x @ y)
        self.syy += float(y @ y)
        self.slog += float(np.log(2 * y).sum())
        self.p_sum += float(p.sum())
        self.p_n += len(p)

    def _censored(self, running_p, running_g):
        """x (centred at x0), thresholds in sqrt(length) and weights of the rows known only as "at least"."""
        keep = (running_p > 0) & (running_g > 0)
        xs = [np.log(running_p[keep])]
        ts = [np.sqrt(running_g[keep])]
        ws = [np.ones(int(keep.sum()))]
        if self.capped:
            keys = np.array(list(self.capped.keys()), np.float64)
            xs.append(keys[:, 0] * self.BIN)
            ts.append(np.sqrt(keys[:, 1]))
            ws.append(np.fromiter(self.capped.values(), np.float64))
        return np.concatenate(xs) - self.x0, np.concatenate(ts), np.concatenate(ws)

    def fit(self, running_p: np.ndarray, running_g: np.ndarray, iterations: int = 50,
            rest: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
        """Refit on the finished rows and the rows running now (predicted p, g tokens so far); rest: the sum and
        the count of the predictions of the rows still to start, for the prior."""
        self.p_mean = _prior_mean(self, running_p, running_g, rest)
        new_x0 = math.log(self.p_mean)
        if self._fitted:  # the same line about the new centre
            self.a += self.b * (new_x0 - self.x0)
        self.x0 = new_x0
        # the prior's rows: E[L] = p_mean, sd(L) = prior_cv * p_mean
        u = self.p_mean * (1.0 - math.sqrt(max(1.0 - self.prior_cv ** 2 / 2, 0.0)))
        y0, v0 = math.sqrt(self.p_mean - u), u
        xc, tc, wc = self._censored(running_p, running_g)
        n, x0, w0 = self.n, self.x0, self.prior_weight
        sx = self.sx - n * x0
        sxx = self.sxx - 2 * x0 * self.sx + n * x0 * x0
        sxy = self.sxy - x0 * self.sy
        total = n + float(wc.sum()) + w0
        a, b, s = (self.a, self.b, self.s) if self._fitted else (y0, 0.0, math.sqrt(v0))
        for _ in range(iterations):
            s = max(s, 0.05)
            if len(tc):
                m = a + b * xc
                lam = _mills((tc - m) / s)
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
            new_s = math.sqrt(max(var, 0.05 ** 2))
            done = abs(new_a - a) < 1e-4 and abs(new_b - b) < 1e-4 and abs(new_s - s) < 1e-4
            a, b, s = new_a, new_b, new_s
            if done:
                break
        self.a, self.b, self.s, self._fitted = a, b, s, True
        self.num_events = n + (float(wc @ norm_cdf((tc - (a + b * xc)) / s)) if len(tc) else 0.0)
        return self.mu, self.sigma

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
            ll += float(wc @ _log_tail((tc - (a + b * xc)) / s))
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
        x = np.log(np.maximum(np.asarray(predicted, dtype=np.float64), 1.0)) - self.x0
        k = math.exp(shift / 2)
        m = (self.a + self.b * x) * k
        return m, np.full(m.shape, self.s * k)

    def _between(self, m, s, lo, hi, power: int):
        """E[L^power; lo < L < hi] (L = y^2, y ~ N(m, s); lo >= 1, so y > 0 there), as sums of z moments."""
        alpha = (np.sqrt(lo) - m) / s
        beta = (np.sqrt(hi) - m) / s
        z = _z_moments(alpha, beta, 2 * power)
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
        return np.clip((f_x - f_g) / np.clip(1.0 - f_g, 1e-12, None), 0.0, 1.0)


def _mills(z) -> np.ndarray:
    """phi(z) / (1 - Phi(z)), with its asymptote far in the tail."""
    z = np.asarray(z, dtype=np.float64)
    far = z > 6.0
    zz = np.where(far, z, 1.0)
    return np.where(far, zz + 1.0 / zz, norm_pdf(z) / np.clip(1.0 - norm_cdf(z), 1e-300, None))


class LengthMixture:
    """The log ratio and the normal fitted on the same rows, weighed by how likely each makes what the run has seen
    (finished lengths, and rows still running or cut at max_tokens as "at least"): the posterior of two models
    of two parameters each, equal a priori. The forecast's expected lengths, moments and tail are the mixture (but
    for the tail of the rows running under longest predicted first, below);
    its summaries (mu, sigma, their standard error) the weightier model's. Early on, when the evidence is thin,
    the two are averaged rather than flipped between: from the first step, not only once a few rows have finished,
    because the first rows to finish are few under any order and the log ratio alone errs with the order. Under
    shortest predicted first, auto's near a deadline, the rows running are the ones predicted shortest, and their
    lengths, which the predictions barely tell apart, make the log ratio's scale high for every row to come (x0.80-1.45,
    mostly high, of the tokens to come at 1-3 finished rows in benchmarks/length_early.py's emulation of 8 runs;
    x0.81-1.05 weighed).

    Where the rows run longest predicted first (``left_shortest``), LengthModel alone. The rows left are then the
    ones predicted shortest, and the rows seen cannot say what the normal, blind to the predictions, would need to
    know: that those run shorter. It takes the mean of the rows seen for them, and the likelihood of the rows seen
    cannot tell it wrong. Replayed on 10 full runs (docs/BENCHMARKS.md), the weighing said x1.13-1.31 at 10-50% of
    rows under longest-first and auto on the mixed workload, the log ratio x0.89-1.03.

    Under that order the end of the drain is the rows running, and the log ratio's one spread, widened by the few
    very short answers, expects a row that has run long to run on 15-39% longer than such rows do (hindsight over
    six full runs, benchmarks/length_shape.py): the drain's tail came out 15-34% long from 58% of rows on
    (benchmarks/drain_steps.py). There the tail's CDF of the rows running (``quantile_cdf`` where generated > 0)
    comes from SqrtLengthModel when the run makes it likelier than the log ratio by more than a nat (its third
    parameter's price). The drain's steps still come from the log ratio's expected lengths, so its end is then the
    larger of those steps and the expected latest end under the square root. The token sums, and the tail of the rows
    not started, stay the log ratio's: replayed on five longest-first and auto runs, the square root weighed in for
    them made the tokens to come x0.84-1.30 at 25-50% of rows, the log ratio x0.83-1.08 (benchmarks/length_replay.py
    --variants, "ratio or sqrt"). Where lengths are log-normal around their predictions (tests/test_forecast.py's
    fake clock) the likelihood keeps the log ratio for the tail too, once 5% of the rows are done."""

    def __init__(self, max_tokens: int):
        self.ratio, self.normal = LengthModel(max_tokens), NormalLengthModel(max_tokens)
        self.sqrt = SqrtLengthModel(max_tokens)
        self.weight = 0.0  # the normal model's
        self.best = self.ratio
        self.tail = None  # the model whose quantile_cdf the drain's tail uses for the rows running, if not the mixture

    def observe(self, predicted, actual, hit_cap) -> None:
        self.ratio.observe(predicted, actual, hit_cap)
        self.normal.observe(predicted, actual, hit_cap)
        self.sqrt.observe(predicted, actual, hit_cap)

    def fit(self, running_p: np.ndarray, running_g: np.ndarray, left_shortest: bool = False,
            rest: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
        """Refit on the finished rows and the rows running (predicted p, g tokens so far) and weigh the log ratio and
        the normal, or (left_shortest) choose the tail's model; rest: the sum and the count of the predictions of the
        rows still to start (the priors of the normal and the square root)."""
        running_p, running_g = np.asarray(running_p, np.float64), np.asarray(running_g, np.float64)
        self.ratio.fit(running_p, running_g)
        self.weight = 0.0
        if not left_shortest:
            self.normal.fit(running_p, running_g, rest=rest)
            diff = self.normal.loglik(running_p, running_g) - self.ratio.loglik(running_p, running_g)
            self.weight = 1.0 / (1.0 + math.exp(-min(max(diff, -50.0), 50.0)))
        self.best = self.normal if self.weight > 0.5 else self.ratio
        self.tail = None
        if left_shortest:
            self.sqrt.fit(running_p, running_g, rest=rest)
            gain = self.sqrt.loglik(running_p, running_g) - 1.0 - self.ratio.loglik(running_p, running_g)
            self.tail = self.sqrt if gain > 0 else None
        return self.best.mu, self.best.sigma

    def _mix(self, call):
        """call(model) of the weightier model alone, or of both, weighed (each part of a tuple)."""
        w = self.weight
        if w <= 0.0 or w >= 1.0:
            return call(self.normal if w >= 1.0 else self.ratio)
        a, b = call(self.ratio), call(self.normal)
        if isinstance(a, tuple):
            return tuple((1.0 - w) * x + w * y for x, y in zip(a, b))
        return (1.0 - w) * a + w * b

    def expected(self, predicted, generated=None, shift: float = 0.0) -> np.ndarray:
        return self._mix(lambda m: m.expected(predicted, generated, shift))

    def moments(self, predicted, shift: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        return self._mix(lambda m: m.moments(predicted, shift))

    def quantile_cdf(self, x, predicted, generated, shift: float = 0.0) -> np.ndarray:
        mixed = self._mix(lambda m: m.quantile_cdf(x, predicted, generated, shift))
        if self.tail is None:
            return mixed
        return np.where(np.asarray(generated) > 0, self.tail.quantile_cdf(x, predicted, generated, shift), mixed)

    def __getattr__(self, name):  # cap, mu, sigma, mu_stderr, num_events
        if "best" not in self.__dict__:  # (copying, unpickling)
            raise AttributeError(name)
        return getattr(self.__dict__["best"], name)
