"""The input stage, written once for run, plan and tune.

    model = open_model(cfg)                      # the model's folder, tokenizer, chat mode and context
    for batch in prepare(cfg, source, model, ...):
        batch.rows                               # ready for the engine: parsed, tokenized, predicted
        batch.errors                             # bad rows, as error results that name the file and row

A source batch is parsed and validated (``validate``), rows already done are left out (``resume``, when a
filter is given), prompts are rendered with the chat template and tokenized (``prompts``), and each row's
output length is predicted (``buckets/``, when an annotator is given).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from overnight.pipeline.config import JobConfig
from overnight.pipeline.input.openai_batch import model_route
from overnight.pipeline.input.prompts import PromptBuilder, has_chat_template
from overnight.pipeline.input.resume import reads_every_row
from overnight.pipeline.input.source import ParquetSource
from overnight.pipeline.input.validate import parse_batch, sampling_defaults
from overnight.pipeline.records import Result, Row
from overnight.pipeline.tools.models import ModelError, ResolvedModel, load_tokenizer, resolve

# The context assumed for a hub model whose config cannot be read before the engine starts.
FALLBACK_CONTEXT = 2048


@dataclass
class OpenModel:
    resolved: ResolvedModel
    tokenizer: Any
    # Apply the chat template (config, else: the tokenizer has one).
    chat: bool
    # Longest prompt + output: engine.max_model_len, else the model's own context. A running engine's own
    # value replaces it (see with_context).
    max_model_len: int
    # False when max_model_len is a guess (FALLBACK_CONTEXT: a hub model, an unreadable config.json): then
    # only a running engine can say, and prompts are checked against the engine's.
    context_known: bool = True

    @property
    def requested(self) -> str:
        """The model as the user named it (alias, folder or hub id)."""
        return self.resolved.requested

    @property
    def path(self) -> str:
        """What vLLM loads: a local folder or a hub id."""
        return self.resolved.path

    def with_context(self, max_model_len: int) -> "OpenModel":
        return OpenModel(self.resolved, self.tokenizer, self.chat, max_model_len)


@dataclass
class Prepared:
    rows: list[Row] = field(default_factory=list)
    errors: list[Result] = field(default_factory=list)


def open_model(cfg: JobConfig) -> OpenModel:
    """Resolve the model and load its tokenizer; the job-level checks on the model happen here."""
    model = resolve(cfg.engine.model)
    tokenizer = load_tokenizer(model, trust_remote_code=cfg.engine.trust_remote_code)
    chat = cfg.prompt.chat if cfg.prompt.chat is not None else has_chat_template(tokenizer)
    if chat and not has_chat_template(tokenizer):
        raise ModelError(f"Model {model.requested} has no chat template, so --chat cannot apply one. "
                         f"Run with --no-chat to send prompts as plain text.")
    own = None if cfg.engine.max_model_len else model_context(model)
    return OpenModel(model, tokenizer, chat, cfg.engine.max_model_len or own or FALLBACK_CONTEXT,
                     context_known=bool(cfg.engine.max_model_len or own))


def model_context(model: ResolvedModel) -> Optional[int]:
    """The model's own context length, from its config.json (what vLLM uses when max_model_len is unset);
    None when it cannot be read here (a hub model)."""
    if model.is_hub:
        return None
    try:
        with open(os.path.join(model.path, "config.json")) as f:
            value = json.load(f).get("max_position_embeddings")
        return int(value) if value else None
    except (OSError, ValueError):
        return None


def prepare(cfg: JobConfig, source: ParquetSource, model: OpenModel, annotator=None, resume=None,
            passthrough=(), tally=None) -> Iterator[Prepared]:
    """Engine-ready rows and error results, one source batch at a time.

    annotator: a ``LengthAnnotator`` that predicts each row's output length; resume: a ``ResumeFilter`` that
    leaves out rows already done and duplicate ids; tally: counts rows read and predicted tokens."""
    builder = PromptBuilder(model.tokenizer, model.chat, cfg.prompt.system_prompt, model.max_model_len)
    if annotator is not None:
        annotator.bind(model.tokenizer)  # a trained predictor's token model needs the tokenizer it was fitted on
    defaults = sampling_defaults(cfg.sampling)
    route = model_route(cfg, model)  # an OpenAI Batch line's body.model may pick a --lora adapter

    def read():
        for sb in source.batches():
            if tally is not None:
                tally.num_read += sb.batch.num_rows
            yield route(sb)

    batches = read()
    if resume is not None:
        # Whole batches at once (some 16k rows), before the per-row parse: a rerun over rows already done parses
        # none of them in Python.
        batches = resume.filter_batches(batches, cfg.input)
    for sb in batches:
        parsed, errors = parse_batch(sb, cfg.input, defaults, passthrough, cfg.engine.lora)
        rows, texts, bad = builder.build(parsed)
        if annotator is not None:
            annotator.annotate(rows, texts)
        if tally is not None:
            tally.observe_predictions(rows)
        yield Prepared(rows, errors + bad)
    if resume is not None:  # the whole input read: the rows done before that it no longer holds are known now,
        # and counted out of the rows done (not at the job's end only: status would say none left meanwhile)
        resume.report_removed(not reads_every_row(source, cfg.input))
