"""Library entry point: ``run_job(config)`` does what ``overnight run`` does.

    from overnight.pipeline.api import run_job
    from overnight.pipeline.configio import resolve
    summary = run_job(resolve({"input": {"path": "prompts.parquet"}, "output": {"path": "results/"}}))
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from overnight.pipeline import manifest as mf
from overnight.pipeline.config import JobConfig
from overnight.pipeline.engine import get_engine
from overnight.pipeline.job import open_job
from overnight.pipeline.report import Summary
from overnight.pipeline.runner import Runner

log = logging.getLogger("overnight")


def run_job(cfg: JobConfig, fresh: bool = False, engine=None, is_tty: Optional[bool] = None,
            clock: Callable[[], float] = time.time) -> Summary:
    """Run (or resume) a job. Job-level problems raise before the engine starts."""
    job = open_job(cfg, fresh=fresh, now=clock())
    if job.scan.num_done:
        log.info("resuming %s: %d rows already done in %d parts", job.run_id, job.scan.num_done, job.scan.num_parts)
    if engine is None:
        log.info("starting vLLM with %s", job.model.path)
        try:
            policy = "priority" if cfg.scheduler.policy in ("auto", "priority") else "fcfs"
            engine = get_engine(cfg.engine, job.model.path, policy)
        except BaseException as e:
            mf.end_attempt(job.manifest, mf.RunState.FAILED, f"engine start failed: {e}")
            job.out.write_manifest(job.manifest)
            raise
    return Runner(job, engine, is_tty=is_tty, clock=clock).run()
