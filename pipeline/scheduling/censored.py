"""The standard normal's pieces that the censored length models share (lengths.py, length_shapes.py).

A row still running, or cut at max_tokens, says only "at least this long": its likelihood is a normal's upper
tail, and its expected value given that is a truncated normal's. Pure numpy.
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


def remaining_cdf(f_x, f_g, x, total, cap: float) -> np.ndarray:
    """P(remaining <= x | L > g) of the length models' quantile_cdf, from F(g + x) and F(g): 1 once g + x reaches
    max_tokens (the row stops there whatever the model says), and for a row run past the whole of its model's
    tail (1 - F(g) underflows), 1 from the next token on, as its expected remaining length says, rather than a
    CDF that never reaches 1 (the drain's tail then added up to a whole max_tokens of steps)."""
    survive = 1.0 - f_g
    cdf = np.where(survive > 1e-12, np.clip((f_x - f_g) / np.maximum(survive, 1e-300), 0.0, 1.0),
                   np.asarray(x, dtype=np.float64) >= 1.0)
    return np.where(total >= cap, 1.0, cdf)


def log_tail(z) -> np.ndarray:
    return np.log(np.clip(1.0 - norm_cdf(z), 1e-300, None))


def prior_mean(model, running_p: np.ndarray, running_g: np.ndarray, rest: tuple[float, float]) -> float:
    """The mean prediction of every row the job knows (finished, running, still to start: ``rest``, their sum and
    count), within 1..max_tokens; half max_tokens before any: where NormalLengthModel and SqrtLengthModel put their
    priors."""
    keep = (running_p > 0) & (running_g > 0)
    total_p = model.p_sum + float(running_p[keep].sum()) + float(rest[0])
    count_p = model.p_n + int(keep.sum()) + float(rest[1])
    return min(max(total_p / count_p, 1.0), model.cap) if count_p else model.cap / 2


def z_moments(alpha, beta, k: int) -> list:
    """The integrals of z^j phi(z) over (alpha, beta), j = 0..k (beta may be +inf)."""
    pa, pb = norm_pdf(alpha), np.where(np.isinf(beta), 0.0, norm_pdf(np.where(np.isinf(beta), 0.0, beta)))
    bb = np.where(np.isinf(beta), 0.0, beta)
    out = [norm_cdf(beta) - norm_cdf(alpha), pa - pb]
    for j in range(2, k + 1):
        out.append(alpha ** (j - 1) * pa - bb ** (j - 1) * pb + (j - 1) * out[j - 2])
    return out


def mills(z) -> np.ndarray:
    """phi(z) / (1 - Phi(z)), with its asymptote far in the tail."""
    z = np.asarray(z, dtype=np.float64)
    far = z > 6.0
    zz = np.where(far, z, 1.0)
    return np.where(far, zz + 1.0 / zz, norm_pdf(z) / np.clip(1.0 - norm_cdf(z), 1e-300, None))


def count_into(hist: dict, values, width: float) -> None:
    """Rows known only as "at least" a value (cut at max_tokens), kept as a histogram in bins this wide."""
    for k in np.round(np.asarray(values, dtype=np.float64) / width).astype(int).tolist():
        hist[k] = hist.get(k, 0) + 1


def censored_points(running: np.ndarray, hist: dict, width: float) -> tuple[np.ndarray, np.ndarray]:
    """The thresholds and weights of the rows known only as "at least": the rows running (each once), and the
    histogram of the rows cut (count_into)."""
    cs, ws = [np.asarray(running, dtype=np.float64)], [np.ones(len(running))]
    if hist:
        cs.append(np.fromiter(hist.keys(), np.float64) * width)
        ws.append(np.fromiter(hist.values(), np.float64))
    return np.concatenate(cs), np.concatenate(ws)


def censored_normal_fit(n: int, s1: float, s2: float, c: np.ndarray, w: np.ndarray, prior: tuple[float, float, float],
                        start: tuple[float, float], floor: float, iterations: int,
                        tol: float) -> tuple[float, float, float]:
    """EM fit of Normal(mu, sigma) to n values known exactly (their sum s1 and sum of squares s2), values known only
    to be above c (weights w), and a prior (mean, sd, weight in values). Returns mu, sigma and the values the fit
    rests on: the exact ones, and the censored ones counted by how much of their tail they cut (for a standard
    error)."""
    prior_mu, prior_sigma, w0 = prior
    total = n + float(w.sum()) + w0
    mu, sigma = start
    for _ in range(iterations):
        sigma = max(sigma, floor)
        if len(c):
            lam = mills((c - mu) / sigma)
            e1 = float(w @ (mu + sigma * lam))
            e2 = float(w @ (mu * mu + sigma * sigma + sigma * (c + mu) * lam))
        else:
            e1 = e2 = 0.0
        new_mu = (s1 + e1 + w0 * prior_mu) / total
        var = (s2 + e2 + w0 * (prior_sigma ** 2 + prior_mu ** 2)) / total - new_mu * new_mu
        new_sigma = math.sqrt(max(var, floor ** 2))
        done = abs(new_mu - mu) < tol and abs(new_sigma - sigma) < tol
        mu, sigma = new_mu, new_sigma
        if done:
            break
    return mu, sigma, n + (float(w @ norm_cdf((c - mu) / sigma)) if len(c) else 0.0)


def censored_normal_loglik(n: int, s1: float, s2: float, log_jacobian: float, c: np.ndarray, w: np.ndarray,
                           mu: float, sigma: float) -> float:
    """Log-likelihood of n exact values (sums s1, s2; log_jacobian: the sum of log |d value / d length| over them,
    so that it is a density of the length) and of the censored ones (above c, weights w) under Normal(mu, sigma)."""
    ll = (-n * math.log(sigma * math.sqrt(2 * math.pi)) + log_jacobian
          - (s2 - 2 * mu * s1 + n * mu * mu) / (2 * sigma * sigma))
    return ll + (float(w @ log_tail((c - mu) / sigma)) if len(c) else 0.0)
