"""What the Ray driver does before any worker starts: check the worker folders against this run's settings, reach
(or start) the Ray cluster, and give the workers their config. ``ray_job.run_on_ray`` calls them while it holds
OUT's lock."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from overnight.pipeline.output.layout import job_dirs


def check_worker_folders(cfg, fresh: bool, model, retry_errors: bool) -> bool:
    """Clear them (--fresh), or check that each resumes with this run's settings (a rerun with other settings is
    refused before any worker starts: one whose folder is new would run the rest with the new settings), and with
    --retry-errors drop their error rows. True when a folder was fingerprinted --json-schema by its path (before
    stop 37)."""
    if fresh:
        for d in job_dirs(cfg.output.path):
            d.out.clear()
        return False
    from overnight.pipeline.output import manifest as mf

    legacy = False
    fields = mf.fingerprint_fields(cfg, model.requested, model.chat)
    given = mf.older_fields(cfg, model.requested, model.chat)
    for d in job_dirs(cfg.output.path):
        previous = d.out.read_manifest()
        if previous is not None:
            mf.check_resume(previous, fields, d.out.url, also=given)
            legacy = legacy or mf.schema_by_path(previous, cfg, model.requested, model.chat)
    if retry_errors:  # every folder checked first; the workers start after
        from overnight.pipeline.job import retry_dropped
        for d in job_dirs(cfg.output.path):
            retry_dropped(d.out, cfg.input.id_column)
    return legacy


def connect(ray, address: Optional[str], workers: int) -> None:
    """Join the cluster at ``address`` (or RAY_ADDRESS), or start a local one with a slot for every worker, even
    beyond the machine's cores (echo engines, or small models sharing the cores); a real cluster offers what it
    has. One that cannot be reached is an EngineError (exit 69, as an engine that cannot start)."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    cpus = None if address else max(os.cpu_count() or 1, workers)
    from overnight.pipeline.cluster.address import unreachable

    try:
        why = unreachable(address)
        if why:
            raise ConnectionError(why)
        ray.init(address=address, num_cpus=cpus, include_dashboard=False, log_to_driver=True,
                 configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        from overnight.pipeline.engine import EngineError
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise EngineError(f"Cannot reach the Ray cluster at {address} ({why}). Start it (`ray start --head` on its "
                          f"head node), give its address with --ray-address or RAY_ADDRESS, or leave both out to "
                          f"start a local cluster on this machine; nothing was run.") from None


def worker_config(cfg, deadline_at: Optional[float], margin: float, legacy: bool):
    """The job's config as each worker runs it. legacy: a worker folder fingerprinted --json-schema by its path."""
    import json

    from overnight.pipeline.report import iso
    from overnight.pipeline.tools.models import model_key

    # Every worker gets the same absolute deadline and margin.
    sc = dataclasses.replace(cfg.scheduler, deadline=iso(deadline_at) if deadline_at else None, time_budget=None,
                             safety_margin_s=margin if deadline_at else cfg.scheduler.safety_margin_s)
    # A worker holds no more rows than its engine runs plus one refill: what it does not hold stays in the
    # queue for whichever worker frees up first.
    sc = dataclasses.replace(sc, lookahead_rows=min(sc.lookahead_rows, 2 * cfg.engine.max_num_seqs))
    # the driver logs the job's progress and writes its metrics, a worker neither; a model folder goes by its
    # absolute path, as the driver read it (a worker's process may run in another folder)
    wcfg = dataclasses.replace(cfg, scheduler=sc, engine=dataclasses.replace(cfg.engine, model=model_key(
        cfg.engine.model)), output=dataclasses.replace(cfg.output, log_every_seconds=1e9, metrics_file=None,
                                                       metrics_port=None))
    if cfg.sampling.json_schema is not None and not legacy:
        # the schema itself: a worker on another node may not see the file (a folder fingerprinted by the
        # file's path before keeps getting the path, which its fingerprint matches)
        from overnight.pipeline.input.checks import job_structured
        wcfg = dataclasses.replace(wcfg, sampling=dataclasses.replace(
            cfg.sampling, json_schema=json.dumps(job_structured(cfg.sampling)["json"])))
    return wcfg


def nothing_to_do(cfg, root, source, model, workers: int):
    """An input with no rows (or --limit 0): no Ray, no worker; the job is complete, as on one engine. Its first
    worker folder gets the manifest of a completed job of no rows (so that `inspect` and `export` read OUT as a
    job on Ray workers, and a rerun with rows continues it there)."""
    import logging
    import time

    from overnight.pipeline.output import manifest as mf
    from overnight.pipeline.output.layout import worker_out
    from overnight.pipeline.output.metrics import Published
    from overnight.pipeline.report import Summary, iso

    why = "--limit 0 takes no rows" if cfg.input.limit == 0 else f"{source.url} has no rows"
    message = f"nothing to do: {why}"
    logging.getLogger("overnight").info(message)
    folder = worker_out(cfg.output.path, 0)
    if folder.read_manifest() is None:
        cfg_dict = cfg.to_dict()
        info = {"url": source.url, "num_files": len(source.files), "num_rows": 0, "cwd": os.getcwd()}
        m = mf.start_attempt(mf.new_manifest(cfg_dict, mf.fingerprint_fields(cfg, model.requested, model.chat), info),
                             cfg_dict, info)
        m["counts"] = {"num_rows": 0, "num_ok": 0, "num_error": 0, "num_done": 0, "num_output_tokens": 0,
                       "num_parts": 0}
        folder.write_manifest(mf.end_attempt(m, mf.RunState.COMPLETED, message))
    status = {"state": "completed", "exit_code": 0, "message": message, "out": root.shown(), "workers": workers,
              "rows": {"total": 0, "done": 0, "remaining": 0}, "eta_s": 0.0, "per_worker": {},
              "updated_at": iso(time.time())}
    Published(root, dataclasses.replace(cfg.output, metrics_port=None))(status)  # its --metrics-file says so too
    return Summary(run_id=f"ray-{workers}-workers", out=root.shown(), state="completed", exit_code=0, num_rows=0,
                   num_done=0, num_ok=0, num_error=0, num_resumed=0, num_duplicates=0, num_output_tokens=0,
                   elapsed_s=0.0, output_tokens_per_s=0.0, message=message, extra={})