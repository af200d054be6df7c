"""How well a predictor matched a finished run: Kendall's tau, MAE, and how often rows landed in their bucket."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from overnight.buckets.annotate import LEARN_BATCH
from overnight.buckets.bucketing import assign, log_bounds
from overnight.buckets.dataset import LengthData
from overnight.buckets.features import FeatureBatch, stack, subset
from overnight.buckets.metrics import bucket_hit_rate, kendall_tau, mae
from overnight.buckets.predictors import make_predictor


@dataclass
class Evaluation:
    predictor: str
    num_rows: int
    kendall_tau: float
    mae: float
    bucket_hit_rate: float
    mean_actual: float
    mean_predicted: float
    note: Optional[str] = None  # why a predictor file's token model was not used, where it was not

    @property
    def calibration(self) -> float:
        """Mean predicted over mean actual tokens: 1.0 is right on average."""
        return self.mean_predicted / self.mean_actual if self.mean_actual else float("nan")


def evaluate(data: LengthData, predictor: Optional[str] = None, rows: Optional[np.ndarray] = None,
             num_buckets: int = 8) -> Evaluation:
    """Score `predictor` (heuristic, online, a file) on the rows, or the predictions the run stored itself.

    The online predictor is replayed in the order rows finished: each row is predicted before the
    predictor learns from it, as in a run.
    """
    idx = np.arange(len(data)) if rows is None else rows
    fb = stack([data.features.rows()[i] for i in idx]) if rows is not None else data.features
    actual = data.actual[idx]
    note = None
    if predictor is None:
        pred = data.stored_prediction[idx]
        keep = ~np.isnan(pred)
        pred, actual, name = pred[keep], actual[keep], "stored in the run"
        caps = fb.caps[keep]
    else:
        p = make_predictor(predictor)
        if getattr(p, "tokens", None) is not None:
            note = _bind(p, data.models)
        name = p.name if predictor in ("heuristic", "online") else f"{p.name} ({predictor})"
        caps = fb.caps
        if p.learns:
            pred = replay(p, fb, actual, data.hit_cap[idx], np.argsort(data.finished_at[idx], kind="stable"))
        else:
            pred = p.predict(fb).tokens
    bounds = log_bounds(int(caps.max()) if len(caps) else 512, num_buckets)
    return Evaluation(
        predictor=name,
        num_rows=len(actual),
        kendall_tau=kendall_tau(pred, actual),
        mae=mae(pred, actual),
        bucket_hit_rate=bucket_hit_rate(assign(pred, bounds), assign(actual, bounds)),
        mean_actual=float(np.mean(actual)) if len(actual) else float("nan"),
        mean_predicted=float(np.mean(pred)) if len(pred) else float("nan"),
        note=note,
    )


def _bind(p, models: list[str]) -> Optional[str]:
    """Bind a trained predictor's token model to the tokenizer of the model the runs served; why not, if not."""
    from overnight.buckets.tokens import model_folder
    from overnight.pipeline.tools.models import load_tokenizer, resolve

    if len(models) != 1:
        return (f"the runs served {len(models)} models ({', '.join(models)})" if models else
                "the runs do not say which model served them") + ": the word model predicts alone"
    try:
        tokenizer = load_tokenizer(resolve(model_folder(models[0])))  # local files only: no hub download
    except Exception as e:
        return f"the tokenizer of {models[0]} cannot be loaded here ({e}): the word model predicts alone"
    return p.bind(tokenizer)


def replay(p, fb: FeatureBatch, actual: np.ndarray, hit_cap: np.ndarray, order: np.ndarray, chunk: int = 16) -> np.ndarray:
    """A learning predictor's predictions as a run would make them: rows in `order` (finish order), each chunk
    predicted with what was learned from the rows before it, learning in the annotator's batches."""
    pred = np.zeros(len(order))
    pending: list[np.ndarray] = []
    for start in range(0, len(order), chunk):
        rows = order[start:start + chunk]
        pred[rows] = p.predict(subset(fb, rows)).tokens
        pending.append(rows)
        waiting = np.concatenate(pending)
        if len(waiting) >= LEARN_BATCH:
            p.observe(subset(fb, waiting), actual[waiting], hit_cap[waiting])
            pending = []
    return pred
