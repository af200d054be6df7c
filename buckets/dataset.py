"""Earlier runs' outputs as length data: each ok row's prompt, its caps and its actual output length."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from overnight.buckets.features import FeatureBatch, featurize, prompt_text


class DatasetError(Exception):
    "An output folder cannot serve as length data; the message says why and how to fix it."


@dataclass
class LengthData:
    features: FeatureBatch
    actual: np.ndarray          # output tokens
    hit_cap: np.ndarray         # bool: stopped at max_tokens, so the true length is at least `actual`
    stored_prediction: np.ndarray  # the run's own predicted_tokens (nan where none)
    finished_at: np.ndarray     # for replaying an online predictor in finish order
    sources: list[str]
    models: list[str] = field(default_factory=list)  # the models the runs served (--model as given), each once
    num_repeats: int = 0  # rows left out because a later row had the same prompt

    def __len__(self) -> int:
        return len(self.actual)

    def split(self, holdout: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(seed)
        order = rng.permutation(len(self))
        k = int(round(len(self) * (1 - holdout)))
        return np.sort(order[:k]), np.sort(order[k:])


def output_name(column: str, manifest: dict) -> str:
    """Where an input column is in a run's output: under its own name, or under the name the writer gave it when
    it clashes with a result column (``input_text`` for ``text``: OutputSchema's rule, as the manifest records it;
    for a run before that, the rule's first step)."""
    from overnight.pipeline.records import RESULT_FIELDS, SAMPLE_FIELDS

    renamed = (manifest.get("input") or {}).get("renamed") or {}
    if column in renamed:
        return renamed[column]
    return f"input_{column}" if column in set(RESULT_FIELDS) | set(SAMPLE_FIELDS) else column


def load_outputs(urls: list[str], one_per_prompt: bool = False, need_prompt: bool = True) -> LengthData:
    """The runs' ok rows (a row of n samples by its first); with ``one_per_prompt``, for training, each prompt's
    latest row only. ``need_prompt`` False: an OUT without the prompt column gives empty texts (the stored
    predictions against the actual lengths need none)."""
    from overnight.pipeline.output.layout import job_manifest
    from overnight.pipeline.output.manifest import engine_kind
    from overnight.pipeline.tools.inspection import open_results

    texts, ptok, caps, actual, hit, stored, finished, models = [], [], [], [], [], [], [], []
    for url in urls:
        manifest = job_manifest(url)
        if manifest is None:
            raise DatasetError(f"{url} has no manifest.json: pass the --out folder of an `overnight run`.")
        fields = manifest.get("fingerprint_fields", {})
        if engine_kind(manifest) != "vllm":
            logging.getLogger("overnight").warning(
                f"{url} was answered by the {engine_kind(manifest)} engine (a fake, for tests), not by a model: "
                f"its lengths say nothing of a model's")
        if fields.get("model"):  # a folder by its path, however the run spelled it
            from overnight.pipeline.tools.models import model_key
            model = model_key(fields["model"], (manifest.get("input") or {}).get("cwd"))
            if model not in models:
                models.append(model)
        prompt_col = fields.get("prompt_column", "prompt")
        messages_col = fields.get("messages_column", "messages")
        default_cap = int(fields.get("sampling", {}).get("max_tokens", 512))
        con, _ = open_results(url)
        columns = {r[0] for r in con.execute("describe results").fetchall()}
        if "status" not in columns or not con.execute("select count(*) from results").fetchone()[0]:  # no part
            if manifest.get("state") == "completed" and not (manifest.get("counts") or {}).get("num_done"):
                raise DatasetError(f"{url} holds no rows: its job completed with none (an input of no rows, or "
                                   f"rows all skipped). Pass the --out folder of a run that answered some.")
            raise DatasetError(f"{url} has no finished rows yet; let the run flush its first part (or finish), "
                               f"then run this again.")
        # an input column whose name is a result's (``text``) is in the output under another name
        prompt_col, messages_col = (output_name(c, manifest) for c in (prompt_col, messages_col))
        if prompt_col not in columns and messages_col not in columns and need_prompt:
            raise DatasetError(f"{url} holds no prompt column ({prompt_col!r}): the run was made with --passthrough "
                               f"leaving it out. Rerun with --passthrough all (the default) to train a predictor on "
                               f"it or evaluate one (`predictor eval` without --predictor needs no prompt).")
        p = f'"{prompt_col}"' if prompt_col in columns else "null"
        m = f'"{messages_col}"' if messages_col in columns else "null"
        cap = "coalesce(max_tokens, {0})".format(default_cap) if "max_tokens" in columns else str(default_cap)
        pred = "predicted_tokens" if "predicted_tokens" in columns else "null"
        # n > 1: a row's first sample only; its others share its prompt, and would sit on both sides of a split
        first = " and coalesce(sample_index, 0) = 0" if "sample_index" in columns else ""
        rows = con.execute(
            f"select {p}, {m}, prompt_tokens, output_tokens, finish_reason, {cap}, {pred}, "
            f"epoch(finished_at) from results where status = 'ok'{first} order by finished_at").fetchall()
        for prompt, messages, n_prompt, n_out, reason, c, pr, fin in rows:
            texts.append(prompt_text(prompt, messages))
            ptok.append(int(n_prompt or 0))
            caps.append(int(c))
            actual.append(int(n_out or 0))
            hit.append(reason == "length")
            stored.append(np.nan if pr is None else float(pr))
            finished.append(float(fin or 0.0))
    if not actual:
        raise DatasetError(f"{', '.join(urls)} hold no finished ok rows to learn from.")
    repeats = 0
    if one_per_prompt:
        # One row per prompt, the latest finished: the same prompts in two runs (a dataset run again, a folder
        # given twice) or twice in one would sit on both sides of the holdout split and of the cross-validation's
        # folds, and the tau they report would be the model remembering them (0.24 on one run, 0.77 on it and a
        # copy of it).
        latest: dict = {}
        for i, (text, fin) in enumerate(zip(texts, finished)):
            j = latest.get(text)
            if j is None or fin >= finished[j]:
                latest[text] = i
        keep = sorted(latest.values())
        repeats = len(texts) - len(keep)
        texts, ptok, caps, actual, hit, stored, finished = (
            [v[i] for i in keep] for v in (texts, ptok, caps, actual, hit, stored, finished))
    return LengthData(featurize(texts, ptok, caps), np.asarray(actual, dtype=np.float64), np.asarray(hit),
                      np.asarray(stored), np.asarray(finished), list(urls), models, repeats)
