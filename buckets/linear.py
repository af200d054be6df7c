"""A linear model of log output length over a FeatureBatch, in numpy: ridge regression, or a pairwise
ranking loss, each with its penalties chosen by cross-validation on the training rows.

The design has three blocks: an intercept (not penalised), the dense features (the numeric ones and the
heuristic's log estimate, standardised; penalty ``lam_dense``) and the hashed text features (penalty
``lam_sparse``; ``inf`` leaves them out). Ridge is solved by conjugate gradients on the normal equations
over the hashed features the rows touch, so its cost is O(nonzeros) a step at any row count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from overnight.buckets.features import FeatureBatch


def dense(fb: FeatureBatch) -> np.ndarray:
    """The dense inputs: the numeric features and the heuristic's log estimate."""
    return np.concatenate([fb.numeric.astype(np.float64), np.log(np.maximum(fb.heuristic, 1.0))[:, None]], axis=1)


@dataclass
class Design:
    """The training rows' design, with the hashed features renumbered 0..m-1 over those the rows touch."""

    z: np.ndarray        # [n, d] standardised dense features
    row_of: np.ndarray   # [nnz] row of each hashed entry
    col: np.ndarray      # [nnz] compact column
    val: np.ndarray      # [nnz]
    touched: np.ndarray  # [m] hash index of each compact column
    n: int

    @classmethod
    def of(cls, fb: FeatureBatch, mean: np.ndarray, std: np.ndarray) -> "Design":
        touched, col = np.unique(fb.indices, return_inverse=True)
        return cls(z=(dense(fb) - mean) / std, row_of=np.repeat(np.arange(len(fb)), np.diff(fb.indptr)),
                   col=col.astype(np.int64), val=fb.values.astype(np.float64), touched=touched, n=len(fb))

    @property
    def m(self) -> int:
        return len(self.touched)

    def rows(self, keep: np.ndarray) -> "Design":
        """The design of a subset of rows (same compact columns)."""
        mask = np.zeros(self.n, bool)
        mask[keep] = True
        new_row = np.cumsum(mask) - 1
        e = mask[self.row_of]
        return Design(self.z[keep], new_row[self.row_of[e]], self.col[e], self.val[e], self.touched, int(mask.sum()))

    def matvec(self, b: float, wd: np.ndarray, ws: np.ndarray) -> np.ndarray:
        out = b + self.z @ wd
        if len(ws) and len(self.col):
            out = out + np.bincount(self.row_of, weights=ws[self.col] * self.val, minlength=self.n)
        return out

    def rmatvec(self, r: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        ws = np.bincount(self.col, weights=r[self.row_of] * self.val, minlength=self.m) if self.m else np.zeros(0)
        return float(r.sum()), self.z.T @ r, ws


def fit_ridge(d: Design, y: np.ndarray, lam_dense: float, lam_sparse: float, iters: int = 200,
              tol: float = 1e-4) -> tuple[float, np.ndarray, np.ndarray]:
    """Weights (bias, dense [d], hashed [m]) minimising |Xw - y|^2 + lam_dense |wd|^2 + lam_sparse |ws|^2.
    An infinite penalty leaves its block out (with both, the model is the intercept alone)."""
    lam_dense = lam_dense if math.isfinite(lam_dense) else 1e12
    use_sparse = math.isfinite(lam_sparse) and d.m > 0
    m = d.m if use_sparse else 0
    k = d.z.shape[1]
    lam = np.concatenate([[1e-8], np.full(k, lam_dense), np.full(m, lam_sparse)])

    def split(v):
        return v[0], v[1:1 + k], v[1 + k:]

    def A(v):
        b, wd, ws = split(v)
        r = d.matvec(b, wd, ws if use_sparse else np.zeros(0))
        gb, gd, gs = d.rmatvec(r)
        return np.concatenate([[gb], gd, gs[:m] if use_sparse else []]) + lam * v

    gb, gd, gs = d.rmatvec(y)
    rhs = np.concatenate([[gb], gd, gs if use_sparse else []])
    # Jacobi preconditioner: the diagonal of X^T X + lam.
    diag = np.concatenate([[d.n], (d.z ** 2).sum(axis=0),
                           np.bincount(d.col, weights=d.val ** 2, minlength=d.m) if use_sparse else []]) + lam
    v = np.zeros(len(rhs))
    if not rhs.any():  # y is all 0 (every length the same, on a rank target): the zero model, not 0/0
        b, wd, ws = split(v)
        return 0.0, wd, (ws if use_sparse else np.zeros(d.m))
    r = rhs - A(v)
    zr = r / diag
    p = zr.copy()
    rz = r @ zr
    norm = math.sqrt(rhs @ rhs) or 1.0
    for _ in range(iters):
        ap = A(p)
        alpha = rz / (p @ ap)
        v += alpha * p
        r -= alpha * ap
        if math.sqrt(r @ r) < tol * norm:
            break
        zr = r / diag
        rz_new = r @ zr
        p = zr + (rz_new / rz) * p
        rz = rz_new
    b, wd, ws = split(v)
    return float(b), wd, (ws if use_sparse else np.zeros(d.m))


def fit_pairwise(d: Design, y: np.ndarray, lam_dense: float, lam_sparse: float, steps: int = 200, lr: float = 0.1,
                 margin: float = 0.1, max_pairs: int = 60_000, seed: int = 0) -> tuple[float, np.ndarray, np.ndarray]:
    """RankNet on a linear score: for each pair whose log lengths differ by more than margin, the softplus of
    minus the score difference, averaged, plus the same L2 penalties (per pair, scaled by 1/n). Adam steps."""
    rng = np.random.default_rng(seed)
    n = d.n
    i, j = np.triu_indices(n, 1) if n * (n - 1) // 2 <= max_pairs else rng.integers(0, n, (2, max_pairs))
    diff = y[i] - y[j]
    keep = np.abs(diff) > margin
    hi = np.where(diff > 0, i, j)[keep]
    lo = np.where(diff > 0, j, i)[keep]
    use_sparse = math.isfinite(lam_sparse) and d.m > 0
    k = d.z.shape[1]
    wd, ws = np.zeros(k), np.zeros(d.m)
    params = [wd, ws]
    m1 = [np.zeros(k), np.zeros(d.m)]
    m2 = [np.zeros(k), np.zeros(d.m)]
    if not len(hi):
        return float(np.mean(y)), wd, ws
    for t in range(1, steps + 1):
        s = d.matvec(0.0, wd, ws if use_sparse else np.zeros(0))
        g_pair = -1.0 / (1.0 + np.exp(np.clip(s[hi] - s[lo], -30, 30)))  # d softplus(-(s_hi - s_lo)) / d s_hi
        g = (np.bincount(hi, weights=g_pair, minlength=n) - np.bincount(lo, weights=g_pair, minlength=n)) / len(hi)
        _, gd, gs = d.rmatvec(g)
        grads = [gd + lam_dense * wd / n, gs + lam_sparse * ws / n if use_sparse else np.zeros(d.m)]
        for p, gr, a, b2 in zip(params, grads, m1, m2):
            a *= 0.9
            a += 0.1 * gr
            b2 *= 0.999
            b2 += 0.001 * gr * gr
            p -= lr * (a / (1 - 0.9 ** t)) / (np.sqrt(b2 / (1 - 0.999 ** t)) + 1e-8)
    # The ranking loss leaves the scale and the offset free: map the score onto log length by least squares.
    s = d.matvec(0.0, wd, ws)
    slope = float(np.cov(s, y)[0, 1] / max(np.var(s), 1e-12)) if np.var(s) > 0 else 0.0
    return float(np.mean(y) - slope * np.mean(s)), wd * slope, ws * slope
