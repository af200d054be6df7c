"""Library entry point: ``run_job(config)`` does what ``overnight run`` does.

    from overnight.pipeline.api import run_job
    from overnight.pipeline.configio import resolve
    summary = run_job(resolve({"input": {"path": "prompts.parquet"}, "output": {"path": "results/"}}))

``engine_factory`` is the one seam for the engine: ``factory(job) -> engine`` (see
``overnight.pipeline.engine``). Without it, ``engine.kind`` chooses vLLM or the echo engine. The factory is
called once to start the engine, and again only to restart it after a mid-run failure.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from overnight.pipeline.config import JobConfig
from overnight.pipeline.engine import EngineFactory, factory_for
from overnight.pipeline.engine.supervisor import EngineSupervisor
from overnight.pipeline.job import open_job
from overnight.pipeline.report import Summary, already_done, nothing_to_do
from overnight.pipeline.runner import Runner
from overnight.pipeline.signals import StopRequests

log = logging.getLogger("overnight")


def run_job(cfg: JobConfig, fresh: bool = False, engine_factory: Optional[EngineFactory] = None,
            is_tty: Optional[bool] = None, clock: Callable[[], float] = time.time,
            retry_errors: bool = False) -> Summary:
    """Run (or resume) a job. Job-level problems raise before the engine starts. retry_errors: a resume answers
    the rows that ended as errors again (their error rows are removed first)."""
    # SIGTERM / SIGINT while the job opens (the tokenizer's load, the input's listing, a resume's scan) is recorded
    # as during the run: the run then stops before the engine starts (Ray's workers as they start), exit 75
    signals = StopRequests().install()
    if cfg.cluster.workers:
        from overnight.pipeline.cluster.ray_job import run_on_ray
        try:
            return run_on_ray(cfg, fresh, cfg.cluster.workers, cfg.cluster.ray_address, is_tty=is_tty,
                              signals=signals, retry_errors=retry_errors)
        finally:
            signals.restore()
    try:
        job = open_job(cfg, fresh=fresh, now=clock(), retry_errors=retry_errors)
    except BaseException:
        signals.restore()
        raise
    try:
        if job.source.num_rows == 0:
            return nothing_to_do(job)
        if job.unchanged:
            return already_done(job)
        if job.scan.num_done:
            log.info("resuming %s: %d rows already done in %d parts", job.run_id, job.scan.num_done,
                     job.scan.num_parts)
        announce = f"starting vLLM with {job.model.path}" if cfg.engine.kind == "vllm" and not engine_factory else None
        supervisor = EngineSupervisor(engine_factory or factory_for(cfg), job, announce)
        return Runner(job, supervisor, is_tty=is_tty, clock=clock, signals=signals).run()
    finally:
        signals.restore()
        job.lock.release()
