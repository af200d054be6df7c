"""Option groups shared by commands, and the mapping from options to the config dict."""

from __future__ import annotations

import functools
from typing import Callable

import click

from overnight.buckets.dataset import DatasetError
from overnight.buckets.trained import PredictorFileError
from overnight.pipeline.output.checkpoint import OutputError
from overnight.pipeline.config import ConfigError
from overnight.pipeline.engine import EngineError
from overnight.pipeline.tools.models import ModelError
from overnight.pipeline.input.source import InputError
from overnight.pipeline.output.storage import StorageError

# Library exceptions whose message is already written for the user.
USER_ERRORS = (ConfigError, InputError, OutputError, ModelError, StorageError, EngineError, DatasetError,
               PredictorFileError)


def _stack(*decorators: Callable) -> Callable:
    def apply(f):
        for d in reversed(decorators):
            f = d(f)
        return f
    return apply


input_options = _stack(
    click.option("--config", "config_file", type=click.Path(dir_okay=False),
                 help="YAML config; keys map 1:1 onto the config dataclasses. Options given here override it."),
    click.option("--model", help="Model alias (see `overnight models list`), local HF folder, or hub id. "
                                 "[default: smollm2-135m]"),
    click.option("--prompt-column", help="Column holding the prompt text. [default: prompt]"),
    click.option("--messages-column", help="Column holding chats as lists of {role, content}. [default: messages]"),
    click.option("--id-column", help="Column holding row ids. Without it ids are '<file>#<row>'. [default: id]"),
    click.option("--limit", type=click.IntRange(min=0), help="Process at most this many input rows."),
    click.option("--system-prompt", help="System message prepended to every chat."),
    click.option("--chat/--no-chat", default=None,
                 help="Apply the model's chat template. [default: on when the model has one]"),
)

sampling_options = _stack(
    click.option("--max-tokens", type=click.IntRange(min=1), help="Most output tokens per row."),
    click.option("--temperature", type=float, help="Sampling temperature; 0 is greedy."),
    click.option("--top-p", type=float, help="Nucleus sampling probability mass."),
    click.option("--top-k", type=int, help="Sample from the k most likely tokens; -1 is off."),
    click.option("--repetition-penalty", type=float, help="Above 1 discourages repetition; 1 is off."),
    click.option("--seed", type=int, help="Per-row sampling seed, for reproducible outputs."),
    click.option("--stop", multiple=True, help="Stop string (repeatable)."),
)

engine_options = _stack(
    click.option("--max-model-len", type=int, help="Longest prompt + output in tokens."),
    click.option("--max-num-seqs", type=int, help="Most sequences the engine decodes at once."),
    click.option("--max-num-batched-tokens", type=int, help="Token budget of one engine step."),
    click.option("--gpu-memory-utilization", type=float, help="GPU: fraction of memory vLLM may use."),
    click.option("--kv-cache-space", "kv_cache_space_gib", type=float, help="CPU: GiB of RAM for the KV cache."),
    click.option("--enforce-eager/--no-enforce-eager", default=None,
                 help="Skip graph capture. [default: on for CPU, off on GPU]"),
    click.option("--tensor-parallel-size", type=int, help="GPUs to shard the model over."),
    click.option("--prefix-caching/--no-prefix-caching", "enable_prefix_caching", default=None,
                 help="Reuse KV cache of shared prompt prefixes. [default: on]"),
    click.option("--chunked-prefill/--no-chunked-prefill", "enable_chunked_prefill", default=None,
                 help="Split long prefills across steps. [default: vLLM's on GPU, off on CPU]"),
    click.option("--max-engine-restarts", "max_restarts", type=click.IntRange(min=0),
                 help="Restart the engine in-process this many times if it dies mid-run. [default: 0]"),
    click.option("--trust-remote-code", is_flag=True, default=None,
                 help="Allow a hub model's own Python code to run. Off unless given."),
)


schedule_options = _stack(
    click.option("--policy", type=click.Choice(["auto", "fifo", "longest-first", "shortest-first", "priority"]),
                 help="Order of work. auto: longest predicted first while the deadline is safe, most rows (or "
                      "value) per token once it is at risk. [default: auto]"),
    click.option("--predictor", help="Output-length predictor: heuristic, online, or a file from "
                                     "`overnight predictor train`. [default: online]"),
    click.option("--buckets", "bucket_kind", type=click.Choice(["log", "quantile"]),
                 help="Bucket boundaries: log-spaced or quantiles of the predictions. [default: log]"),
    click.option("--deadline", help="Finish by this time: ISO, local unless it has an offset (2026-11-23T06:00)."),
    click.option("--time-budget", help="... or within this long of the start: 90m, 1h30m, 45s."),
    click.option("--on-deadline", type=click.Choice(["drain", "abort"]),
                 help="At the deadline, let rows in flight finish (until the deadline itself) or abort them. "
                      "[default: drain]"),
    click.option("--grace", help="After SIGTERM / SIGINT, let rows in flight finish for this long (e.g. 30s), then "
                                 "abort them. [default: 30s]"),
    click.option("--safety-margin", "safety_margin_s", type=float,
                 help="Seconds before the deadline to stop admitting rows. [default: 5% of the time, 2 s to 5 min]"),
    click.option("--lookahead", "lookahead_rows", type=click.IntRange(min=1),
                 help="Rows read ahead and held for ordering. [default: 10000]"),
    click.option("--max-wait", "max_wait_s", type=float,
                 help="Aging: a row pending this many seconds goes next. [default: 1800]"),
    click.option("--throughput", "tokens_per_second", type=float,
                 help="Output tokens/s to forecast with until measured (e.g. from `overnight tune`)."),
)


def parse_grace(text):
    if text is None:
        return None
    from overnight.pipeline.scheduling.deadline import parse_budget
    return parse_budget(text)


def passthrough_value(text):
    if text is None:
        return None
    if text in ("all", "none"):
        return text
    return [c.strip() for c in text.split(",") if c.strip()]


def config_layer(input_path=None, out=None, **o) -> dict:
    """The command line as a config dict; unset options are None and do not override."""
    return {
        "input": {
            "path": input_path,
            "prompt_column": o.get("prompt_column"),
            "messages_column": o.get("messages_column"),
            "id_column": o.get("id_column"),
            "limit": o.get("limit"),
            "passthrough": passthrough_value(o.get("passthrough")),
        },
        "prompt": {"chat": o.get("chat"), "system_prompt": o.get("system_prompt")},
        "sampling": {
            "max_tokens": o.get("max_tokens"),
            "temperature": o.get("temperature"),
            "top_p": o.get("top_p"),
            "top_k": o.get("top_k"),
            "repetition_penalty": o.get("repetition_penalty"),
            "seed": o.get("seed"),
            "stop": list(o["stop"]) if o.get("stop") else None,
        },
        "engine": {
            "model": o.get("model"),
            "max_model_len": o.get("max_model_len"),
            "max_num_seqs": o.get("max_num_seqs"),
            "max_num_batched_tokens": o.get("max_num_batched_tokens"),
            "gpu_memory_utilization": o.get("gpu_memory_utilization"),
            "kv_cache_space_gib": o.get("kv_cache_space_gib"),
            "enforce_eager": o.get("enforce_eager"),
            "tensor_parallel_size": o.get("tensor_parallel_size"),
            "enable_prefix_caching": o.get("enable_prefix_caching"),
            "enable_chunked_prefill": o.get("enable_chunked_prefill"),
            "trust_remote_code": o.get("trust_remote_code"),
            "max_restarts": o.get("max_restarts"),
        },
        "buckets": {"predictor": o.get("predictor"), "kind": o.get("bucket_kind")},
        "scheduler": {
            "policy": o.get("policy"),
            "deadline": o.get("deadline"),
            "time_budget": o.get("time_budget"),
            "on_deadline": o.get("on_deadline"),
            "safety_margin_s": o.get("safety_margin_s"),
            "lookahead_rows": o.get("lookahead_rows"),
            "max_wait_s": o.get("max_wait_s"),
            "tokens_per_second": o.get("tokens_per_second"),
            "grace_s": parse_grace(o.get("grace")),
        },
        "output": {
            "path": out,
            "flush_rows": o.get("flush_rows"),
            "flush_seconds": o.get("flush_seconds"),
            "log_every_seconds": o.get("log_every"),
        },
    }


def user_errors(f: Callable) -> Callable:
    """Turn the library's own exceptions into clean `Error: ...` messages."""
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except USER_ERRORS as e:
            raise click.ClickException(str(e)) from None
    return wrapper
