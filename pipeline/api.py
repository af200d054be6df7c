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
from overnight.pipeline.echo_engine import engine_from_env
from overnight.pipeline.engine import get_engine, shutdown_engines
from overnight.pipeline.job import open_job
from overnight.pipeline.report import Summary
from overnight.pipeline.runner import Runner

log = logging.getLogger("overnight")


def run_job(cfg: JobConfig, fresh: bool = False, engine=None, is_tty: Optional[bool] = None,
            clock: Callable[[], float] = time.time) -> Summary:
    """Run (or resume) a job. Job-level problems raise before the engine starts."""
    job = open_job(cfg, fresh=fresh, now=clock())
    try:
        if job.source.num_rows == 0:
            return nothing_to_do(job)
        if job.scan.num_done:
            log.info("resuming %s: %d rows already done in %d parts", job.run_id, job.scan.num_done,
                     job.scan.num_parts)
        policy = "priority" if cfg.scheduler.policy in ("auto", "priority") else "fcfs"

        def fresh_engine():
            shutdown_engines()
            return get_engine(cfg.engine, job.model.path, policy)

        factory = None
        if engine is None:
            engine = engine_from_env(cfg.engine)
            factory = (lambda: engine_from_env(cfg.engine)) if engine is not None else fresh_engine
        if engine is None:
            log.info("starting vLLM with %s", job.model.path)
            try:
                engine = get_engine(cfg.engine, job.model.path, policy)
            except BaseException as e:
                mf.end_attempt(job.manifest, mf.RunState.FAILED, f"engine start failed: {e}")
                job.out.write_manifest(job.manifest)
                raise
        return Runner(job, engine, is_tty=is_tty, clock=clock, engine_factory=factory).run()
    finally:
        job.lock.release()


def nothing_to_do(job) -> Summary:
    """An empty input: no engine is started; the run is complete with no rows."""
    from overnight.pipeline.tally import Tally, summary

    message = f"nothing to do: {job.source.url} has no rows"
    log.info(message)
    mf.end_attempt(job.manifest, mf.RunState.COMPLETED, message)
    job.out.write_manifest(job.manifest)
    job.out.write_status({"state": "completed", "exit_code": 0, "message": message, "run_id": job.run_id,
                          "rows": {"total": 0, "done": 0}, "updated_at": mf.now_iso()})
    return summary(Tally(0), job.run_id, job.out.shown(), mf.RunState.COMPLETED, 0, message, {})
