"""The engine room: the vLLM adapter, the echo stand-in, the supervisor that restarts a dead engine, and the
reaper that outlives a killed job.

An engine is anything with vLLM's add/step/abort shape:

    add(request_id, prompt_token_ids, sampling: dict, priority=0)
    step() -> list[Finished]          # one engine step; the rows that finished in it
    abort(request_ids)
    has_unfinished() -> bool
    shutdown()
    max_num_seqs, max_model_len, supports_priority, kv_cache_tokens, num_preemptions
    context_term                      # optional: (rho, on), what a token of context costs a step against the
                                      # weights and the part it scales (StepCost; VllmEngine's from the model's
                                      # config, else no term)

``run_job(cfg, engine_factory=...)`` takes a factory, ``factory(job) -> engine``: the one seam through which
tests, benchmarks and scale-out workers hand the loop an engine. Without one, ``engine.kind`` chooses.
"""

from __future__ import annotations

from typing import Any, Callable

EngineFactory = Callable[[Any], Any]  # (OpenJob) -> engine


class EngineError(Exception):
    "The engine failed to start or died; the message says what happened."


def scheduling_policy(cfg) -> str:
    """vLLM's scheduling policy for a job: its priority scheduler when overnight hands it priorities."""
    return "priority" if cfg.scheduler.policy in ("auto", "priority") else "fcfs"


def factory_for(cfg) -> EngineFactory:
    """The engine that ``engine.kind`` names: vllm (the default) or echo (tests, fault injection)."""
    if cfg.engine.kind == "echo":
        from overnight.pipeline.engine.echo import EchoEngine

        return lambda job: EchoEngine.from_config(job.cfg.engine)
    from overnight.pipeline.engine.vllm import get_engine

    return lambda job: get_engine(job.cfg.engine, job.model.path, scheduling_policy(job.cfg))
