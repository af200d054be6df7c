"""Give rows their predicted output length and bucket; let the predictor learn from finished rows."""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from overnight.buckets.bucketing import assign, make_bounds
from overnight.buckets.features import featurize, stack
from overnight.buckets.predictors import Predictor


class LengthAnnotator:
    def __init__(self, predictor: Predictor, max_tokens: int, bucket_kind: str = "log", num_buckets: int = 8,
                 refresh_every: int = 64):
        self.predictor = predictor
        self.max_tokens = max_tokens
        self.bucket_kind = bucket_kind
        self.num_buckets = num_buckets
        self.bounds: Optional[np.ndarray] = None
        self.refresh_every = refresh_every
        self._observed_since_refresh = 0
        # Finished rows wait here and are learned from in batches: one step per row would cost more than it teaches.
        self._pending: list = []
        self._pending_actual: list[int] = []
        self._pending_capped: list[bool] = []
        self.learn_batch = 256
        # Time spent predicting and learning, for the scheduler-cost benchmark: annotating new rows (done in the
        # input thread, overlapping the engine) and learning / refreshing (done in the engine loop).
        self.seconds = 0.0
        self.loop_seconds = 0.0

    def annotate(self, rows: list, texts: list[str]) -> None:
        """Set each row's features, predicted_tokens and bucket."""
        if not rows:
            return
        t0 = time.perf_counter()
        fb = featurize(texts, [r.num_prompt_tokens for r in rows], [r.max_tokens for r in rows])
        pred = self.predictor.predict(fb)
        if self.bounds is None:
            self.bounds = make_bounds(self.bucket_kind, self.max_tokens, self.num_buckets, pred.tokens)
        buckets = assign(pred.tokens, self.bounds)
        for row, f, tokens, b in zip(rows, fb.rows(), pred.tokens, buckets):
            row.features = f
            row.predicted_tokens = int(round(tokens))
            row.bucket = int(b)
        self.seconds += time.perf_counter() - t0

    def observe(self, rows: list, actual: list[int], finish_reasons: list) -> None:
        """Finished rows: the online predictor learns from their actual lengths."""
        if not self.predictor.learns or not rows:
            return
        self._pending.extend(r.features for r in rows)
        self._pending_actual.extend(actual)
        self._pending_capped.extend(fr == "length" for fr in finish_reasons)
        if len(self._pending) >= self.learn_batch:
            self._learn()

    def _learn(self) -> None:
        t0 = time.perf_counter()
        fb = stack(self._pending)
        self.predictor.observe(fb, np.asarray(self._pending_actual, dtype=np.float64), np.asarray(self._pending_capped))
        self._observed_since_refresh += len(self._pending)
        self._pending, self._pending_actual, self._pending_capped = [], [], []
        self.loop_seconds += time.perf_counter() - t0

    def wants_refresh(self) -> bool:
        """After the first refresh_every rows, then whenever what it learned from has doubled:
        the model changes most early on, and each refresh re-predicts the whole pool."""
        seen = self.predictor.num_observed if self.predictor.learns else 0
        return self.predictor.learns and self._observed_since_refresh >= max(self.refresh_every, seen // 2)

    def refresh(self, rows: list) -> None:
        """Re-predict waiting rows with what the predictor has learned since."""
        self._observed_since_refresh = 0
        if not rows:
            return
        t0 = time.perf_counter()
        fb = stack([r.features for r in rows])
        pred = self.predictor.predict(fb)
        buckets = assign(pred.tokens, self.bounds)
        for row, tokens, b in zip(rows, pred.tokens, buckets):
            row.predicted_tokens = int(round(tokens))
            row.bucket = int(b)
        self.loop_seconds += time.perf_counter() - t0
