"""The served model's token embeddings as a length predictor: a ridge on the mean embedding of the prompt's tokens.

The model that will answer a prompt has its own representation of it. Its hidden states predict the answer's
length best (docs/BENCHMARKS.md: a probe on 15 of 30 layers reached the noise ceiling), but they cost a prefill
of every prompt. Its input embeddings cost nothing: the mean of the embeddings of the prompt's tokens (the
text the predictor reads: the prompt, or a chat's last user message), with a ridge on top, averaged with the
word model (trained.py), raised held-out Kendall's tau from 0.243 to 0.263 over 480 rows and from 0.173 to 0.223
on the open-ended ones (docs/BENCHMARKS.md).

A linear model of a mean is the mean of a linear model: w . mean_t E[t] = mean_t (E[t] . w). So the fitted
ridge is stored as one score per token of the vocabulary (``TokenTable``): predicting a row is a lookup and a
mean, and the predictor file needs neither the model's weights nor torch at run time, only its tokenizer, which
the job has loaded anyway. The table is only valid for the vocabulary it was fitted on: the file keeps the
tokenizer's fingerprint, and a job with another tokenizer uses the word model alone (``TrainedPredictor.bind``).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass
import numpy as np

# Names of the input embedding matrix in Hugging Face checkpoints (Llama, Qwen, Mistral, SmolLM: embed_tokens;
# GPT-2: wte; BLOOM, Falcon: word_embeddings).
EMBEDDING_NAMES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "tok_embeddings.weight")
# Ridge penalties searched by leave-one-out (on standardised features: as for benchmarks/length_prediction_probe.py).
LAMBDAS = np.geomspace(1e1, 1e6, 16)
# The table is fitted on at most this many rows (a seeded sample): an SVD of rows x the model's width.
MAX_ROWS = 5000


class EmbeddingsUnavailable(Exception):
    "The model's input embeddings cannot be read here; the message says why."


def fingerprint(tokenizer) -> str:
    """A digest of the tokenizer's vocabulary (token -> id): a table fitted on one vocabulary is meaningless on
    another."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.blake2b(json.dumps(vocab, ensure_ascii=False).encode(), digest_size=12).hexdigest()


def token_ids(tokenizer, texts) -> list[list[int]]:
    """The tokens of each text, without the special tokens a chat template or the tokenizer would add."""
    texts = list(texts)
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def _weights_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        names = [k for k in weight_map if k.endswith(EMBEDDING_NAMES)]
        if not names:
            raise EmbeddingsUnavailable(f"{index} names no input embedding ({' or '.join(EMBEDDING_NAMES)})")
        return sorted({os.path.join(folder, weight_map[k]) for k in names})
    return sorted(glob.glob(os.path.join(folder, "*.safetensors")))


def load_embeddings(folder: str):
    """The input embedding matrix [vocab, width] of the model in `folder` (safetensors, one file or sharded),
    as a torch tensor in its stored dtype. The shortest matching name wins: model.embed_tokens.weight before a
    sub-model's (a multimodal checkpoint's talker.model.embed_tokens.weight)."""
    from safetensors import safe_open

    files = _weights_files(folder)
    if not files:
        raise EmbeddingsUnavailable(f"{folder} holds no .safetensors weights")
    found = []
    for path in files:
        with safe_open(path, framework="pt") as f:
            found += [(len(name), name, path) for name in f.keys() if name.endswith(EMBEDDING_NAMES)]
    if not found:
        raise EmbeddingsUnavailable(f"no input embedding ({' or '.join(EMBEDDING_NAMES)}) in {', '.join(files)}")
    _, name, path = min(found)
    with safe_open(path, framework="pt") as f:
        return f.get_tensor(name)


def model_folder(model: str) -> str:
    """The local folder of a model as `--model` names it (alias, folder, or a hub id already downloaded)."""
    from overnight.pipeline.tools.models import resolve

    resolved = resolve(model, auto_prepare=False)
    if not resolved.is_hub:
        return resolved.path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(resolved.path, local_files_only=True)
    except Exception as e:
        raise EmbeddingsUnavailable(f"{model} is not downloaded on this machine ({type(e).__name__})") from None


def mean_embeddings(emb, ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """([rows, width] each row's mean token embedding, [rows] whether it had any token the matrix holds)."""
    import torch

    out = np.zeros((len(ids), emb.shape[1]), np.float64)
    has = np.zeros(len(ids), bool)
    for i, t in enumerate(ids):
        t = [x for x in t if x < emb.shape[0]]
        if t:
            out[i] = emb[torch.as_tensor(t, dtype=torch.long)].float().mean(dim=0).double().numpy()
            has[i] = True
    return out, has


@dataclass
class TokenTable:
    """score(row) = bias + mean over the row's tokens of table[token]: a ridge on the mean token embedding, in log
    output tokens."""

    table: np.ndarray   # float32 [vocab]
    bias: float
    lam: float
    empty: float        # the score of a row without tokens (an empty prompt): the training rows' mean

    def scores(self, ids: list[list[int]]) -> np.ndarray:
        """Each row's score (log tokens, before calibration). Ids past the table (tokens added to a tokenizer
        after its model) are left out; a row with no other token gets `empty`."""
        lens = np.fromiter((len(r) for r in ids), np.int64, len(ids))
        flat = np.fromiter((t for r in ids for t in r), np.int64, int(lens.sum()))
        row_of = np.repeat(np.arange(len(ids)), lens)
        known = flat < len(self.table)
        counts = np.bincount(row_of[known], minlength=len(ids))
        sums = np.bincount(row_of[known], weights=self.table[flat[known]].astype(np.float64), minlength=len(ids))
        return np.where(counts > 0, self.bias + sums / np.maximum(counts, 1), self.empty)

    @classmethod
    def fit(cls, emb, ids: list[list[int]], actual: np.ndarray) -> tuple["TokenTable", np.ndarray]:
        """Ridge of log tokens on the standardised mean embeddings, its penalty chosen by leave-one-out squared
        error; returns the table and each row's leave-one-out prediction (log tokens), for calibration."""
        x, has = mean_embeddings(emb, ids)
        if has.any():  # a row without tokens sits at the mean row, whose score is the mean (`empty`)
            x[~has] = x[has].mean(axis=0)
        y = np.log(np.maximum(np.asarray(actual, np.float64), 1.0))
        mu, sd = x.mean(axis=0), x.std(axis=0) + 1e-6
        a = (x - mu) / sd
        ym = float(y.mean())
        u, s, vt = np.linalg.svd(a, full_matrices=False)
        uy = u.T @ (y - ym)
        s2 = s ** 2
        best = None
        for lam in LAMBDAS:
            f = s2 / (s2 + lam)
            h = (u ** 2) @ f  # the hat matrix's diagonal
            loo = (y - ym - u @ (f * uy)) / np.maximum(1.0 - h - 1.0 / len(y), 1e-6)
            err = float(np.mean(loo ** 2))
            if best is None or err < best[0]:
                best = (err, float(lam), y - loo)
        _, lam, loo_pred = best
        w = vt.T @ (s / (s2 + lam) * uy) / sd  # on the raw mean embedding
        table = _matvec(emb, w)
        return cls(table.astype(np.float32), ym - float(mu @ w), lam, ym), loo_pred


def _matvec(emb, w: np.ndarray, chunk: int = 16384) -> np.ndarray:
    """emb @ w, a chunk of the vocabulary at a time (an 8B model's embeddings are 2 GB in float32)."""
    import torch

    wt = torch.as_tensor(w, dtype=torch.float32)
    return np.concatenate([(emb[i:i + chunk].float() @ wt).numpy() for i in range(0, emb.shape[0], chunk)])


@dataclass
class TokenInputs:
    """What training the token table needs: the model's input embeddings and tokenizer, and which model it is."""

    emb: object          # torch tensor [vocab, width]
    tokenizer: object
    model: str
    fingerprint: str

    @classmethod
    def of_model(cls, model: str) -> "TokenInputs":
        from overnight.pipeline.tools.models import load_tokenizer, resolve

        folder = model_folder(model)
        emb = load_embeddings(folder)
        tokenizer = load_tokenizer(resolve(folder))
        vocab = len(tokenizer.get_vocab())
        if emb.shape[0] < 0.99 * vocab:  # padded matrices have more rows; a few added tokens may have none
            raise EmbeddingsUnavailable(f"the input embedding in {folder} has {emb.shape[0]} rows for a vocabulary "
                                        f"of {vocab}: it is not this tokenizer's")
        return cls(emb, tokenizer, model, fingerprint(tokenizer))


def rows_of(tokenizer, texts, n: int, seed: int) -> tuple[np.ndarray, list]:
    """At most MAX_ROWS of the n rows (a seeded sample), and their token ids."""
    pick = np.arange(n)
    if n > MAX_ROWS:
        pick = np.sort(np.random.default_rng(seed + 1).choice(n, MAX_ROWS, replace=False))
    return pick, token_ids(tokenizer, [texts[i] for i in pick])
