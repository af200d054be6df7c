"""A dry run: predict every row's output length and forecast the job, without starting the engine."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from overnight.buckets.annotate import LengthAnnotator
from overnight.buckets.bucketing import assign, describe, quantile_bounds
from overnight.buckets.predictors import make_predictor
from overnight.pipeline.checkpoint import OutputDir, Scan
from overnight.pipeline.config import JobConfig
from overnight.pipeline.job import resolve_deadline
from overnight.pipeline.models import ModelError, load_tokenizer, resolve
from overnight.pipeline.prompts import PromptBuilder, has_chat_template
from overnight.pipeline.source import ParquetSource
from overnight.pipeline.validate import parse_batch, sampling_defaults


@dataclass
class BucketLine:
    label: str
    num_rows: int
    prompt_tokens: int
    predicted_tokens: int


@dataclass
class Plan:
    num_rows: int
    num_done: int
    num_errors: int
    num_todo: int
    predictor: str
    buckets: list[BucketLine]
    predicted_tokens: int
    tokens_per_s: Optional[float]
    throughput_source: str
    eta_s: Optional[float]
    deadline_at: Optional[float] = None
    time_left_s: Optional[float] = None
    is_feasible: Optional[bool] = None
    rows_left: Optional[int] = None
    tokens_left: Optional[int] = None
    errors: list = field(default_factory=list)


def measured_throughput(out_url: str) -> Optional[float]:
    """Output tokens/s a previous run of this job measured (its status.json)."""
    status = OutputDir(out_url).read_status()
    if status and status.get("output_tokens_per_s"):
        return float(status["output_tokens_per_s"])
    return None


def model_context(path: str) -> int:
    try:
        with open(os.path.join(path, "config.json")) as f:
            return int(json.load(f).get("max_position_embeddings") or 2048)
    except (OSError, ValueError):
        return 2048


def make_plan(cfg: JobConfig, out: Optional[str] = None, throughput: Optional[float] = None,
              now: Optional[float] = None) -> Plan:
    now = time.time() if now is None else now
    deadline_at, margin = resolve_deadline(cfg.scheduler, now)
    source = ParquetSource(cfg.input)
    model = resolve(cfg.engine.model)
    tokenizer = load_tokenizer(model, cfg.engine.trust_remote_code)
    chat = cfg.prompt.chat if cfg.prompt.chat is not None else has_chat_template(tokenizer)
    if chat and not has_chat_template(tokenizer):
        raise ModelError(f"Model {model.requested} has no chat template; pass --no-chat.")
    max_model_len = cfg.engine.max_model_len or (model_context(model.path) if not model.is_hub else 2048)
    builder = PromptBuilder(tokenizer, chat, cfg.prompt.system_prompt, max_model_len)
    annotator = LengthAnnotator(make_predictor(cfg.buckets.predictor), cfg.sampling.max_tokens, "log",
                                cfg.buckets.num_buckets)
    done = OutputDir(out).scan(cfg.input.id_column) if out and OutputDir(out).read_manifest() else Scan()
    defaults = sampling_defaults(cfg.sampling)
    predicted, prompt_tokens = [], []
    num_done = num_errors = 0
    errors = []
    for sb in source.batches():
        parsed, bad = parse_batch(sb, cfg.input, defaults, [])
        num_done += sum(1 for p in parsed if p.id in done.done_ids)
        parsed = [p for p in parsed if p.id not in done.done_ids]
        rows, texts, bad2 = builder.build(parsed)
        annotator.annotate(rows, texts)
        for e in bad + bad2:
            num_errors += 1
            if len(errors) < 5:
                errors.append(e.error)
        predicted.extend(r.predicted_tokens for r in rows)
        prompt_tokens.extend(r.num_prompt_tokens for r in rows)
    pred = np.asarray(predicted, dtype=np.float64)
    ptok = np.asarray(prompt_tokens, dtype=np.int64)
    bounds = quantile_bounds(pred, cfg.buckets.num_buckets) if cfg.buckets.kind == "quantile" else annotator.bounds
    if bounds is None:
        bounds = np.array([cfg.sampling.max_tokens])
    b = assign(pred, bounds)
    lines = [BucketLine(label, int((b == i).sum()), int(ptok[b == i].sum()), int(pred[b == i].sum()))
             for i, label in enumerate(describe(bounds))]

    source_name = "none"
    tps = throughput
    if tps:
        source_name = "--throughput"
    elif cfg.scheduler.tokens_per_second:
        tps, source_name = cfg.scheduler.tokens_per_second, "config scheduler.tokens_per_second"
    elif out and measured_throughput(out):
        tps, source_name = measured_throughput(out), f"measured by the last run in {out}"
    total = float(pred.sum())
    plan = Plan(num_rows=source.num_rows, num_done=num_done, num_errors=num_errors, num_todo=len(pred),
                predictor=annotator.predictor.name, buckets=lines, predicted_tokens=int(total),
                tokens_per_s=tps, throughput_source=source_name, eta_s=total / tps if tps else None, errors=errors)
    if deadline_at is not None:
        plan.deadline_at = deadline_at
        plan.time_left_s = max(0.0, deadline_at - margin - now)
        if tps:
            plan.is_feasible = plan.eta_s <= plan.time_left_s
            # What the auto policy would leave: it runs the shortest predicted rows first once at risk.
            cum = np.cumsum(np.sort(pred))
            fits = int(np.searchsorted(cum, tps * plan.time_left_s, side="right"))
            plan.rows_left = len(pred) - fits
            plan.tokens_left = int(total - (cum[fits - 1] if fits else 0.0))
    return plan
