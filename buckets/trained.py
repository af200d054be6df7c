"""The trained predictor: a regularised linear model of log output length, fitted on earlier runs' outputs.

Earlier outputs hold every row's prompt and actual output length, so they are
free training data; but a run's lengths are mostly sampling noise (two
samplings of the same prompts agree at Kendall's tau 0.27, docs/BENCHMARKS.md),
and a flexible model learns that noise: the torch MLP this replaced
(mlp.py) reached a training tau of 0.86 on 120 rows and 0.20 on held-out ones.
So the model is linear, over the dense features (the numeric ones, the kinds
of task, the heuristic's log estimate) and the hashed words, with an L2
penalty on each block; both penalties are chosen by K-fold cross-validation
on the training rows (buckets/linear.py), and the hashed words drop out when
they do not help.

Calibration, from the same folds' out-of-fold scores s: log tokens = a + b s
by least squares, then a factor c so that the mean prediction (clipped at each
row's max_tokens) equals the mean actual length. The scheduler's deadline
forecast sums predicted tokens, so the mean is what must be right: exp of a
mean log length would undershoot it by the spread of the lengths.

With the served model's token embeddings (tokens.py, ``fit(tokens=...)``), a second model, a ridge on the
mean embedding of the prompt's tokens kept as one score per token, is averaged with this one in log tokens, and
the average is calibrated again the same way, on out-of-fold (word model) and leave-one-out (token model)
predictions. It is used where the job's tokenizer is the one it was fitted with (``bind``); elsewhere the word
model predicts alone, with its own calibration.

Files are NumPy .npz archives read with ``allow_pickle=False``: no pickled
code is ever executed. Files of format 2 (the torch MLP) still load; files of format 3 without a token table
load as the word model alone.
"""

from __future__ import annotations

import io
import json
import math
import time
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Callable, Optional

import numpy as np

from overnight.buckets.features import HASH_DIM, NUMERIC_NAMES, FeatureBatch, subset
from overnight.buckets.linear import Design, dense, fit_pairwise, fit_ridge
from overnight.buckets.metrics import kendall_tau
from overnight.buckets.predictors import Prediction, Predictor
from overnight.buckets.tokens import TokenInputs, TokenTable, fingerprint, rows_of, token_ids
from overnight.pipeline.config import ConfigError

FORMAT = "overnight-predictor/3"
# Penalty grids searched by cross-validation: the dense block's as a share of the rows, the hashed words' as is
# (inf: without them).
LAM_DENSE = (0.03, 0.3, 3.0, 30.0)
LAM_SPARSE = (0.1, 1.0, 10.0, math.inf)
# The least slope of the calibration (calibrate).
MIN_SLOPE = 0.02
# Above this many rows the penalties are chosen on a seeded sample of them; the final fit uses every row.
CV_MAX_ROWS = 20_000

_subset = subset  # the name earlier callers used


class PredictorFileError(Exception):
    "A predictor file cannot be used; the message says why and how to fix it."


class PredictorUsageError(PredictorFileError, ConfigError):
    "--predictor names no predictor file (missing, or another kind of file): bad usage, exit 2."


@dataclass
class TrainReport:
    num_rows: int
    epochs: int                 # 0: the linear model has no epochs (kept for callers of format 2's report)
    seconds: float
    train_tau: float
    val_tau: Optional[float]
    cv_tau: Optional[float] = None          # out-of-fold tau on the training rows, with the chosen penalties
    val_mae: Optional[float] = None
    val_calibration: Optional[float] = None  # mean predicted / mean actual on the held-out rows
    config: dict = field(default_factory=dict)
    # The token model's part: None without one; else how many rows it was fitted on, and the word model's own
    # out-of-fold tau on those rows beside the average's (cv_tau is the average's then)
    tokens: Optional[dict] = None


def normal_scores(y: np.ndarray) -> np.ndarray:
    """Each value's rank, tied values sharing their mean rank, as a standard normal quantile."""
    uniq, inv, counts = np.unique(y, return_inverse=True, return_counts=True)
    mean_rank = np.cumsum(counts) - (counts - 1) / 2.0  # 1-based mean rank of each distinct value
    nd = NormalDist()
    q = np.array([nd.inv_cdf(r) for r in (mean_rank - 0.5) / len(y)])
    return q[inv]


def _fit(d: Design, t: np.ndarray, objective: str, lam_dense: float, lam_sparse: float, seed: int):
    if objective == "pairwise":
        return fit_pairwise(d, t, lam_dense, lam_sparse, seed=seed)
    return fit_ridge(d, t, lam_dense, lam_sparse)


def calibrate(s: np.ndarray, actual: np.ndarray, caps: np.ndarray) -> tuple[float, float, float]:
    """(a, b, c): log tokens ~ a + b s by least squares on log actual; then c so that the mean of
    min(c exp(a + b s), cap) is the mean actual length. A slope the out-of-fold scores do not support
    (below MIN_SLOPE: the model ranks no better than chance) is kept at MIN_SLOPE: the predictions stay
    near the mean, ordered by the score, rather than all tied."""
    y = np.log(np.maximum(actual, 1.0))
    var = float(np.var(s))
    b = float(np.clip(np.cov(s, y)[0, 1] / var, MIN_SLOPE, 3.0)) if var > 1e-12 else MIN_SLOPE
    a = float(np.mean(y) - b * np.mean(s))
    base = np.exp(a + b * s)
    cap = np.maximum(caps, 1).astype(np.float64)
    target = float(np.mean(actual))
    lo, hi = -4.0, 4.0
    for _ in range(60):  # mean(min(c base, cap)) grows with c: bisect on log c
        mid = (lo + hi) / 2
        if np.mean(np.minimum(math.exp(mid) * base, cap)) < target:
            lo = mid
        else:
            hi = mid
    return a, b, math.exp((lo + hi) / 2)


class TrainedPredictor(Predictor):
    calibrated = True  # its mean is fitted to the training rows' actual mean (calibrate)

    def __init__(self, bias: float, wd: np.ndarray, ws: np.ndarray, mean: np.ndarray, std: np.ndarray,
                 calib: tuple[float, float, float], meta: dict, tokens: Optional[TokenTable] = None,
                 token_calib: Optional[tuple[float, float, float]] = None):
        self.bias = float(bias)
        self.wd = np.asarray(wd, dtype=np.float64)
        self.ws = np.asarray(ws, dtype=np.float32)  # [HASH_DIM]
        self.mean = np.asarray(mean, dtype=np.float64)
        self.std = np.asarray(std, dtype=np.float64)
        self.calib = tuple(float(x) for x in calib)
        self.meta = meta
        self.tokens = tokens  # the token model, and the calibration of the average (None: the word model alone)
        self.token_calib = None if token_calib is None else tuple(float(x) for x in token_calib)
        self.tokenizer = None  # set by bind(): the token model predicts only with the tokenizer it was fitted on

    @property
    def name(self) -> str:
        return "trained, with the model's token embeddings" if self.tokenizer is not None else "trained"

    def bind(self, tokenizer) -> Optional[str]:
        """Use the token model with this tokenizer (the job's), if it is the one the file was fitted with. Returns
        why not, when the file has a token model that cannot be used; None otherwise."""
        if self.tokens is None or tokenizer is None:
            self.tokenizer = None
            return None
        info = self.meta.get("tokens") or {}
        if fingerprint(tokenizer) != info.get("fingerprint"):
            self.tokenizer = None
            return (f"the predictor file's token model was fitted on the vocabulary of {info.get('model')!r}, not "
                    f"this model's: its word model predicts alone. For both, train it on runs of this model "
                    f"(`overnight predictor train OUT --save FILE`), or with this model's embeddings "
                    f"(`--model MODEL`).")
        self.tokenizer = tokenizer
        return None

    def raw_score(self, fb: FeatureBatch) -> np.ndarray:
        """The linear model's output, before calibration."""
        out = self.bias + ((dense(fb) - self.mean) / self.std) @ self.wd
        if len(fb.indices):
            row_of = np.repeat(np.arange(len(fb)), np.diff(fb.indptr))
            out = out + np.bincount(row_of, weights=self.ws[fb.indices] * fb.values, minlength=len(fb))
        return out

    def predict(self, fb: FeatureBatch, offset: Optional[np.ndarray] = None) -> Prediction:
        """offset: a prior log estimate per row the model was fitted as a correction to (the online predictor's)."""
        if len(fb) == 0:
            return Prediction(np.zeros(0), np.zeros(0))
        a, b, c = self.calib
        log_t = a + b * (self.raw_score(fb) + (0.0 if offset is None else offset))
        if self.tokenizer is not None:
            a, b, c = self.token_calib
            log_t = a + b * (0.5 * log_t + 0.5 * self.tokens.scores(token_ids(self.tokenizer, fb.texts)))
        tokens = np.clip(c * np.exp(log_t), 1.0, np.maximum(fb.caps, 1).astype(np.float64))
        return Prediction(tokens=tokens, score=log_t)

    # -- training ------------------------------------------------------------------------------
    @classmethod
    def fit(cls, fb: FeatureBatch, actual: np.ndarray, hit_cap: Optional[np.ndarray] = None, *,
            objective: str = "ridge", target: str = "rank", select: str = "tau", folds: int = 5, seed: int = 0,
            lam_dense: Optional[float] = None, lam_sparse: Optional[float] = None, words: bool = True,
            offset: Optional[np.ndarray] = None, one_se: bool = True, grid: Optional[list] = None,
            cv_repeats: int = 1, holdout: Optional[FeatureBatch] = None, holdout_actual: Optional[np.ndarray] = None,
            log: Callable[[str], None] = lambda s: None, sources: Optional[list] = None,
            epochs: Optional[int] = None, tokens: Optional[TokenInputs] = None) -> tuple["TrainedPredictor", TrainReport]:
        """Fit on rows fb with their actual output tokens. objective: ridge (regression) or pairwise (RankNet);
        target: log (log tokens) or rank (normal scores of the ranks); select: the penalties with the highest
        out-of-fold tau (tau), or the most penalised within one standard error (one_se) of the least out-of-fold
        squared error in log tokens (mse); grid: (lam_dense as a share of the rows, lam_sparse) pairs to search
        instead of LAM_DENSE x LAM_SPARSE (inf leaves a block out); cv_repeats: the criterion is averaged over
        this many splits into folds, which makes the choice less a matter of one split's luck. Fixed lam_dense and
        lam_sparse skip the search; words=False leaves the hashed words out. offset: a prior log estimate per row;
        the model learns a correction to it, which the penalties shrink towards none. tokens: the served model's
        embeddings and tokenizer, to fit the token model beside the word model (tokens.py); it needs the
        out-of-fold predictions of cross-validation, so at least 8 rows and no offset. hit_cap and epochs are
        accepted for callers of format 2 and unused: a row that stopped at max_tokens cost exactly that many
        tokens, which is what the scheduler needs predicted."""
        if objective not in ("ridge", "pairwise") or target not in ("log", "rank") or select not in ("mse", "tau"):
            raise ValueError(f"objective={objective!r}, target={target!r}, select={select!r}: use ridge|pairwise, "
                             f"log|rank, mse|tau.")
        if offset is not None and (objective != "ridge" or target != "log"):
            raise ValueError("an offset needs objective='ridge' and target='log'.")
        started = time.monotonic()
        n = len(fb)
        actual = np.asarray(actual, dtype=np.float64)
        off = np.zeros(n) if offset is None else np.asarray(offset, dtype=np.float64)
        y = np.log(np.maximum(actual, 1.0))
        x = dense(fb)
        mean, std = x.mean(axis=0), x.std(axis=0) + 1e-6
        rng = np.random.default_rng(seed)
        cv_rows = np.sort(rng.choice(n, CV_MAX_ROWS, replace=False)) if n > CV_MAX_ROWS else np.arange(n)
        cv_fb = fb if len(cv_rows) == n else subset(fb, cv_rows)
        d_cv = Design.of(cv_fb, mean, std)
        y_cv, a_cv, off_cv = y[cv_rows], actual[cv_rows], off[cv_rows]
        t_cv = normal_scores(y_cv) if target == "rank" else y_cv - off_cv
        k = min(folds, len(cv_rows) // 4)
        if lam_dense is not None and lam_sparse is not None:
            grid = [(lam_dense, lam_sparse)]
        elif grid is not None:
            grid = [(ld * len(cv_rows) if math.isfinite(ld) else ld, ls) for ld, ls in grid]
        else:
            grid = [(ld * len(cv_rows), ls) for ld in LAM_DENSE for ls in (LAM_SPARSE if words else (math.inf,))]
        best, best_oof = grid[len(grid) // 2], None
        if k >= 2:
            folds_of = [rng.permutation(len(cv_rows)) % k for _ in range(max(1, cv_repeats))]
            scored = []  # (config, criterion, its standard error, out-of-fold scores of the first repeat)
            for ld, ls in grid:
                keys, ses, first = [], [], None
                for fold_of in folds_of:
                    oof = np.zeros(len(cv_rows))
                    for f in range(k):
                        tr, te = np.flatnonzero(fold_of != f), np.flatnonzero(fold_of == f)
                        b, wd, ws = _fit(d_cv.rows(tr), t_cv[tr], objective, ld, ls, seed)
                        oof[te] = d_cv.rows(te).matvec(b, wd, ws) + off_cv[te]
                    key, se = _criterion(select, oof, y_cv, a_cv)
                    keys.append(key)
                    ses.append(se)
                    first = oof if first is None else first
                scored.append(((ld, ls), float(np.mean(keys)), float(np.mean(ses)), first))
                log(f"  lam_dense {ld:g}, lam_sparse {ls:g}: out-of-fold tau {kendall_tau(first, a_cv):.3f}")
            top = max(scored, key=lambda c: c[1])
            if one_se and select == "mse":
                # the most penalised model within one standard error of the best: the best's lead is mostly noise
                # at a few hundred rows of noisy lengths, and the penalties that won by noise overfit
                near = [c for c in scored if c[1] >= top[1] - top[2]]
                top = max(near, key=lambda c: (min(math.log(c[0][0]), 50.0) + min(math.log(c[0][1]), 50.0), c[1]))
            best, best_oof = top[0], top[3]
        ld, ls = best
        d = Design.of(fb, mean, std)
        t = normal_scores(y) if target == "rank" else y - off
        b, wd, ws_compact = _fit(d, t, objective, ld, ls, seed)
        ws = np.zeros(HASH_DIM, dtype=np.float32)
        ws[d.touched] = ws_compact
        if best_oof is not None:
            calib = calibrate(best_oof, a_cv, cv_fb.caps)
        else:  # too few rows to hold any out: calibrate in sample
            calib = calibrate(d.matvec(b, wd, ws_compact) + off, actual, fb.caps)
        cv_tau = kendall_tau(best_oof, a_cv) if best_oof is not None else None
        meta = {"format": FORMAT, "hash_dim": HASH_DIM, "numeric": [*NUMERIC_NAMES, "log_heuristic"],
                "objective": objective, "target": target, "select": select,
                "lam_dense": ld if math.isfinite(ld) else None, "lam_sparse": ls if math.isfinite(ls) else None, "num_rows": n,
                "mean_actual": float(np.mean(actual)), "sources": sources or [], "trained_at": time.time()}
        p = cls(b, wd, ws, mean, std, calib, meta)
        token_report = None
        if tokens is not None and best_oof is not None and offset is None:
            token_report = p._fit_tokens(tokens, cv_fb, best_oof, a_cv, seed)
            cv_tau = token_report["cv_tau"]
        train_tau = kendall_tau(p.predict(fb, offset).score, actual)
        val_tau = val_mae = val_cal = None
        if holdout is not None and len(holdout):
            hp = p.predict(holdout)
            ha = np.asarray(holdout_actual, dtype=np.float64)
            val_tau = kendall_tau(hp.score, ha)
            val_mae = float(np.mean(np.abs(hp.tokens - ha)))
            val_cal = float(np.mean(hp.tokens) / max(np.mean(ha), 1e-9))
        meta.update(train_tau=train_tau, cv_tau=cv_tau, val_tau=val_tau)
        config = {"objective": objective, "target": target, "lam_dense": ld, "lam_sparse": ls,
                  "calibration": {"a": calib[0], "b": calib[1], "c": calib[2]}}
        if p.token_calib is not None:
            config["token_calibration"] = dict(zip("abc", p.token_calib))
        return p, TrainReport(n, 0, time.monotonic() - started, train_tau, val_tau, cv_tau, val_mae, val_cal, config,
                              token_report)

    def _fit_tokens(self, inputs: TokenInputs, cv_fb: FeatureBatch, oof: np.ndarray, actual: np.ndarray,
                    seed: int) -> dict:
        """Fit the token model on (a sample of) the cross-validation rows, and calibrate the average of its
        leave-one-out predictions with the word model's out-of-fold ones."""
        pick, ids = rows_of(inputs.tokenizer, cv_fb.texts, len(cv_fb), seed)
        table, loo = TokenTable.fit(inputs.emb, ids, actual[pick])
        a, b, _ = self.calib
        words_log = a + b * oof[pick]
        average = 0.5 * words_log + 0.5 * loo
        self.tokens = table
        self.token_calib = calibrate(average, actual[pick], cv_fb.caps[pick])
        self.tokenizer = inputs.tokenizer
        self.meta["tokens"] = {"model": inputs.model, "fingerprint": inputs.fingerprint, "vocab": len(table.table),
                               "lam": table.lam, "num_rows": len(pick)}
        return {"num_rows": len(pick), "cv_tau": kendall_tau(average, actual[pick]),
                "words_cv_tau": kendall_tau(oof[pick], actual[pick]), "tokens_cv_tau": kendall_tau(loo, actual[pick])}

    # -- files ---------------------------------------------------------------------------------
    def save(self, path: str) -> None:
        from overnight.pipeline.output.storage import url_to_fs, write_atomic

        buf = io.BytesIO()
        extra = {} if self.tokens is None else {"token_table": self.tokens.table, "token_bias": np.array([self.tokens.bias, self.tokens.empty]),
                                                 "token_calib": np.array(self.token_calib)}
        np.savez_compressed(buf, meta=np.array(json.dumps(self.meta)), bias=np.array(self.bias), wd=self.wd,
                            ws=self.ws, mean=self.mean, std=self.std, calib=np.array(self.calib), **extra)
        weights = [np.array(self.bias), self.wd, self.ws, np.array(self.calib)]
        if not all(np.isfinite(np.asarray(w, np.float64)).all() for w in weights):
            raise PredictorFileError(f"The predictor's weights are not finite numbers, so {path} is not written; "
                                     f"train on more rows, with lengths that differ.")
        fs, p = url_to_fs(path)
        try:
            write_atomic(fs, p, buf.getvalue())
        except OSError as e:  # a folder, a path under a file, no permission: after the training, said plainly
            raise PredictorFileError(f"--save {path}: cannot be written ({type(e).__name__}: "
                                     f"{getattr(e, 'strerror', None) or e}); give a file path in a folder that "
                                     f"exists and is writable.") from None

    @classmethod
    def load(cls, path: str) -> Predictor:
        """A file written by `overnight predictor train` (format 3, or format 2's torch model)."""
        from overnight.pipeline.output.storage import url_to_fs

        fs, p = url_to_fs(path)
        if not fs.exists(p):
            raise PredictorUsageError(f"Predictor file {path} does not exist. Use 'heuristic', 'online', or a file "
                                     f"written by `overnight predictor train OUT --save FILE`.")
        try:
            with fs.open(p, "rb") as f:
                raw = f.read()
        except OSError as e:  # a folder, say
            raise PredictorFileError(f"Predictor file {path} cannot be read ({type(e).__name__}: {e}). Give a file "
                                     f"written by `overnight predictor train OUT --save FILE`.") from None
        try:
            with np.load(io.BytesIO(raw), allow_pickle=False) as z:
                blob = {k: z[k] for k in z.files} if "meta" in z.files else None
            if blob is None:
                return _load_format2(path, raw)
            meta = json.loads(str(blob["meta"]))
            if not isinstance(meta, dict) or not all(k in blob for k in ("bias", "wd", "ws", "mean", "std", "calib")):
                raise ValueError("its metadata or weights are missing")
        except PredictorFileError:
            raise
        except Exception as e:
            # (NumPy says a file that is no archive holds pickled data it could load "unsafely": not advice to give)
            why = "it is not a NumPy archive" if "pickle" in str(e) else f"{type(e).__name__}: {e}"
            raise PredictorUsageError(f"{path} is not a predictor file written by `overnight predictor train` "
                                     f"({why}).") from None
        if meta.get("format") != FORMAT or meta.get("hash_dim") != HASH_DIM or len(blob["wd"]) != len(NUMERIC_NAMES) + 1:
            raise PredictorUsageError(f"{path} was written by an incompatible version ({meta.get('format')}); "
                                     f"train it again with `overnight predictor train`.")
        tokens = token_calib = None
        if "token_table" in blob:
            try:
                bias, empty = blob["token_bias"]
                tokens = TokenTable(blob["token_table"], float(bias), float(meta["tokens"]["lam"]), float(empty))
                token_calib = tuple(blob["token_calib"])
            except (KeyError, TypeError, ValueError) as e:
                raise PredictorFileError(f"{path} has a token model that cannot be read ({type(e).__name__}: {e}); "
                                         f"train it again with `overnight predictor train`.") from None
        return cls(float(blob["bias"]), blob["wd"], blob["ws"], blob["mean"], blob["std"], tuple(blob["calib"]), meta,
                   tokens, token_calib)


def _criterion(select: str, oof: np.ndarray, y: np.ndarray, actual: np.ndarray) -> tuple[float, float]:
    """(criterion, its standard error); larger is better: out-of-fold tau (its error left at 0), or minus the
    squared error of the out-of-fold score mapped onto log length by least squares (so that a ranking
    objective's free scale does not count against it)."""
    if select == "tau":
        return kendall_tau(oof, actual), 0.0
    var = float(np.var(oof))
    slope = np.cov(oof, y)[0, 1] / var if var > 1e-12 else 0.0
    sq = (y - (np.mean(y) + slope * (oof - np.mean(oof)))) ** 2
    return -float(np.mean(sq)), float(np.std(sq) / math.sqrt(len(sq)))


def _load_format2(path: str, raw: bytes) -> Predictor:
    """A torch file from before format 3 (the MLP in mlp.py)."""
    try:
        import torch

        blob = torch.load(io.BytesIO(raw), weights_only=True)
        meta = json.loads(blob["meta"])
    except Exception as e:
        raise PredictorUsageError(f"{path} is not a predictor file written by `overnight predictor train` "
                                 f"({type(e).__name__}: {e}).") from None
    from overnight.buckets.mlp import FORMAT as FORMAT2, MlpPredictor

    if meta.get("format") != FORMAT2 or meta.get("hash_dim") != HASH_DIM:
        raise PredictorUsageError(f"{path} was written by an incompatible version ({meta.get('format')}); "
                                 f"train it again with `overnight predictor train`.")
    return MlpPredictor.from_blob(blob, meta)
