"""Give rows their predicted output length and bucket; let the predictor learn from finished rows.

Three threads touch it in a run. The input thread annotates new rows. The
engine loop hands finished rows to observe() and asks for the waiting pool to
be re-predicted; with ``background=True`` both cost it only a hand-off: a
learner thread does the learning and the re-predicting while the loop waits
on the engine's step, and the loop applies the new predictions when they are
ready (scheduler.repredict). Without it, everything happens in the caller's
thread, in order (tests, `overnight plan`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Optional

import numpy as np

from overnight.buckets.bucketing import assign, make_bounds
from overnight.buckets.features import featurize, stack
from overnight.buckets.predictors import Predictor

log = logging.getLogger("overnight")

# How often the learner thread looks for finished rows to learn from.
LEARN_POLL_S = 0.25
# Re-predict the waiting rows with what the online predictor learned, at most this often.
REFRESH_S = 5.0
# Finished rows are handed to the predictor in batches of this many: one step per row would cost more than
# it teaches.
LEARN_BATCH = 256
_UNBOUND = object()  # (no tokenizer bound yet)


class LengthAnnotator:
    def __init__(self, predictor: Predictor, max_tokens: int, bucket_kind: str = "log", num_buckets: int = 8,
                 refresh_every: int = 64, background: bool = False):
        self.predictor = predictor
        self.max_tokens = max_tokens
        self.bucket_kind = bucket_kind
        self.num_buckets = num_buckets
        self.bounds: Optional[np.ndarray] = None
        self.refresh_every = refresh_every
        self._observed_since_refresh = 0
        # Finished rows wait here and are learned from in batches of LEARN_BATCH.
        self._inbox: collections.deque = collections.deque()
        self._learner_failed = False  # the learner thread died: nothing more is collected for it
        self._pending: list = []
        self._pending_actual: list[int] = []
        self._pending_capped: list[bool] = []
        self.learn_batch = LEARN_BATCH
        # A re-prediction asked for (entries, more features) and its answer (entries, tokens, buckets, the more
        # features' predicted tokens), handed between threads.
        self._refresh_request: Optional[tuple] = None
        self._refresh_result: Optional[tuple] = None
        self._last_refresh = -1e18
        # Time spent predicting and learning, for the scheduler-cost benchmark: annotating new rows (input
        # thread), learning and re-predicting (learner thread, or the engine loop without one).
        self.seconds = 0.0
        self.loop_seconds = 0.0
        self.background_seconds = 0.0
        self._wake = threading.Event()
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        # Started with the first finished row, so an annotator that never learns costs no thread.
        self._background = background and predictor.learns
        self._bound: object = _UNBOUND  # the tokenizer bound

    # -- the input thread ----------------------------------------------------------------------
    def bind(self, tokenizer) -> None:
        """The job's tokenizer, for a predictor that reads token ids (a trained file with a token model). Once per
        tokenizer (plan's second pass over the input binds it again)."""
        if self._bound is tokenizer:
            return
        bind = getattr(self.predictor, "bind", None)
        why_not = bind(tokenizer) if bind is not None else None
        self._bound = tokenizer
        if why_not:
            log.warning(f"predictor: {why_not}")

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

    def predict_again(self, rows: list) -> None:
        """Predict these annotated rows again with what the predictor knows now (their buckets by the same bounds)."""
        if not rows:
            return
        pred = self.predictor.predict(stack([r.features for r in rows]))
        for row, tokens, b in zip(rows, pred.tokens, assign(pred.tokens, self.bounds)):
            row.predicted_tokens = int(round(tokens))
            row.bucket = int(b)

    # -- the engine loop -----------------------------------------------------------------------
    def observe(self, rows: list, actual: list[int], finish_reasons: list) -> None:
        """Finished rows: the online predictor learns from their actual lengths."""
        if not self.predictor.learns or not rows or self._learner_failed:
            return
        self._inbox.append(([r.features for r in rows], actual, [fr == "length" for fr in finish_reasons]))
        if self._thread is None and self._background and not self._closed:
            self._thread = threading.Thread(target=self._work, name="overnight-learner", daemon=True)
            self._thread.start()
        if self._thread is None:
            t0 = time.perf_counter()
            self._learn_inbox()
            self.loop_seconds += time.perf_counter() - t0
        # else the learner thread takes it within LEARN_POLL_S

    def rows_to_learn(self) -> Optional[int]:
        """The rows of this run that must finish before the online predictor first learns from this job (its
        prior's predictions stand until then): a batch of learn_batch, and its min_rows with the rows it learned
        from at a resume's warm start. None once it has learned, or for a predictor that never learns."""
        p = self.predictor
        if not p.learns or self._learner_failed or getattr(p, "model", None) is not None:
            return None
        return max(self.learn_batch, getattr(p, "min_rows", 0) - getattr(p, "num_observed", 0))

    def wants_refresh(self) -> bool:
        """After the first refresh_every rows, then whenever what it learned from has doubled:
        the model changes most early on, and each refresh re-predicts the whole pool."""
        if (not self.predictor.learns or self._learner_failed or self._refresh_request is not None
                or self._refresh_result is not None):
            return False
        return self._observed_since_refresh >= max(self.refresh_every, self.predictor.num_observed // 2)

    def request_refresh(self, entries: list, more: Optional[list] = None) -> None:
        """Re-predict the waiting rows (scheduler entries) with what the predictor has learned since, and the rows
        of features ``more`` (the forecast's drawn rows); take_refresh() hands the answer back."""
        self._observed_since_refresh = 0
        if not entries:
            return
        self._refresh_request = (entries, more or [])
        if self._thread is None:
            t0 = time.perf_counter()
            self._repredict()
            self.loop_seconds += time.perf_counter() - t0
        else:
            self._wake.set()

    def refresh(self, scheduler, now: float, drawn=None) -> None:
        """From the engine loop: ask for a re-prediction of the scheduler's pool when one is due (at most every
        REFRESH_S), and apply a finished one. The loop only snapshots the pool and applies the answer; the
        work happens in the learner thread. The finished rows drawn at random (scheduling/drawn.DrawnRows) are
        predicted again with the pool, in the forecast's currency (Scheduler.forecast_scale) once it is applied."""
        if now - self._last_refresh >= REFRESH_S and self.wants_refresh():
            self._last_refresh = now
            entries = scheduler.pending_entries()
            more = None
            if drawn is not None and entries:
                more = drawn.snapshot([r.features for r in scheduler.running.values() if r.drawn])
            self.request_refresh(entries, more)
        done = self.take_refresh()
        if done is not None:
            scheduler.repredict(*done[:3])
            if drawn is not None:
                drawn.repredicted(np.asarray(done[3], dtype=np.float64) * scheduler.forecast_scale)

    def take_refresh(self) -> Optional[tuple]:
        """(entries, tokens, buckets, the more features' predicted tokens) once a requested re-prediction is done;
        else None."""
        out, self._refresh_result = self._refresh_result, None
        return out

    def close(self) -> None:
        self._closed = True
        if self._thread is not None:
            self._wake.set()
            self._thread.join(timeout=5)

    # -- the learner thread (or the caller's, without one) --------------------------------------
    def _work(self) -> None:
        while not self._closed:
            self._wake.wait(LEARN_POLL_S)
            self._wake.clear()
            t0 = time.perf_counter()
            try:
                self._learn_inbox()
                if self._refresh_request is not None:
                    self._repredict()
            except Exception:  # learning is an aid: the job goes on with the predictions it has
                log.exception("the length predictor's learner thread failed; predictions stop improving")
                self._learner_failed = True
                self._inbox.clear()
                return
            self.background_seconds += time.perf_counter() - t0

    def _learn_inbox(self) -> None:
        while self._inbox:
            features, actual, capped = self._inbox.popleft()
            self._pending.extend(features)
            self._pending_actual.extend(actual)
            self._pending_capped.extend(capped)
        if len(self._pending) < self.learn_batch:
            return
        fb = stack(self._pending)
        self.predictor.observe(fb, np.asarray(self._pending_actual, dtype=np.float64), np.asarray(self._pending_capped))
        self._observed_since_refresh += len(self._pending)
        self._pending, self._pending_actual, self._pending_capped = [], [], []

    def _repredict(self) -> None:
        entries, more = self._refresh_request
        pred = self.predictor.predict(stack([e.row.features for e in entries] + more)).tokens
        k = len(entries)
        tokens = np.rint(pred[:k]).astype(np.int64).tolist()
        buckets = assign(pred[:k], self.bounds).tolist()
        self._refresh_result = (entries, tokens, buckets, pred[k:])
        self._refresh_request = None
