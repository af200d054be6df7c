"""The trained predictor of format 2 (before the linear model in trained.py): a small torch model.

Kept so that files written by earlier versions still load, and so that the
length-prediction benchmark can show it beside its successor. It overfits:
on 120 rows it reached a training tau of 0.86 and 0.20 on held-out rows. The model is an EmbeddingBag over the hashed text
features plus the numeric ones, into a small MLP that outputs log(length).
Its loss is a regression on log length (rows that hit max_tokens only push
up) plus a pairwise ranking term (RankNet) over all pairs in a minibatch, in
the spirit of learning-to-rank: the scheduler needs the order most.

Files are written with torch.save and read with ``weights_only=True``: no
pickled code is ever executed.
"""

from __future__ import annotations

import json
import time
from typing import Callable, Optional

import numpy as np

from overnight.buckets.features import BASE_NUMERIC_NAMES, HASH_DIM, FeatureBatch
from overnight.buckets.predictors import Prediction, Predictor

FORMAT = "overnight-predictor/2"


def _model(emb: int, hidden: int):
    import torch.nn as nn

    class RankModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.EmbeddingBag(HASH_DIM, emb, mode="sum")
            # Hashed features a file never saw in training must add nothing: start every embedding at zero
            # (PyTorch's default N(0, 1) leaves unseen features as random noise at prediction time).
            nn.init.zeros_(self.emb.weight)
            self.mlp = nn.Sequential(nn.Linear(emb + NUM_INPUTS, hidden), nn.ReLU(), nn.Linear(hidden, 1))

        def forward(self, indices, offsets, weights, numeric):
            import torch

            h = self.emb(indices, offsets, per_sample_weights=weights)
            return self.mlp(torch.cat([h, numeric], dim=1)).squeeze(1)

    return RankModel()


# The numeric features, plus the heuristic's log prediction as a prior the model corrects.
NUM_INPUTS = len(BASE_NUMERIC_NAMES) + 1


def _numeric(fb: FeatureBatch) -> np.ndarray:
    return np.concatenate([fb.numeric[:, :len(BASE_NUMERIC_NAMES)], np.log(np.maximum(fb.heuristic, 1.0))[:, None]], axis=1)


def _tensors(fb: FeatureBatch, mean: np.ndarray, std: np.ndarray):
    import torch

    return (torch.from_numpy(fb.indices.astype(np.int64)), torch.from_numpy(fb.indptr[:-1].astype(np.int64)),
            torch.from_numpy(fb.values), torch.from_numpy(((_numeric(fb) - mean) / std).astype(np.float32)))


class MlpPredictor(Predictor):
    name = "trained (mlp, format 2)"

    def __init__(self, model, mean: np.ndarray, std: np.ndarray, meta: dict):
        self.model = model.eval()
        self.mean = mean
        self.std = std
        self.meta = meta

    def predict(self, fb: FeatureBatch) -> Prediction:
        import torch

        if len(fb) == 0:
            return Prediction(np.zeros(0), np.zeros(0))
        with torch.no_grad():
            out = self.model(*_tensors(fb, self.mean, self.std)).double().numpy()
        tokens = np.clip(np.exp(out), 1.0, np.maximum(fb.caps, 1).astype(np.float64))
        return Prediction(tokens=tokens, score=out)

    # -- training ------------------------------------------------------------------------------
    @classmethod
    def fit(cls, fb: FeatureBatch, actual: np.ndarray, hit_cap: np.ndarray, epochs: int = 40, batch: int = 128,
            emb: int = 32, hidden: int = 64, lr: float = 1e-2, rank_weight: float = 1.0, seed: int = 0,
            holdout: Optional[FeatureBatch] = None, holdout_actual: Optional[np.ndarray] = None,
            log: Callable[[str], None] = lambda s: None, sources: Optional[list] = None) -> tuple["MlpPredictor", "TrainReport"]:
        import torch

        from overnight.buckets.features import subset as _subset
        from overnight.buckets.metrics import kendall_tau
        from overnight.buckets.trained import TrainReport

        started = time.monotonic()
        torch.manual_seed(seed)
        rng = np.random.default_rng(seed)
        mean = _numeric(fb).mean(axis=0)
        std = _numeric(fb).std(axis=0) + 1e-6
        model = _model(emb, hidden)
        opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=1e-6)
        y_all = np.log(np.maximum(actual, 1)).astype(np.float32)
        n = len(fb)
        for epoch in range(epochs):
            order = rng.permutation(n)
            model.train()
            for start in range(0, n, batch):
                rows = order[start:start + batch]
                sub = _subset(fb, rows)
                pred = model(*_tensors(sub, mean, std))
                y = torch.from_numpy(y_all[rows])
                capped = torch.from_numpy(hit_cap[rows].astype(bool))
                err = pred - y
                err = torch.where(capped & (err > 0), torch.zeros_like(err), err)
                loss = (err ** 2).mean()
                if rank_weight and len(rows) > 1:
                    # RankNet: for every pair with a clearly longer answer, score it higher.
                    diff_y = y[:, None] - y[None, :]
                    mask = (diff_y > 0.1).float()
                    if mask.sum() > 0:
                        pair = torch.nn.functional.softplus(-(pred[:, None] - pred[None, :])) * mask
                        loss = loss + rank_weight * pair.sum() / mask.sum()
                opt.zero_grad()
                loss.backward()
                opt.step()
            if (epoch + 1) % 10 == 0 or epoch + 1 == epochs:
                log(f"epoch {epoch + 1}/{epochs}: loss {loss.item():.3f}")
        meta = {"format": FORMAT, "emb": emb, "hidden": hidden, "hash_dim": HASH_DIM,
                "numeric": [*BASE_NUMERIC_NAMES, "log_heuristic"], "num_rows": n, "sources": sources or [],
                "trained_at": time.time()}
        p = cls(model, mean, std, meta)
        train_tau = kendall_tau(p.predict(fb).score, actual)
        val_tau = None
        if holdout is not None and len(holdout):
            val_tau = kendall_tau(p.predict(holdout).score, holdout_actual)
        meta.update(train_tau=train_tau, val_tau=val_tau)
        return p, TrainReport(n, epochs, time.monotonic() - started, train_tau, val_tau)

    # -- files ---------------------------------------------------------------------------------
    def save(self, path: str) -> None:
        import io

        import torch

        from overnight.pipeline.output.storage import url_to_fs, write_atomic

        buf = io.BytesIO()
        torch.save({"meta": json.dumps(self.meta), "state_dict": self.model.state_dict(),
                    "mean": torch.from_numpy(self.mean), "std": torch.from_numpy(self.std)}, buf)
        fs, p = url_to_fs(path)
        write_atomic(fs, p, buf.getvalue())

    @classmethod
    def from_blob(cls, blob: dict, meta: dict) -> "MlpPredictor":
        """A format-2 file's contents, as torch.load(..., weights_only=True) read them."""
        model = _model(meta["emb"], meta["hidden"])
        model.load_state_dict(blob["state_dict"])
        return cls(model, blob["mean"].numpy(), blob["std"].numpy(), meta)
