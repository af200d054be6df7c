"""A dry run: predict every row's output length and forecast the job, without starting the engine."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from overnight.buckets.annotate import LengthAnnotator
from overnight.buckets.bucketing import assign, describe, quantile_bounds
from overnight.buckets.predictors import make_predictor
from overnight.pipeline.output.checkpoint import Scan
from overnight.pipeline.output import manifest as mf
from overnight.pipeline.output.layout import job_dirs
from overnight.pipeline.config import JobConfig, Policy
from overnight.pipeline.input.done_rows import done_lengths, predicted_done_rows
from overnight.pipeline.input.resume import ResumeFilter
from overnight.pipeline.input.source import open_source
from overnight.pipeline.input.stage import open_model, prepare
from overnight.pipeline.job import resolve_deadline
from overnight.pipeline.tally import Tally

log = logging.getLogger("overnight")


@dataclass
class BucketLine:
    label: str
    num_rows: int
    prompt_tokens: int
    predicted_tokens: int


@dataclass
class Plan:
    num_rows: int
    num_done: int
    num_errors: int
    num_todo: int
    predictor: str
    buckets: list[BucketLine]
    predicted_tokens: int
    tokens_per_s: Optional[float]
    throughput_source: str
    eta_s: Optional[float]
    deadline_at: Optional[float] = None
    time_left_s: Optional[float] = None
    is_feasible: Optional[bool] = None
    rows_left: Optional[int] = None
    tokens_left: Optional[int] = None
    errors: list = field(default_factory=list)
    # Rows skipped because an earlier row had the same id (as `overnight run` skips them).
    num_duplicates: int = 0
    # Seconds from the command's start to its first row in the engine, as the last run in --out measured them
    # (in eta_s, and taken from the deadline's work time); None: not known, and not counted.
    startup_s: Optional[float] = None
    # Actual over predicted output tokens of the rows done in --out (and how many), plan's own predictions of them,
    # by which the ETA and the rows a deadline leaves scale the predictions, as a run's forecast scales them by the
    # rows it finished; None: fewer than CALIBRATION_ROWS ok rows there.
    calibration: Optional[float] = None
    calibration_rows: int = 0


CALIBRATION_ROWS = 10  # ok rows done in OUT that plan's factor needs
CALIBRATION_SAMPLE = 2048  # done rows plan predicts again for it

def measured_throughput(out_url: str, kind: str = "vllm") -> Optional[float]:
    """Output tokens/s a previous run of this job measured (its status.json; a sharded job's shards together), on
    an engine of this kind (the echo engine's rate is not a model's)."""
    rates = [float((d.out.read_status() or {}).get("output_tokens_per_s") or 0) for d in job_dirs(out_url)
             if mf.engine_kind(d.out.read_manifest()) == kind]
    return sum(rates) or None


def measured_startup(out_url: str) -> Optional[float]:
    """Seconds the last run in OUT took from its start to its first row in the engine (a sharded job's slowest
    shard, a Ray job's slowest worker); None where no run there started an engine. On Ray it is short of the
    job's: a worker counts from its own start, after the driver read the input's ids and placed the workers (left
    out, it made a deadline that the start-up alone would eat look feasible)."""
    times = [((d.out.read_status() or {}).get("startup") or {}).get("first_row_s") for d in job_dirs(out_url)]
    return max((float(t) for t in times if t is not None), default=None)


def measured_calibration(cfg: JobConfig, source, model, annotator: LengthAnnotator, done: Scan,
                         out_url: str) -> tuple[Optional[float], int]:
    """Actual over predicted output tokens of ok rows done in OUT (every shard's or worker's), and how many rows:
    the predictions run short on work the predictor has not seen (32-41% on new work, docs/BENCHMARKS.md).

    Plan predicts those rows again, the first CALIBRATION_SAMPLE of them in input order, with its own predictor
    (the job's, from its prior: the online predictor's refits in the run are not there to go by), so the factor
    is this predictor's error whichever predictions the run recorded: a run of the online predictor recorded the
    prior's for its first rows and its refits' after (on 800 GSM8K rows their sum gave 1.19, where the prior's
    predictions of the same rows give 1.55 and the rest ran 1.57), and another predictor's are not this one's."""
    rows = predicted_done_rows(cfg, source, model, annotator, done, CALIBRATION_SAMPLE)
    if len(rows) < CALIBRATION_ROWS:
        return None, len(rows)
    try:
        got = done_lengths(out_url, cfg.input.id_column, [r.id for r in rows])
    except Exception as e:  # (parts whose ids are of two kinds) the factor is an aid: the plan goes on without it
        log.warning(f"the rows done in {out_url} could not be matched with their results ({type(e).__name__}: {e}); "
                    f"the predictions are not scaled by them")
        return None, 0
    n = 0 if got is None else len(got.index)
    if got is None or n < CALIBRATION_ROWS:
        return None, n
    # a row of n completions: n results, each its completion's prediction
    predicted = float(np.asarray([rows[i].predicted_tokens for i in got.index], dtype=np.float64) @ got.completions)
    actual = float(got.mean_tokens @ got.completions)
    return (actual / predicted, n) if predicted > 0 else (None, n)


def run_order(policy, work: np.ndarray, priorities: list) -> np.ndarray:
    """The rows in the order the policy runs them at a deadline it cannot meet, for what it would leave undone:
    auto and shortest-first run the shortest predicted first (auto once at risk), longest-first the longest,
    priority the lowest `priority` value first (as the scheduler runs it; then input order), fifo input order."""
    policy = Policy(policy)
    if policy in (Policy.AUTO, Policy.SHORTEST_FIRST):
        return np.argsort(work, kind="stable")
    if policy == Policy.LONGEST_FIRST:
        return np.argsort(-work, kind="stable")
    if policy == Policy.PRIORITY:
        return np.argsort(np.asarray(priorities, dtype=np.float64), kind="stable")
    return np.arange(len(work))


def make_plan(cfg: JobConfig, out: Optional[str] = None, throughput: Optional[float] = None,
              now: Optional[float] = None) -> Plan:
    now = time.time() if now is None else now
    deadline_at, margin = resolve_deadline(cfg.scheduler, now)
    source = open_source(cfg.input)
    annotator = LengthAnnotator(make_predictor(cfg.buckets.predictor), cfg.sampling.max_tokens, "log",
                                cfg.buckets.num_buckets)
    done = Scan()
    model = open_model(cfg)
    for d in job_dirs(out) if out else []:  # every shard's or worker's folder
        previous = d.out.read_manifest()
        if previous:  # a folder of other settings: the run refuses it, so its rows are not this job's done
            mf.check_resume(previous, mf.fingerprint_fields(cfg, model.requested, model.chat), d.out.url,
                            also=mf.older_fields(cfg, model.requested, model.chat),
                            fix="Plan with the settings of the run there (its options or --config; "
                                "OVERNIGHT_ENGINE=echo for a run on the echo engine) to plan what is left of it, or "
                                "leave out --out to plan the whole input.")
            d.out.scan(cfg.input.id_column, into=done)
    tally = Tally(source.num_rows)
    resume = ResumeFilter(done, tally, out or "")
    predicted, prompt_tokens, samples, priorities, caps = [], [], [], [], []
    num_errors = 0
    errors = []
    for batch in prepare(cfg, source, model, annotator, resume):
        num_errors += len(batch.errors)
        errors.extend(e.error for e in batch.errors[:5 - len(errors)])
        predicted.extend(r.predicted_tokens for r in batch.rows)
        samples.extend(r.sampling.get("n", 1) for r in batch.rows)
        caps.extend(r.sampling.get("max_tokens") or cfg.sampling.max_tokens for r in batch.rows)
        prompt_tokens.extend(r.num_prompt_tokens for r in batch.rows)
        priorities.extend(r.priority for r in batch.rows)
    num_done = tally.num_resumed
    num_duplicates = tally.num_duplicates
    pred = np.asarray(predicted, dtype=np.float64)  # a completion's; the buckets go by it
    work = pred * np.asarray(samples, dtype=np.float64)  # the row's: its n completions
    ptok = np.asarray(prompt_tokens, dtype=np.int64)
    bounds = quantile_bounds(pred, cfg.buckets.num_buckets) if cfg.buckets.kind == "quantile" else annotator.bounds
    if bounds is None:
        bounds = np.array([cfg.sampling.max_tokens])
    b = assign(pred, bounds)
    lines = [BucketLine(label, int((b == i).sum()), int(ptok[b == i].sum()), int(work[b == i].sum()))
             for i, label in enumerate(describe(bounds))]

    source_name = "none"
    tps = throughput
    if tps:
        source_name = "--throughput"
    elif cfg.scheduler.tokens_per_second:
        tps, source_name = cfg.scheduler.tokens_per_second, "config scheduler.tokens_per_second"
    elif out and measured_throughput(out, cfg.engine.kind):
        tps, source_name = measured_throughput(out, cfg.engine.kind), f"measured by the last run in {out}"
    total = float(work.sum())
    startup = measured_startup(out) if out and len(pred) else None
    factor, factor_rows = (measured_calibration(cfg, source, model, annotator, done, out)
                           if out and done.num_parts and len(pred) else (None, 0))
    if factor is not None:  # a row's scaled work is never more than its max_tokens allows
        work = np.minimum(work * factor, np.asarray(caps, dtype=np.float64) * np.asarray(samples, dtype=np.float64))
    plan = Plan(num_rows=source.num_rows, num_done=num_done, num_errors=num_errors, num_todo=len(pred),
                predictor=annotator.predictor.name, buckets=lines, predicted_tokens=int(total),
                tokens_per_s=tps, throughput_source=source_name,
                eta_s=float(work.sum()) / tps + (startup or 0.0) if tps else None, errors=errors,
                num_duplicates=num_duplicates, startup_s=startup, calibration=factor, calibration_rows=factor_rows)
    if deadline_at is not None:
        plan.deadline_at = deadline_at
        plan.time_left_s = max(0.0, deadline_at - margin - now)
        if tps:
            plan.is_feasible = plan.eta_s <= plan.time_left_s
            cum = np.cumsum(work[run_order(cfg.scheduler.policy, work, priorities)])
            work_s = max(0.0, plan.time_left_s - (startup or 0.0))  # the engine's start-up comes first
            fits = int(np.searchsorted(cum, tps * work_s, side="right"))
            plan.rows_left = len(pred) - fits
            plan.tokens_left = int((cum[-1] if len(cum) else 0.0) - (cum[fits - 1] if fits else 0.0))
    return plan
