"""Options shared by commands, each declared once with the config key it sets.

An ``Opt`` names the flags, the dotted config path (``scheduler.max_wait_s``),
the help and, where the command line spells a value differently from the
config, a converter. From these declarations come the Click decorators (the
groups below), the command line as a config layer (``config_layer``) and the
default shown in --help, which is read from the config dataclasses in
``overnight.pipeline.config``. An option left out is None and overrides nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import click

from overnight.buckets.dataset import DatasetError
from overnight.buckets.trained import PredictorFileError
from overnight.pipeline.output.checkpoint import OutputError
from overnight.pipeline.config import ENGINE_KINDS, ConfigError, JobConfig, Policy
from overnight.pipeline.engine import EngineError
from overnight.pipeline.tools.models import ModelError
from overnight.pipeline.input.source import InputError
from overnight.pipeline.output.storage import StorageError

# Library exceptions whose message is already written for the user.
USER_ERRORS = (ConfigError, InputError, OutputError, ModelError, StorageError, EngineError, DatasetError,
               PredictorFileError)

PRESET = "from the model's preset"


# Converters: the value given on the command line -> the config value (called only when the option is given).

def passthrough_value(text: str):
    if text in ("all", "none"):
        return text
    return [c.strip() for c in text.split(",") if c.strip()]


def duration_s(text: str, what: str = "--grace") -> float:
    from overnight.pipeline.scheduling.when import parse_budget
    return parse_budget(text, what)


def string_list(values: tuple) -> Optional[list[str]]:
    return list(values) or None


def lora_adapters(values: tuple) -> Optional[dict[str, str]]:
    """--lora NAME=PATH, repeated -> {name: path}."""
    adapters = {}
    for v in values:
        name, sep, path = v.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ConfigError(f"--lora {v}: give the adapter as NAME=PATH, e.g. --lora sql=adapters/sql-lora.")
        if name.strip() in adapters:
            raise ConfigError(f"--lora {v}: the name {name.strip()!r} is registered twice; give each adapter its "
                              f"own name.")
        adapters[name.strip()] = path.strip()
    return adapters or None


@dataclass(frozen=True)
class Opt:
    """One command-line option and the config key it sets."""
    flags: str                      # "--max-wait", or "--chat/--no-chat" for an on/off pair
    path: str                       # the config key it sets: "scheduler.max_wait_s"
    help: str
    type: Any = None                # Click type; None: the config field's type (int, float or str)
    convert: Optional[Callable[[Any], Any]] = None
    default_text: Optional[str] = None  # the default in words, where the config's default (None) says too little
    preset: bool = False            # the model's preset (configs/<alias>.yaml) may set it
    show: Optional[Callable[[Any], str]] = None  # how to write the config's default
    click_kwargs: dict = field(default_factory=dict)  # is_flag, multiple, ...

    @property
    def name(self) -> str:
        """The Python parameter name, as Click derives it from the first long flag."""
        return self.flags.split("/")[0].lstrip("-").replace("-", "_")

    def config_default(self) -> Any:
        return config_default(self.path)

    def shown_default(self) -> Optional[str]:
        """What --help says the default is; None: it says nothing."""
        value = self.config_default()
        if self.default_text is not None:
            text = self.default_text
        elif value is None or value == []:
            text = "none" if self.preset else None
        else:
            text = self.show(value) if self.show else fmt(value)
        if self.preset:
            return f"{PRESET}, else {text}" if text else PRESET
        return text

    def decorator(self) -> Callable:
        kwargs = dict(self.click_kwargs)
        if self.type is not None:
            kwargs["type"] = self.type
        elif self.convert is None and "/" not in self.flags and not kwargs.get("is_flag"):
            kwargs["type"] = field_type(self.path)
        shown = self.shown_default()
        text = f"{self.help} [default: {shown}]" if shown else self.help
        kwargs.setdefault("default", None)
        return click.option(self.flags, self.name, help=text, **kwargs)


def fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _section_field(path: str):
    cls = JobConfig
    *sections, name = path.split(".")
    for s in sections:
        cls = typing.get_type_hints(cls)[s]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if name not in fields:
        raise KeyError(f"{path}: {cls.__name__} has no field {name}")
    return cls, fields[name]


def config_default(path: str) -> Any:
    """The dataclass default of a dotted config key."""
    _, f = _section_field(path)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def field_type(path: str) -> type:
    """The scalar type of a dotted config key (Optional[...] unwrapped)."""
    cls, f = _section_field(path)
    tp = typing.get_type_hints(cls)[f.name]
    if typing.get_origin(tp) is Union:
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


INPUT = [
    Opt("--model", "engine.model", "Model alias (see `overnight models list`), local HF folder, or hub id."),
    Opt("--prompt-column", "input.prompt_column", "Column holding the prompt text."),
    Opt("--messages-column", "input.messages_column", "Column holding chats as lists of {role, content}."),
    Opt("--id-column", "input.id_column", "Column holding row ids. Without it ids are '<file>#<row>'."),
    Opt("--limit", "input.limit", "Process at most this many input rows.", type=click.IntRange(min=0)),
    Opt("--system-prompt", "prompt.system_prompt", "System message prepended to every chat."),
    Opt("--chat/--no-chat", "prompt.chat", "Apply the model's chat template.",
        default_text="on when the model has one"),
]

SAMPLING = [
    Opt("--max-tokens", "sampling.max_tokens", "Most output tokens per row.", type=click.IntRange(min=1),
        preset=True),
    Opt("--temperature", "sampling.temperature", "Sampling temperature; 0 is greedy.", preset=True),
    Opt("--top-p", "sampling.top_p", "Nucleus sampling probability mass.", preset=True),
    Opt("--top-k", "sampling.top_k", "Sample from the k most likely tokens; -1 is off.", preset=True),
    Opt("--repetition-penalty", "sampling.repetition_penalty", "Above 1 discourages repetition; 1 is off.",
        preset=True),
    Opt("--min-p", "sampling.min_p", "Leave out tokens less likely than this share of the most likely one's "
                                     "(0 to 1); 0 is off."),
    Opt("--seed", "sampling.seed", "Per-row sampling seed, for reproducible outputs.", preset=True),
    Opt("--stop", "sampling.stop", "Stop string (repeatable).", type=str, convert=string_list, preset=True,
        click_kwargs={"multiple": True}),
    Opt("--stop-token-id", "sampling.stop_token_ids", "Stop at this token id (repeatable).", type=int,
        convert=lambda v: list(v) or None, click_kwargs={"multiple": True}),
    Opt("--presence-penalty", "sampling.presence_penalty", "Penalise tokens already present (-2 to 2; 0 is off)."),
    Opt("--frequency-penalty", "sampling.frequency_penalty", "Penalise tokens by their count so far (-2 to 2)."),
    Opt("--min-tokens", "sampling.min_tokens", "Generate at least this many tokens before stopping.",
        type=click.IntRange(min=0)),
    Opt("--json-schema", "sampling.json_schema", "Structured output: every row's text is JSON valid against this "
                                                 "schema (a file, or the schema as JSON). A json_schema or "
                                                 "response_format column sets it per row."),
    Opt("--regex", "sampling.regex", "Structured output: every row's text matches this regular expression."),
    Opt("--choice", "sampling.choice", "Structured output: every row's text is one of these (a,b,c).", type=str,
        convert=lambda v: [c.strip() for c in v.split(",") if c.strip()]),
    Opt("--n", "sampling.n", "Completions per row, each an output row numbered by sample_index (needs a "
                             "temperature above 0). An n column sets it per row.", type=click.IntRange(min=1)),
    Opt("--logprobs", "sampling.logprobs", "Store the chosen tokens' logprobs and this many top alternatives per "
                                           "token (0-20) in a logprobs column. A logprobs column sets it per row.",
        type=click.IntRange(min=0), default_text="none"),
]

ENGINE = [
    Opt("--engine", "engine.kind", "vllm, or echo: a stand-in that generates no model output, for tests, fault "
                                   "injection and trying a config (OVERNIGHT_ENGINE=echo is an alias).",
        type=click.Choice(ENGINE_KINDS)),
    Opt("--echo-step-ms", "engine.echo_step_ms", "echo: how long each engine step takes, in milliseconds.",
        type=click.FloatRange(min=0)),
    Opt("--max-model-len", "engine.max_model_len", "Longest prompt + output in tokens.", preset=True,
        default_text="the model's own limit"),
    Opt("--max-num-seqs", "engine.max_num_seqs", "Most sequences the engine decodes at once.", preset=True),
    Opt("--max-num-batched-tokens", "engine.max_num_batched_tokens", "Token budget of one engine step.",
        preset=True, default_text="vLLM's"),
    Opt("--gpu-memory-utilization", "engine.gpu_memory_utilization", "GPU: fraction of memory vLLM may use."),
    Opt("--kv-cache-space", "engine.kv_cache_space_gib", "CPU: GiB of RAM for the KV cache.",
        default_text="$VLLM_CPU_KVCACHE_SPACE, else 4"),
    Opt("--enforce-eager/--no-enforce-eager", "engine.enforce_eager", "Skip graph capture.",
        default_text="on for CPU, off on GPU"),
    Opt("--tensor-parallel-size", "engine.tensor_parallel_size", "GPUs to shard the model over."),
    Opt("--prefix-caching/--no-prefix-caching", "engine.enable_prefix_caching",
        "Reuse KV cache of shared prompt prefixes."),
    Opt("--chunked-prefill/--no-chunked-prefill", "engine.enable_chunked_prefill",
        "Split long prefills across steps.", default_text="vLLM's on GPU, off on CPU"),
    Opt("--max-engine-restarts", "engine.max_restarts",
        "Restart the engine in-process this many times if it dies mid-run.", type=click.IntRange(min=0)),
    Opt("--trust-remote-code", "engine.trust_remote_code", "Allow a hub model's own Python code to run.",
        click_kwargs={"is_flag": True}),
    Opt("--lora", "engine.lora", "Register a LoRA adapter, NAME=PATH (a PEFT folder; repeatable); a row's lora "
                                 "column picks one by name, rows without one use the base model.", type=str,
        convert=lora_adapters, default_text="none", click_kwargs={"multiple": True}),
    Opt("--max-loras", "engine.max_loras", "LoRA adapters held on the device at once.", type=click.IntRange(min=1),
        default_text="all registered"),
    Opt("--max-lora-rank", "engine.max_lora_rank", "Largest LoRA rank (1, 8, 16, 32, 64, ...).",
        default_text="what the adapters need"),
]

SCHEDULE = [
    Opt("--policy", "scheduler.policy", "Order of work. auto: longest predicted first while the deadline is safe, "
                                        "most rows (or value) per token once it is at risk.",
        type=click.Choice([p.value for p in Policy])),
    Opt("--predictor", "buckets.predictor",
        "Output-length predictor: heuristic, online, or a file from `overnight predictor train`."),
    Opt("--buckets", "buckets.kind", "Bucket boundaries: log-spaced or quantiles of the predictions.",
        type=click.Choice(["log", "quantile"])),
    Opt("--deadline", "scheduler.deadline",
        "Finish by this time: ISO, local unless it has an offset (2026-11-23T06:00)."),
    Opt("--time-budget", "scheduler.time_budget", "... or within this long of the start: 90m, 1h30m, 45s."),
    Opt("--on-deadline", "scheduler.on_deadline",
        "At the deadline, let rows in flight finish (until the deadline itself) or abort them.",
        type=click.Choice(["drain", "abort"])),
    Opt("--grace", "scheduler.grace_s", "After SIGTERM / SIGINT, let rows in flight finish for this long "
                                        "(e.g. 30s, 2m), then abort them.",
        type=str, convert=duration_s, show=lambda s: f"{fmt(s)}s"),
    Opt("--safety-margin", "scheduler.safety_margin_s", "Seconds before the deadline to stop admitting rows.",
        default_text="5% of the time, 2 s to 5 min"),
    Opt("--lookahead", "scheduler.lookahead_rows", "Rows read ahead and held for ordering.",
        type=click.IntRange(min=1)),
    Opt("--max-wait", "scheduler.max_wait_s", "Aging: a row pending this many seconds goes next."),
    Opt("--sample-every", "scheduler.sample_every",
        "Where rows run by predicted length: one row in N drawn at random, for the forecast to learn from (0: none).",
        type=click.IntRange(min=0)),
    Opt("--throughput", "scheduler.tokens_per_second",
        "Output tokens/s to forecast with until measured (e.g. from `overnight tune`)."),
]

OUTPUT = [
    Opt("--passthrough", "input.passthrough", "Input columns copied to the output: all, none, or a comma list.",
        type=str, convert=passthrough_value),
    Opt("--flush-rows", "output.flush_rows", "Write a Parquet part every N finished rows.",
        type=click.IntRange(min=1)),
    Opt("--flush-seconds", "output.flush_seconds", "... or every T seconds, whichever comes first."),
    Opt("--log-every", "output.log_every_seconds",
        "Seconds between progress log lines when stderr is not a terminal."),
    Opt("--metrics-file", "output.metrics_file",
        "Write Prometheus metrics here at every flush (for node_exporter's textfile collector)."),
    Opt("--metrics-port", "output.metrics_port", "Serve Prometheus metrics on this port while the job runs.",
        type=click.IntRange(min=1, max=65535)),
    Opt("--price-per-hour", "output.price_per_hour", "What an engine-hour costs (e.g. a GPU's hourly price): "
                                                     "the summary, status and inspect show the cost.",
        type=click.FloatRange(min=0)),
]

CLUSTER = [
    Opt("--shard", "cluster.shard", "Run shard K of N of the job (K from 0, e.g. 0/4), reading only its share of the "
                                    "input; auto: K and N from a Slurm array or a Kubernetes Indexed Job."),
    Opt("--shards", "cluster.shards", "N for --shard auto in a Kubernetes Indexed Job.",
        type=click.IntRange(min=1), default_text="$OVERNIGHT_SHARDS"),
    Opt("--workers", "cluster.workers", "Run on this many Ray workers, each with its own engine, taking work "
                                        "units as they free up (pip install 'overnight[ray]').",
        type=click.IntRange(min=1), default_text="one engine, no Ray"),
    Opt("--ray-address", "cluster.ray_address", "The Ray cluster for --workers.",
        default_text="$RAY_ADDRESS, else a local one"),
]

OPTIONS = INPUT + SAMPLING + ENGINE + SCHEDULE + OUTPUT + CLUSTER
BY_NAME = {o.name: o for o in OPTIONS}
BY_PATH = {o.path: o for o in OPTIONS}
assert len(BY_NAME) == len(BY_PATH) == len(OPTIONS), "an option name or config path is declared twice"


def _stack(*decorators: Callable) -> Callable:
    def apply(f):
        for d in reversed(decorators):
            f = d(f)
        return f
    return apply


config_option = click.option(
    "--config", "config_file", type=click.Path(dir_okay=False),
    help="YAML config; keys map 1:1 onto the config dataclasses. Options given here override it. "
         "A .yaml/.yml INPUT is read as --config.")

input_options = _stack(config_option, *(o.decorator() for o in INPUT))
sampling_options = _stack(*(o.decorator() for o in SAMPLING))
engine_options = _stack(*(o.decorator() for o in ENGINE))
schedule_options = _stack(*(o.decorator() for o in SCHEDULE))
# what a dry run does not do: stop at the deadline, drain after a signal, hold rows for ordering, age them
NOT_PLANNED = ("--on-deadline", "--grace", "--lookahead", "--max-wait")
plan_schedule_options = _stack(*(o.decorator() for o in SCHEDULE if o.flags not in NOT_PLANNED))
output_options = _stack(*(o.decorator() for o in OUTPUT))
cluster_options = _stack(*(o.decorator() for o in CLUSTER))


def given(options: dict, path: str) -> Any:
    """The command line's value for a config key (converted), or None when the option was not given."""
    opt = BY_PATH[path]
    value = options.get(opt.name)
    if value is not None and opt.convert is not None:
        value = opt.convert(value)
    return value


def config_layer(input_path: Optional[str] = None, out: Optional[str] = None, **options) -> dict:
    """The command line as a config dict; options not given are None and do not override."""
    unknown = sorted(set(options) - set(BY_NAME))
    if unknown:
        raise TypeError(f"config_layer: unknown option {unknown[0]!r}")
    layer: dict = {"input": {"path": input_path}, "output": {"path": out}}
    for opt in OPTIONS:
        section, key = opt.path.split(".")
        layer.setdefault(section, {})[key] = given(options, opt.path)
    return layer


def build_config(input_path: Optional[str], out: Optional[str], config_file: Optional[str], options: dict):
    """The JobConfig for a command: defaults < model preset < YAML < OVERNIGHT_ENGINE < command line.

    A .yaml/.yml INPUT is the config file (`overnight run nightly.yaml`), unless --config is given too.
    """
    from overnight.pipeline.configio import resolve

    if input_path and input_path.endswith((".yaml", ".yml")):
        if config_file:
            raise ConfigError(f"INPUT {input_path} is a config file, and --config {config_file} is another: give "
                              f"one config, and the input as INPUT or its input.path.")
        config_file, input_path = input_path, None
    try:
        return resolve(config_layer(input_path, out, **options), config_file)
    except ConfigError as e:  # (a config file's own bad value, "FILE: key ...", is the file's)
        raise ConfigError(named_flags(str(e), options) if str(e).startswith("configuration") else str(e)) from None


def named_flags(message: str, options: dict) -> str:
    """A bad value's message names its config key; one given on the command line is named by its flag too
    ("--max-wait (scheduler.max_wait_s) is -5.0; ...")."""
    import re

    for opt in OPTIONS:
        if given(options, opt.path) is not None:
            flag = opt.flags.split("/")[0]
            message = re.sub(rf"(?<![\w.(]){re.escape(opt.path)}(?![\w.])", f"{flag} ({opt.path})", message,
                             count=1)
    return message


class ConfigUsageError(click.ClickException):
    """A bad option value or config file: exit 2, bad usage, as for the options Click checks itself."""
    exit_code = 2


def user_errors(f: Callable) -> Callable:
    """Turn the library's own exceptions into clean `Error: ...` messages (exit 2 for a config's, else 1)."""
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except ConfigError as e:
            raise ConfigUsageError(str(e)) from None
        except USER_ERRORS as e:
            raise click.ClickException(str(e)) from None
    return wrapper
