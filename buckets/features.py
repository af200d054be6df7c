"""Features of a prompt that predict how long its answer will be.

Per row: the prompt's token count after the chat template, its text (hashed
word n-grams, with the opening words marked, since "Write an essay" and "How
many" decide a lot), a few text statistics, the row's max_tokens cap, the kind
of task (kinds.py: a math word problem, code, writing, a rewrite of an
earlier answer ...), and how much of the prompt is earlier conversation (the
chat template's tokens beyond the last user message's). Hashing uses crc32, so
features are stable across processes and machines.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from dataclasses import dataclass

import numpy as np

from overnight.buckets.heuristic import heuristic_tokens, words
from overnight.buckets.kinds import KIND_NAMES, kinds

HASH_DIM = 1 << 16
# The first eight are the features of predictor files written before the kinds (format 2) and must stay first.
BASE_NUMERIC_NAMES = ("log_prompt_tokens", "log_chars", "log_words", "question_marks", "digit_share", "lines",
                      "list_markers", "log_cap")
NUMERIC_NAMES = (*BASE_NUMERIC_NAMES, "log_context_tokens", *(f"kind_{k}" for k in KIND_NAMES))


@dataclass
class FeatureBatch:
    """Features of n rows: hashed text features in CSR form, plus dense numeric ones."""

    indptr: np.ndarray    # int64 [n + 1]
    indices: np.ndarray   # int32 [nnz], in [0, HASH_DIM)
    values: np.ndarray    # float32 [nnz]
    numeric: np.ndarray   # float32 [n, len(NUMERIC_NAMES)]
    prompt_tokens: np.ndarray  # int32 [n]
    caps: np.ndarray      # int32 [n]: each row's max_tokens
    heuristic: np.ndarray  # float32 [n]: the heuristic's estimate, computed once per row
    texts: list           # the prompt texts

    def __len__(self) -> int:
        return len(self.caps)

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.indptr[i], self.indptr[i + 1]
        return self.indices[a:b], self.values[a:b]

    def rows(self) -> list["RowFeatures"]:
        return [RowFeatures(*self.row(i), self.numeric[i], int(self.prompt_tokens[i]), int(self.caps[i]),
                            float(self.heuristic[i]), self.texts[i]) for i in range(len(self))]


@dataclass(slots=True)
class RowFeatures:
    """One row's features, kept on the row while it waits, so predictions can be refreshed."""

    indices: np.ndarray
    values: np.ndarray
    numeric: np.ndarray
    prompt_tokens: int
    cap: int
    heuristic: float
    text: str


def stack(rows: list[RowFeatures]) -> FeatureBatch:
    counts = np.array([len(r.indices) for r in rows], dtype=np.int64)
    return FeatureBatch(
        indptr=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        indices=np.concatenate([r.indices for r in rows]) if rows else np.zeros(0, np.int32),
        values=np.concatenate([r.values for r in rows]) if rows else np.zeros(0, np.float32),
        numeric=np.stack([r.numeric for r in rows]) if rows else np.zeros((0, len(NUMERIC_NAMES)), np.float32),
        prompt_tokens=np.array([r.prompt_tokens for r in rows], dtype=np.int32),
        caps=np.array([r.cap for r in rows], dtype=np.int32),
        heuristic=np.array([r.heuristic for r in rows], dtype=np.float32),
        texts=[r.text for r in rows],
    )


_HASHES: dict[str, int] = {}


def _hash(feature: str) -> int:
    h = _HASHES.get(feature)
    if h is None:
        if len(_HASHES) > 1_000_000:  # bounded: a cache, not a vocabulary
            _HASHES.clear()
        h = _HASHES[feature] = zlib.crc32(feature.encode()) % HASH_DIM
    return h


# Bigrams only near the start, where the instruction is; unigrams cover the rest.
BIGRAM_WORDS = 16
_LIST_ITEM = re.compile(r"(?m)^\s*(?:[-*]|\d+[.)])\s")
_NOT_DIGITS = str.maketrans("", "", "0123456789")


def count_digits(text: str) -> int:
    return len(text) - len(text.translate(_NOT_DIGITS))


def text_features(text: str, w: list[str] | None = None) -> list[int]:
    w = words(text) if w is None else w
    feats = [f"w:{x}" for x in set(w)]
    head = w[:BIGRAM_WORDS]
    feats += [f"b:{a} {b}" for a, b in zip(head, head[1:])]
    feats += [f"first:{x}" for x in w[:3]]
    if len(w) >= 2:
        feats.append(f"first2:{w[0]} {w[1]}")
    return sorted({_hash(f) for f in feats})


def context_tokens(text: str, prompt_tokens: int) -> float:
    """Tokens of the prompt beyond the text the predictor reads: earlier turns of a chat (and a long system
    prompt). A token holds at most about 3 characters of English, so a single prompt comes out near 0 whatever
    its length, and the chat template's own ~40 tokens are left out."""
    return max(0.0, prompt_tokens - len(text) / 3.0 - 40.0)


def numeric_features(text: str, prompt_tokens: int, cap: int, w: list[str] | None = None) -> list[float]:
    n_chars = len(text)
    n_digits = count_digits(text)
    w = words(text) if w is None else w
    return [
        math.log1p(prompt_tokens),
        math.log1p(n_chars),
        math.log1p(len(text.split())),
        float(min(text.count("?"), 5)),
        n_digits / max(1, n_chars),
        float(min(text.count("\n"), 20)),
        float(len(_LIST_ITEM.findall(text, 0, 4000))),
        math.log1p(cap),
        math.log1p(context_tokens(text, prompt_tokens)),
        *kinds(text, w),
    ]


def featurize(texts: list[str], prompt_tokens: list[int], caps: list[int]) -> FeatureBatch:
    indptr = [0]
    indices: list[int] = []
    numeric = []
    heuristic = []
    for text, n, cap in zip(texts, prompt_tokens, caps):
        w = words(text)
        indices.extend(text_features(text, w))
        indptr.append(len(indices))
        numeric.append(numeric_features(text, n, cap, w))
        heuristic.append(heuristic_tokens(text, n, w))
    indptr_a = np.asarray(indptr, dtype=np.int64)
    counts = np.diff(indptr_a)
    # Each row's hashed features have unit L2 norm, whatever the prompt's length.
    values = np.repeat(1.0 / np.sqrt(np.maximum(counts, 1)), counts).astype(np.float32)
    return FeatureBatch(
        indptr=indptr_a,
        indices=np.asarray(indices, dtype=np.int32),
        values=values,
        numeric=np.asarray(numeric, dtype=np.float32).reshape(len(texts), len(NUMERIC_NAMES)),
        prompt_tokens=np.asarray(prompt_tokens, dtype=np.int32),
        caps=np.asarray(caps, dtype=np.int32),
        heuristic=np.asarray(heuristic, dtype=np.float32),
        texts=list(texts),
    )


def prompt_text(prompt, messages) -> str:
    """The text a predictor reads: the prompt, or a chat's last user message."""
    if isinstance(messages, str):  # a chat column of JSON strings, as the input allows
        try:
            messages = json.loads(messages)
        except ValueError:
            return messages
    if messages and isinstance(messages, list):
        chat = [m for m in messages if isinstance(m, dict)]
        users = [m.get("content") for m in chat if m.get("role") == "user"]
        text = users[-1] if users else (chat[-1].get("content") if chat else None)
        return text if isinstance(text, str) else json.dumps(text, default=str) if text is not None else ""
    return prompt or ""


def subset(fb: FeatureBatch, rows) -> FeatureBatch:
    """The rows of fb at positions `rows`, in that order."""
    rows = np.asarray(rows, dtype=np.int64)
    starts, ends = fb.indptr[rows], fb.indptr[rows + 1]
    counts = ends - starts
    # positions of every entry of the chosen rows, without a Python loop over rows
    idx = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts) + np.arange(counts.sum())
    return FeatureBatch(indptr=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), indices=fb.indices[idx],
                        values=fb.values[idx], numeric=fb.numeric[rows], prompt_tokens=fb.prompt_tokens[rows],
                        caps=fb.caps[rows], heuristic=fb.heuristic[rows], texts=[fb.texts[i] for i in rows])
