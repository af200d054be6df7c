"""Output-length predictors behind one interface.

    p = make_predictor("online")            # or "heuristic", or a file from `overnight predictor train`
    pred = p.predict(features)              # Prediction(tokens, score): tokens in [1, cap]; score ranks
    p.observe(features, actual, hit_cap)    # finished rows; only the online predictor learns from them

* heuristic: rules over the prompt text (instruction verbs, explicit lengths, math questions). No history.
* online:    the heuristic, corrected by the trained predictor's model refitted during the run on the rows
             already finished; later rows get better predictions.
* trained:   a regularised linear model fitted on earlier runs' outputs (buckets/trained.py), as FILE; it
             does not learn during the run (OnlinePredictor(prior=...) would start from it and learn, as
             measured in docs/BENCHMARKS.md, but --predictor FILE does not use it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from overnight.buckets.features import FeatureBatch


@dataclass
class Prediction:
    tokens: np.ndarray  # float [n]: predicted output tokens, within [1, cap]
    score: np.ndarray   # float [n]: larger means longer; for ranking

    def __len__(self) -> int:
        return len(self.tokens)


class Predictor:
    name = "base"
    learns = False
    # its predictions' mean is fitted to actual lengths (a trained file, or the online model warm-started from
    # one): the forecast then takes their scale at its word under longest-first (LengthMixture)
    calibrated = False

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

# The online predictor's penalties (lam_dense as a share of the rows, lam_sparse), from the prior plus a constant
# (the level, first) to the full model; it takes the most penalised within one standard error of the best.
ONLINE_GRID = [(math.inf, math.inf), (30.0, math.inf), (3.0, math.inf), (3.0, 10.0), (0.3, 10.0), (0.3, 1.0),
               (0.03, 0.1)]


class OnlinePredictor(Predictor):
    """The trained predictor's model (trained.py), refitted during the run on the rows finished so far, as a
    correction to a prior: the heuristic, or a trained predictor (a warm start: OnlinePredictor(prior=
    TrainedPredictor.load(path)) learns on from the file).

    Until min_rows have finished, the prior's predictions stand. The first rows to finish are the short ones
    (a long row admitted with them is still running), so what they teach is biased short; with 64 rows in
    flight, 256 finished ones are mostly past that. Then observe() refits the ridge model on the finished rows
    (at most `window` of them, a uniform sample once there are more; past twice the window, only when the rows
    seen have grown by half since the last fit), with the prior's log estimate as an offset: the penalties
    shrink the correction towards none, and the intercept (not penalised) sets the level. The penalties are
    the most penalised of ONLINE_GRID within one standard error of the best out-of-fold squared error, chosen
    again whenever the rows learned from have doubled; the calibration is refitted on the out-of-fold
    predictions each time, as in training. (This replaced an AdaGrad model whose first steps moved every
    weight by the learning rate: its mean prediction swung between 5x and 0.14x the actual in its first
    batches on synthetic data.)"""

    name = "online"
    learns = True

    def __init__(self, prior: Optional[Predictor] = None, min_rows: int = 256, window: int = 1024, seed: int = 0):
        self.prior = prior
        if prior is not None:
            self.name = f"{prior.name}+online"
        self.calibrated = prior is not None and prior.calibrated
        self.min_rows = min_rows
        self.window = window
        self.num_observed = 0
        self.model = None  # a TrainedPredictor over the rows seen, once there are min_rows
        self._rows: list = []       # RowFeatures of the rows kept to learn from
        self._actual: list[float] = []
        self._penalties: Optional[tuple[float, float]] = None
        self._selected_at = 0
        self._fitted_at = 0
        self._rng = np.random.default_rng(seed)

    def _prior_log(self, fb: FeatureBatch) -> np.ndarray:
        """The prior's log estimate. A trained prior's is its calibrated log length before its mean factor."""
        if self.prior is None:
            return np.log(np.maximum(fb.heuristic.astype(np.float64), 1.0))
        p = self.prior.predict(fb)
        return p.score if hasattr(self.prior, "calib") else np.log(np.maximum(p.tokens, 1.0))

    def predict(self, fb: FeatureBatch) -> Prediction:
        if len(fb) == 0:
            return Prediction(np.zeros(0), np.zeros(0))
        if self.model is None:
            return self.prior.predict(fb) if self.prior is not None else HeuristicPredictor().predict(fb)
        return self.model.predict(fb, offset=self._prior_log(fb))

    def observe(self, fb: FeatureBatch, actual: np.ndarray, hit_cap: np.ndarray) -> None:
        """Keep the finished rows (a uniform sample of at most `window`) and refit on them."""
        seen = self.num_observed
        for row, y in zip(fb.rows(), np.asarray(actual, dtype=np.float64)):
            seen += 1
            if len(self._rows) < self.window:
                self._rows.append(row)
                self._actual.append(float(y))
            else:  # reservoir sampling: every row seen so far is kept with the same chance
                k = int(self._rng.integers(seen))
                if k < self.window:
                    self._rows[k], self._actual[k] = row, float(y)
        try:
            self._refit(seen)
        finally:
            self.num_observed = seen  # last: the annotator's learner thread is read from the loop

    def _refit(self, seen: int) -> None:
        from overnight.buckets.features import stack
        from overnight.buckets.trained import TrainedPredictor

        if seen < self.min_rows:
            return
        if seen > 2 * self.window and seen < 1.5 * self._fitted_at:
            return  # past twice the window, refit only as the rows seen grow by half: the sample changes little
        self._fitted_at = seen
        data = stack(self._rows)
        select = self._penalties is None or (seen >= 2 * self._selected_at
                                             and len(self._rows) > self._selected_at)
        lam = (None, None) if select else self._penalties
        self.model, report = TrainedPredictor.fit(data, np.asarray(self._actual), folds=4, offset=self._prior_log(data),
                                                  lam_dense=lam[0], lam_sparse=lam[1], select="mse", target="log",
                                                  grid=ONLINE_GRID)
        if select:
            self._penalties = (report.config["lam_dense"], report.config["lam_sparse"])
            self._selected_at = len(self._rows)


def make_predictor(spec: str) -> Predictor:
    """'heuristic', 'online', or the path of a file written by `overnight predictor train`."""
    if spec == "heuristic":
        return HeuristicPredictor()
    if spec == "online":
        return OnlinePredictor()
    from overnight.buckets.trained import TrainedPredictor

    return TrainedPredictor.load(spec)
