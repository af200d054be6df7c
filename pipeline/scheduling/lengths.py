"""How long rows really run, against their predictions: a log-normal ratio, fitted during a run.

    LengthModel  log(actual / predicted) ~ Normal(mu, sigma), fitted on finished rows and on rows still running,
                 which count as "at least this long" (censored), so the long rows still running early in a job
                 are not missed; a row that hit max_tokens is censored at it too

Pure numpy; the deadline tracker (scheduling/deadline.py) feeds it finished rows and asks it what the rows left
will generate. The drain that uses it is in scheduling/forecast.py.
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
        self.capped: dict[int, int] = {}
        self.mu, self.sigma = 0.0, prior_sigma
        self.num_events = 0.0  # rows whose r is known exactly, for the fit's standard error

    def observe(self, predicted, actual, hit_cap) -> None:
        p = np.asarray([x or 0 for x in predicted], dtype=np.float64)
        a = np.asarray([x or 0 for x in actual], dtype=np.float64)
        keep = (p > 0) & (a > 0)
        if not keep.any():
            return
        r = np.log(a[keep] / p[keep])
        cut = (np.asarray(hit_cap, dtype=bool)[keep]) | (a[keep] >= self.cap)
        for k in np.round(r[cut] / self.BIN).astype(int).tolist():
            self.capped[k] = self.capped.get(k, 0) + 1
        free = r[~cut]
        self.n += len(free)
        self.s1 += float(free.sum())
        self.s2 += float(free @ free)

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
