"""How well predicted lengths match actual ones: Kendall's tau, MAE, bucket hit rate."""

from __future__ import annotations

import numpy as np


def kendall_tau(pred, actual, max_n: int = 6000, seed: int = 0) -> float:
    """Kendall's tau-b between two sequences (a seeded sample of max_n rows above that size)."""
    x = np.asarray(pred, dtype=np.float64)
    y = np.asarray(actual, dtype=np.float64)
    n = len(x)
    if n < 2:
        return float("nan")
    if n > max_n:
        keep = np.random.default_rng(seed).choice(n, size=max_n, replace=False)
        x, y, n = x[keep], y[keep], max_n
    concordant = discordant = ties_x = ties_y = 0.0
    for start in range(0, n, 1024):  # blocks of rows against all later rows: O(n^2) but vectorized
        xi, yi = x[start:start + 1024, None], y[start:start + 1024, None]
        dx = np.sign(xi - x[None, :])
        dy = np.sign(yi - y[None, :])
        upper = np.arange(start, min(start + 1024, n))[:, None] < np.arange(n)[None, :]
        prod = (dx * dy)[upper]
        concordant += (prod > 0).sum()
        discordant += (prod < 0).sum()
        ties_x += ((dx == 0) & (dy != 0))[upper].sum()
        ties_y += ((dy == 0) & (dx != 0))[upper].sum()
    denom = np.sqrt((concordant + discordant + ties_x) * (concordant + discordant + ties_y))
    return float((concordant - discordant) / denom) if denom > 0 else float("nan")


def mae(pred, actual) -> float:
    return float(np.mean(np.abs(np.asarray(pred, dtype=np.float64) - np.asarray(actual, dtype=np.float64))))


def bucket_hit_rate(pred_buckets, actual_buckets) -> float:
    p, a = np.asarray(pred_buckets), np.asarray(actual_buckets)
    return float(np.mean(p == a)) if len(p) else float("nan")
