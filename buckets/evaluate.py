"""How well a predictor matched a finished run: Kendall's tau, MAE, and how often rows landed in their bucket."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from overnight.buckets.bucketing import assign, log_bounds
from overnight.buckets.dataset import LengthData
from overnight.buckets.features import stack
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


def evaluate(data: LengthData, predictor: Optional[str] = None, rows: Optional[np.ndarray] = None,
             num_buckets: int = 8) -> Evaluation:
    """Score `predictor` (heuristic, online, a file) on the rows, or the predictions the run stored itself.

    The online predictor is replayed in the order rows finished: each row is predicted before the
    predictor learns from it, as in a run.
    """
    idx = np.arange(len(data)) if rows is None else rows
    fb = stack([data.features.rows()[i] for i in idx]) if rows is not None else data.features
    actual = data.actual[idx]
    if predictor is None:
        pred = data.stored_prediction[idx]
        keep = ~np.isnan(pred)
        pred, actual, name = pred[keep], actual[keep], "stored in the run"
        caps = fb.caps[keep]
    else:
        p = make_predictor(predictor)
        name = p.name if predictor in ("heuristic", "online") else f"trained ({predictor})"
        caps = fb.caps
        if p.learns:
            pred = np.zeros(len(idx))
            order = np.argsort(data.finished_at[idx], kind="stable")
            all_rows = fb.rows()
            for start in range(0, len(order), 32):
                chunk = order[start:start + 32]
                sub = stack([all_rows[i] for i in chunk])
                pred[chunk] = p.predict(sub).tokens
                p.observe(sub, actual[chunk], data.hit_cap[idx][chunk])
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
    )
