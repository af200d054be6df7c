"""Bucket boundaries from predicted lengths: log-spaced or quantiles.

A bucket is the index i such that bounds[i-1] < tokens <= bounds[i]; the last
bucket is open-ended. Buckets label each row in the output and in `overnight
plan`; the scheduler orders rows by their predicted length directly.
"""

from __future__ import annotations

from typing import Optional

import numpy as np


def log_bounds(max_tokens: int, num_buckets: int = 8, min_tokens: int = 16) -> np.ndarray:
    """Upper bounds spaced evenly in log space from min_tokens to max_tokens."""
    num_buckets = max(1, num_buckets)
    hi = max(max_tokens, min_tokens + 1)
    return np.unique(np.round(np.geomspace(min_tokens, hi, num_buckets)).astype(np.int64))


def quantile_bounds(predicted, num_buckets: int = 8) -> np.ndarray:
    """Upper bounds at the quantiles of the predicted lengths (equal row counts per bucket)."""
    p = np.asarray(predicted, dtype=np.float64)
    if len(p) == 0:
        return np.array([1], dtype=np.int64)
    qs = np.quantile(p, np.linspace(0, 1, num_buckets + 1)[1:])
    return np.unique(np.ceil(qs).astype(np.int64))


def make_bounds(kind: str, max_tokens: int, num_buckets: int, sample: Optional[np.ndarray] = None) -> np.ndarray:
    if kind == "quantile" and sample is not None and len(sample):
        return quantile_bounds(sample, num_buckets)
    return log_bounds(max_tokens, num_buckets)


def assign(tokens, bounds: np.ndarray) -> np.ndarray:
    """Bucket index of each length: the first bound at or above it (the last bucket takes the rest)."""
    idx = np.searchsorted(bounds, np.asarray(tokens, dtype=np.float64), side="left")
    return np.minimum(idx, len(bounds) - 1).astype(np.int16)


def describe(bounds: np.ndarray) -> list[str]:
    labels, lo = [], 0
    for i, hi in enumerate(bounds):
        labels.append(f"{lo + 1}-{hi}" if i < len(bounds) - 1 else f">{lo}" if i else f"1-{hi}")
        lo = int(hi)
    return labels
