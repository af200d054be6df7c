"""Output-length predictors behind one interface.

    p = make_predictor("online")            # or "heuristic", or a file from `overnight predictor train`
    pred = p.predict(features)              # Prediction(tokens, score): tokens in [1, cap]; score ranks
    p.observe(features, actual, hit_cap)    # finished rows; only the online predictor learns from them

* heuristic: rules over the prompt text (instruction verbs, explicit lengths, math questions). No history.
* online:    the heuristic, corrected by a linear model over hashed text features that learns, during the
             run, from the rows already finished (AdaGrad on log length); later rows get better predictions.
* trained:   a small torch model fitted on earlier runs' outputs (buckets/trained.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from overnight.buckets.features import HASH_DIM, NUMERIC_NAMES, FeatureBatch


@dataclass
class Prediction:
    tokens: np.ndarray  # float [n]: predicted output tokens, within [1, cap]
    score: np.ndarray   # float [n]: larger means longer; for ranking

    def __len__(self) -> int:
        return len(self.tokens)


class Predictor:
    name = "base"
    learns = False

    def predict(self, fb: FeatureBatch) -> Prediction:
        raise NotImplementedError

    def observe(self, fb: FeatureBatch, actual: np.ndarray, hit_cap: np.ndarray) -> None:
        """Learn from finished rows (actual output tokens; hit_cap: the row stopped at its max_tokens)."""


def _clip(tokens: np.ndarray, caps: np.ndarray) -> Prediction:
    t = np.clip(tokens, 1.0, np.maximum(caps, 1).astype(np.float64))
    return Prediction(tokens=t, score=np.log(t))


class HeuristicPredictor(Predictor):
    """Rules over the prompt text (buckets/heuristic.py), computed once per row when it is featurized."""

    name = "heuristic"

    def predict(self, fb: FeatureBatch) -> Prediction:
        return _clip(fb.heuristic.astype(np.float64), fb.caps)


# -- online ------------------------------------------------------------------------------------

class OnlinePredictor(Predictor):
    """log(tokens) = log(heuristic) + w . x, with w learned by AdaGrad from finished rows."""

    name = "online"
    learns = True

    def __init__(self, lr: float = 0.3, l2: float = 1e-5, warmup: int = 16):
        self.lr = lr
        self.l2 = l2
        self.warmup = warmup
        self.w = np.zeros(HASH_DIM, dtype=np.float64)
        self.g2 = np.full(HASH_DIM, 1e-6)
        n_num = len(NUMERIC_NAMES) + 1  # + bias
        self.wn = np.zeros(n_num)
        self.gn2 = np.full(n_num, 1e-6)
        self.num_observed = 0

    def _numeric(self, fb: FeatureBatch) -> np.ndarray:
        # Scaled to comparable ranges, plus a bias column.
        x = fb.numeric.astype(np.float64) / np.array([6, 7, 6, 2, 0.2, 10, 5, 6])
        return np.hstack([x, np.ones((len(fb), 1))])

    def _correction(self, fb: FeatureBatch) -> np.ndarray:
        sparse = np.add.reduceat(self.w[fb.indices] * fb.values, fb.indptr[:-1]) if len(fb.indices) else 0.0
        counts = np.diff(fb.indptr)
        sparse = np.where(counts > 0, sparse, 0.0)
        return sparse + self._numeric(fb) @ self.wn

    def predict(self, fb: FeatureBatch) -> Prediction:
        base = np.log(np.maximum(fb.heuristic.astype(np.float64), 1.0))
        if self.num_observed < self.warmup:
            return _clip(np.exp(base), fb.caps)
        return _clip(np.exp(base + self._correction(fb)), fb.caps)

    def observe(self, fb: FeatureBatch, actual: np.ndarray, hit_cap: np.ndarray) -> None:
        """One AdaGrad step on the batch's squared error in log length (rows at their cap only push up)."""
        if len(fb) == 0:
            return
        base = np.log(np.maximum(fb.heuristic.astype(np.float64), 1.0))
        xn = self._numeric(fb)
        err = base + self._correction(fb) - np.log(np.maximum(actual, 1.0))
        err = np.where(hit_cap & (err > 0), 0.0, err)  # at the cap the true length is at least the cap
        row_of = np.repeat(np.arange(len(fb)), np.diff(fb.indptr))
        touched, where = np.unique(fb.indices, return_inverse=True)
        g_t = np.bincount(where, weights=err[row_of] * fb.values, minlength=len(touched)) + self.l2 * self.w[touched]
        self.g2[touched] += g_t * g_t
        self.w[touched] -= self.lr * g_t / np.sqrt(self.g2[touched])
        gn = xn.T @ err + self.l2 * self.wn
        self.gn2 += gn * gn
        self.wn -= self.lr * gn / np.sqrt(self.gn2)
        self.num_observed += len(fb)


def make_predictor(spec: str) -> Predictor:
    """'heuristic', 'online', or the path of a file written by `overnight predictor train`."""
    if spec == "heuristic":
        return HeuristicPredictor()
    if spec == "online":
        return OnlinePredictor()
    from overnight.buckets.trained import TrainedPredictor

    return TrainedPredictor.load(spec)
