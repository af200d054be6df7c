"""Open a job: every job-level check happens here, before the engine starts.

A missing file or column, an unreadable Parquet file, an unknown model, or an
OUT written with other settings stops the job with a message that names the
file or column and the fix; no engine time is spent on a job that cannot run.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Optional

from overnight.pipeline.config import ConfigError, JobConfig
from overnight.pipeline.input.openai_batch import is_jsonl_input
from overnight.pipeline.input.shards import FRAGMENTS, ROWS, parse_shard, rule_of
from overnight.pipeline.input.source import ParquetSource, open_source
from overnight.pipeline.input.stage import OpenModel, open_model
from overnight.pipeline.output import manifest as mf
from overnight.pipeline.output.checkpoint import OutputDir, OutputError, OutputUsageError
from overnight.pipeline.output.layout import check_layout, job_out, read_manifests
from overnight.pipeline.output.lock import LockError, RunLock
from overnight.pipeline.output.scan import Scan, id_kind
from overnight.pipeline.output.schema import OutputSchema
from overnight.pipeline.output.storage import redact

log = logging.getLogger("overnight")


@dataclass
class OpenJob:
    cfg: JobConfig
    source: ParquetSource
    out: OutputDir
    # The model's folder, tokenizer, chat mode and context (the engine's own context once it runs).
    model: OpenModel
    scan: Scan
    schema: OutputSchema
    manifest: dict
    # Seconds since the epoch by which the job must finish, and how long before it admission stops.
    deadline_at: Optional[float] = None
    margin_s: float = 0.0
    # Held while the job runs; None for read-only uses.
    lock: Optional[RunLock] = None
    # The input has not changed since this job completed: there is nothing to do, and no need to read it.
    unchanged: bool = False
    # Start the engine only once the input stage finds a row to answer (a resume, or a Ray worker, which may
    # get no unit): a rerun with nothing left starts no engine. A first attempt starts it at once, while the
    # input is read.
    lazy_engine: bool = False
    # Where the results of the rows done before are read (a resume's warm start): out's, or a Ray worker's OUT root
    results_url: Optional[str] = None

    @property
    def run_id(self) -> str:
        return self.manifest["run_id"]

    @property
    def id_name(self) -> str:
        return self.schema.id_name

    @property
    def row_model(self) -> str:
        """The model column of this job's rows: --model as OUT's settings name it (a folder by its absolute path; as
        typed in an OUT begun before stop 47), so that the rows of every attempt name it alike."""
        return (self.manifest.get("fingerprint_fields") or {}).get("model") or self.model.requested


def open_job(cfg: JobConfig, fresh: bool = False, now: Optional[float] = None, retry_errors: bool = False) -> OpenJob:
    if not cfg.output.path:
        raise ConfigError("No output folder given. Pass --out OUT (or output.path in the config).")
    deadline_at, margin_s = resolve_deadline(cfg.scheduler, time.time() if now is None else now)
    from overnight.pipeline.input.checks import job_structured
    job_structured(cfg.sampling)  # a bad --json-schema / --regex fails now, not after the engine started
    from overnight.pipeline.engine.lora import check_adapters
    check_adapters(cfg.engine)  # and so does a --lora folder that is not an adapter
    if cfg.buckets.predictor not in ("heuristic", "online"):
        from overnight.buckets.trained import TrainedPredictor
        trained = TrainedPredictor.load(cfg.buckets.predictor)  # fail now, not after the engine started
        served = getattr(trained, "meta", {}).get("served_models")
        from overnight.pipeline.tools.models import model_key
        if served and model_key(cfg.engine.model) not in {model_key(s) for s in served}:
            log.warning(f"the predictor {cfg.buckets.predictor} learned the output lengths of "
                        f"{', '.join(served)}, not of {cfg.engine.model}: another model's answers may be longer or "
                        f"shorter. Train one on runs of this model (`overnight predictor train OUT --save FILE`), "
                        f"or use --predictor online")
    shard = parse_shard(cfg.cluster.shard, cfg.cluster.shards)
    source = open_source(cfg.input, shard, recorded_split(cfg.output.path, shard, fresh))
    check_layout(cfg.output.path, shard)
    if cfg.scheduler.policy == "priority" and "priority" not in source.schema.names:
        log.warning(f"--policy priority: {source.url} has no 'priority' column, so every row has priority 0 and "
                    f"the rows run in input order, as fifo. Add the column (an integer, lower first), or choose "
                    f"another --policy")
    if shard is not None:
        sel = source.selection
        if sel.rule == ROWS:
            log.info(f"shard {shard}: {sel.how} ({source.num_rows} rows with --limit)" if cfg.input.limit
                     is not None else f"shard {shard}: {sel.how}")
        elif sel.hash_of is None:
            log.info(f"shard {shard}: {sel.how}; this shard reads {len(sel.fragments)} of them ({source.num_rows} rows)")
        else:
            log.warning(f"shard {shard}: {sel.how}; every shard reads the whole input and keeps its own rows "
                        f"({source.num_rows} here). Write the input as at least {shard.n} files or row groups so "
                        f"that each shard reads only its share")
    out = job_out(cfg.output.path, shard)
    model = open_model(cfg)
    fields = mf.fingerprint_fields(cfg, model.requested, model.chat)
    lock = RunLock(out)
    lock.acquire()
    try:
        job = _open_locked(cfg, fresh, source, out, model, fields, lock, deadline_at, margin_s,
                           retry_errors=retry_errors)
        try:  # a job of another split (an unsharded run beside a shard's) may have begun in OUT since the check
            check_layout(cfg.output.path, shard)
        except OutputError:
            if len(job.manifest["attempts"]) == 1 and not job.scan.num_done:  # begun just now: as if never begun
                out.clear()
            raise
        return job
    except BaseException:
        lock.release()
        raise


def _open_locked(cfg, fresh, source, out, model, fields, lock, deadline_at, margin_s,
                 shortcut: bool = True, retry_errors: bool = False) -> OpenJob:
    """shortcut: a completed job over an unchanged input may skip the scan of its parts (``unchanged``). A Ray
    worker's folder is not a job of its own (its units change from run to run), so a worker passes False.
    retry_errors: the parts' error rows are removed first, so that the run answers those rows again."""
    given = mf.older_fields(cfg, model.requested, model.chat)  # as OUTs before stops 37 and 45 had them
    _check_other_shards(cfg, source, out, fields, given, fresh)
    if out.remove_leftovers():
        log.info("removed the temporary files of a run killed while it wrote in %s", out.shown())
    previous = out.read_manifest()
    if fresh:
        _still_ours(lock, out)
        if previous or out.part_paths():
            log.info("--fresh: discarding the results in %s", out.url)
        out.clear()
        previous = None
    elif previous is not None:
        mf.check_resume(previous, fields, out.url, also=given)
    elif out.part_paths():
        raise OutputError(f"{out.url} holds result parts but no manifest.json, so they cannot be trusted for a "
                          f"resume. Pass --fresh to discard them, or choose another --out.")
    if retry_errors and previous is not None:
        _still_ours(lock, out)
        if retry_dropped(out, cfg.input.id_column):
            shortcut = False
            previous = out.read_manifest()

    id_name = cfg.input.id_column
    stamp = source.input_stamp()
    unchanged = (shortcut and previous is not None and previous.get("state") == mf.RunState.COMPLETED.value
                 and previous.get("input", {}).get("stamp") == stamp
                 # and its parts are all there (a part deleted to redo its rows, as a bad part's message says),
                 # as they were (none truncated or replaced since: an OUT before stop 43 records no digest)
                 and len(out.part_paths()) == previous.get("counts", {}).get("num_parts")
                 and previous.get("parts_digest") in (None, out.parts_digest()))
    # A completed job over an unchanged input needs no scan of its parts (at 10M rows that takes seconds).
    scan = out.scan(id_name) if previous is not None and not unchanged else Scan()
    _check_id_kind(scan, source, id_name)
    passthrough = [_as_output(source.schema.field(c), cfg.input) for c in source.passthrough_columns()]
    names = source.schema.names
    before = None if previous is None else (previous.get("input") or {}).get("renamed") or {}
    schema = OutputSchema(id_name, source.id_type, passthrough, samples=cfg.sampling.n > 1 or "n" in names,
                          logprobs=cfg.sampling.logprobs is not None or "logprobs" in names, renamed_before=before)
    input_info = {"url": redact(source.url), "num_files": len(source.files), "num_rows": source.num_rows,
                  "stamp": stamp, "cwd": os.getcwd(),  # where a relative input path is (export reads it again)
                  "jsonl": is_jsonl_input(cfg.input.path),  # request lines: export's word when they moved
                  # the output's sample_index and logprobs columns (also from the input's n and logprobs columns):
                  # inspect shows them before the first part is written
                  "samples": schema.samples, "logprobs": schema.logprobs}
    renamed = {k: v for k, v in schema.renames.items() if k != v}
    if renamed:  # input columns the output holds under another name (``text`` as ``input_text``)
        input_info["renamed"] = renamed
    if source.shard is not None:
        input_info["shard"] = str(source.shard)
        input_info["split"] = source.selection.how
        input_info["split_rule"] = source.selection.rule
        input_info["listing"] = source.listing_digest(versions=False)   # (what a shard before stop 45 compares)
        input_info["listing_versions"] = source.listing_digest()
    cfg_dict = cfg.to_dict()
    cfg_dict["input"]["path"] = redact(cfg_dict["input"]["path"] or "")
    cfg_dict["output"]["path"] = redact(cfg_dict["output"]["path"] or "")
    manifest = previous or mf.new_manifest(cfg_dict, fields, input_info)
    mf.start_attempt(manifest, cfg_dict, input_info)
    lock.name_run(manifest["run_id"])
    if not unchanged:
        manifest["counts"] = counts_from_scan(scan, source.num_rows)
    _still_ours(lock, out)
    out.write_manifest(manifest)
    if source.shard is not None:
        try:
            _check_split(cfg, source, out)
        except OutputError:
            if previous is None:  # begun just now (nothing but the manifest written): as if it never began
                out.clear()
            raise
    return OpenJob(cfg, source, out, model, scan, schema, manifest, deadline_at, margin_s, lock,
                   unchanged=unchanged, lazy_engine=scan.num_done > 0)


def retry_dropped(out, id_column: str) -> int:
    """--retry-errors: the error rows removed from ``out``'s parts (said in the log), which the run answers again."""
    dropped, parts = out.drop_errors(id_column)
    if dropped:
        log.info(f"--retry-errors: {dropped} error rows removed from {parts} parts of {out.shown()}; they run again")
    return dropped


def _still_ours(lock, out) -> None:
    """Asked just before the first writes (the manifest; --fresh's clearing): whether this run still holds OUT.
    The scan before them may take long, and a Ray worker's folder is the driver's until the driver loses OUT or
    gives the worker up."""
    if not lock.confirm():
        raise LockError(f"another run took over {out.shown()} ({lock.taken_by()}) while this run opened it: "
                        f"nothing was written. Let that run finish, or stop it before you run again.")


def _check_id_kind(scan: Scan, source, id_name: str) -> None:
    """The input's ids are of the kind the parts hold: an id of another kind (1 and "1") never matches, and every
    row would be answered again."""
    want = id_kind(source.id_type)
    for kind, part in scan.id_kinds.items():
        if kind != want:
            raise OutputError(f"{part} holds {kind} ids, but the input's {id_name} column is now {source.id_type}: "
                              f"ids of another kind never match the rows already done, so every row would be "
                              f"answered again. Give the column its {kind} ids back (cast it), or pass --fresh to "
                              f"answer every row again.")


def recorded_split(url: str, shard, fresh: bool) -> str:
    """The rule that splits the input among this job's shards: this shard's own, as it began (an OUT begun before
    stop 42 keeps the old rule: a shard resumes on its own, and a new rule would move rows between shards); for a
    shard that has none yet, or starts over with --fresh, the other shards' in OUT; else equal row ranges. Shards
    that disagree are refused (``_check_split``)."""
    if shard is None:
        return ROWS
    mine = job_out(url, shard).root
    found = [(d, m) for d, m in read_manifests(url) if m is not None and d.shard is not None]
    own = [m for d, m in found if d.out.root == mine]
    if own and not fresh:
        return rule_of(own[0].get("input"))
    return next((rule_of(m.get("input")) for d, m in found if d.out.root != mine), ROWS)


def _check_split(cfg, source, out, manifests=None) -> None:
    """Every shard in OUT splits the input by the rule this one does: shards of two rules would miss some rows
    and answer others twice. Asked before this shard writes (``manifests``: OUT's, as read then), and again just
    after it wrote its manifest, which catches shards started over at once with --fresh, each from the other's
    old manifest."""
    mine = source.selection.rule
    for d, m in (read_manifests(cfg.output.path) if manifests is None else manifests):
        if m is None or d.shard is None or d.out.root == out.root:
            continue
        theirs = rule_of(m.get("input"))
        if theirs != mine:
            raise OutputUsageError(
                f"Shard {d.label} of this job in {cfg.output.path} split the input by {SPLITS[theirs]}, and shard "
                f"{source.shard} by {SPLITS[mine]}: together they would miss some rows and answer others twice. "
                f"Run shard {source.shard} again with --fresh, alone: it then splits as the others do.")


SPLITS = {ROWS: "equal row ranges", FRAGMENTS: "whole files and row groups (the rule of an older overnight)"}


def _check_other_shards(cfg, source, out, fields, given, fresh: bool = False) -> None:
    """Every shard of a job runs with the same settings, over the same input listing (the split is computed
    from it: a file added or grown would move rows between shards, whose resumes are their own). With --fresh a
    shard starts over with new settings: the others follow with --fresh (each then checks against those that went
    first). Not with a new input: a shard not run again would keep rows of the old split, so every shard refuses
    one until OUT is emptied."""
    if source.shard is None:
        return
    manifests = read_manifests(cfg.output.path)
    _check_split(cfg, source, out, manifests)
    listings = {"listing_versions": source.listing_digest(), "listing": source.listing_digest(versions=False)}
    for d, m in manifests:
        if m is None or d.shard is None:
            continue
        if d.out.root != out.root and not fresh and not mf.same_settings(m, fields, given):
            raise OutputUsageError(f"Shard {d.label} of this job in {cfg.output.path} ran with other settings "
                              f"({mf.differences(m, fields)}); every shard of a job must run with the same "
                              f"settings. Rerun with theirs, run every shard again with --fresh to answer all "
                              f"with these, or choose another --out.")
        key = "listing_versions" if m.get("input", {}).get("listing_versions") else "listing"
        theirs = m.get("input", {}).get(key)
        if theirs and theirs != listings[key] and not (fresh and d.out.root == out.root):  # (its own: cleared)
            raise OutputUsageError(
                f"The input {source.url} has changed since shard {d.label} of this job ran (files or row groups "
                f"were added, removed or rewritten: a file's size, or its ETag or modification time, differs; "
                f"every shard must read the same files). The shards split the input by its listing, so a change "
                f"would move rows between shards, and --fresh clears one shard's folder only: finish the job with "
                f"the input as it was, or answer the new input in another --out (or after removing {cfg.output.path}).")


MAX_BUDGET_S = 366 * 86400.0


def resolve_deadline(sc, now: float) -> tuple[Optional[float], float]:
    """(deadline as seconds since the epoch, safety margin in seconds), or (None, 0) without one."""
    from overnight.pipeline.scheduling.when import parse_budget, parse_deadline

    if sc.deadline:
        at = parse_deadline(sc.deadline, now)
    elif sc.time_budget:
        budget = parse_budget(sc.time_budget, "--time-budget (scheduler.time_budget)")
        if not 0 < budget <= MAX_BUDGET_S:  # 0: a rerun would stop at once, exit 75, every time
            raise ConfigError(f"--time-budget {sc.time_budget} must be above 0 and at most a year; give e.g. 90m, or "
                              f"leave it out for no deadline.")
        at = now + budget
    else:
        return None, 0.0
    margin = sc.safety_margin_s if sc.safety_margin_s is not None else min(300.0, max(2.0, 0.05 * (at - now)))
    if sc.time_budget and not sc.deadline and at - margin <= now:  # it would stop at once, on every rerun
        raise ConfigError(f"--time-budget {sc.time_budget} is not longer than the safety margin ({margin:g} s, "
                          f"scheduler.safety_margin_s): the job would stop as it starts. Give a longer budget or "
                          f"a smaller margin.")
    if sc.deadline and at - margin <= now:  # the same: exit 75 at once, and "rerun to continue" again
        raise ConfigError(f"--deadline {sc.deadline} is {at - now:.0f} s away, within the safety margin "
                          f"({margin:g} s, scheduler.safety_margin_s): the job would stop as it starts. Give a later "
                          f"deadline or a smaller --safety-margin.")
    return at, margin


def counts_from_scan(scan: Scan, num_rows: int) -> dict:
    return {"num_rows": num_rows, "num_done": scan.num_done, "num_ok": scan.num_ok, "num_error": scan.num_error,
            "num_output_tokens": scan.num_output_tokens, "num_parts": scan.num_parts}


def _as_output(f, icfg):
    """A passed-through input column as the output holds it: the prompt or chat column stored as bytes (text
    written without Parquet's UTF8 annotation, which validate reads as text) as the text it is."""
    import pyarrow as pa

    if f.name in (icfg.prompt_column, icfg.messages_column) and (pa.types.is_binary(f.type)
                                                                  or pa.types.is_large_binary(f.type)):
        return f.with_type(pa.string())
    return f
