"""Measure throughput over a small grid of engine settings on a sample of the dataset.

Every grid point starts a fresh engine with its max_num_batched_tokens and
max_num_seqs, runs the same sample rows to completion, and records output
tokens/s, the KV-cache capacity the engine found, and preemptions (which mean
the KV cache is too small for that many sequences of these lengths). The
search stops early when the next point would not fit in the time limit.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from overnight.pipeline.config import ConfigError, JobConfig
from overnight.pipeline.engine.vllm import VllmEngine, shutdown_engines
from overnight.pipeline.input.source import open_source
from overnight.pipeline.input.stage import open_model, prepare

log = logging.getLogger("overnight")


@dataclass
class Point:
    max_num_batched_tokens: int
    max_num_seqs: int
    tokens_per_s: Optional[float] = None
    seconds: float = 0.0
    startup_s: float = 0.0
    kv_cache_tokens: Optional[int] = None
    num_preemptions: int = 0
    error: Optional[str] = None
    refused: bool = False  # by the config, before an engine started: not measured


@dataclass
class TuneReport:
    num_rows: int
    errors: list[str] = field(default_factory=list)  # why sampled rows were left out (the first few)
    points: list[Point] = field(default_factory=list)
    skipped: list[tuple[int, int]] = field(default_factory=list)

    @property
    def best(self) -> Optional[Point]:
        ok = [p for p in self.points if p.tokens_per_s]
        return max(ok, key=lambda p: p.tokens_per_s) if ok else None


def sample_rows(cfg: JobConfig, n: int):
    """The model, the first n input rows prepared as `overnight run` prepares them (bad rows left out), and why
    the first few bad ones were."""
    limit = n if cfg.input.limit is None else min(n, cfg.input.limit)   # (--limit below --sample: the fewer)
    source = open_source(dataclasses.replace(cfg.input, limit=limit))
    model = open_model(cfg)
    rows, errors = [], []
    for batch in prepare(cfg, source, model):
        rows.extend(batch.rows)
        errors.extend(r.error for r in batch.errors[:max(0, 3 - len(errors))])
    return model, rows, errors


def measure(engine: VllmEngine, rows) -> tuple[float, int, float]:
    t0 = time.perf_counter()
    for i, r in enumerate(rows):
        engine.add(f"tune-{i}", r.prompt_token_ids, r.sampling)
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(f.num_output_tokens for f in engine.step())
    dt_s = time.perf_counter() - t0
    return tokens / dt_s, tokens, dt_s


def tune(cfg: JobConfig, batched_tokens: list[int], seqs: list[int], sample: int, time_limit_s: float,
         echo: Callable[[str], None] = log.info) -> TuneReport:
    model, rows, errors = sample_rows(cfg, sample)
    report = TuneReport(num_rows=len(rows), errors=errors)
    if not rows:
        return report
    started = time.monotonic()
    last_cost = 0.0
    grid = []
    for b, s in [(b, s) for b in batched_tokens for s in seqs]:
        try:  # a pair the config refuses (fewer batched tokens than sequences) is said before any engine starts
            grid.append((b, s, dataclasses.replace(cfg.engine, max_num_batched_tokens=b, max_num_seqs=s)))
        except ConfigError as e:
            report.points.append(Point(b, s, error=str(e), refused=True))
            echo(f"max_num_batched_tokens={b} max_num_seqs={s}: refused: {e}")
    for b, s, ecfg in grid:
        if any(not p.refused for p in report.points) and time.monotonic() - started + last_cost > time_limit_s:
            report.skipped.append((b, s))
            continue
        point = Point(b, s)
        t0 = time.monotonic()
        shutdown_engines()
        try:
            engine = VllmEngine.from_config(ecfg, model.path)
            point.startup_s = engine.startup_seconds
            point.kv_cache_tokens = engine.kv_cache_tokens
            point.tokens_per_s, _, point.seconds = measure(engine, rows)
            point.num_preemptions = engine.num_preemptions
            engine.shutdown()
        except Exception as e:  # a setting vLLM refuses (e.g. a budget below max_model_len) is a result too
            point.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        last_cost = time.monotonic() - t0
        report.points.append(point)
        if point.error:
            echo(f"max_num_batched_tokens={b} max_num_seqs={s}: failed: {point.error}")
        else:
            echo(f"max_num_batched_tokens={b} max_num_seqs={s}: {point.tokens_per_s:.1f} output tok/s "
                 f"(KV cache {point.kv_cache_tokens} tokens, {point.num_preemptions} preemptions)")
            if point.num_preemptions:
                echo(f"  warning: {point.num_preemptions} preemptions: the KV cache is too small for {s} sequences "
                     f"of these lengths; give it more room (engine: kv_cache_space_gib on a CPU, "
                     f"gpu_memory_utilization on a GPU, in a --config file) or use fewer sequences")
    return report


def preset_yaml(report: TuneReport, cfg: JobConfig, input_url: str) -> str:
    best = report.best
    assert best is not None
    when = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    lines = [
        f"# Written by `overnight tune` on {when}: best of {sum(not p.refused for p in report.points)} settings "
        f"measured on",
        f"# {report.num_rows} rows of {input_url} with model {cfg.engine.model}. Use it with --config.",
        "engine:",
        f"  model: {cfg.engine.model}",
        f"  max_num_batched_tokens: {best.max_num_batched_tokens}",
        f"  max_num_seqs: {best.max_num_seqs}",
    ]
    if cfg.engine.max_model_len:
        lines.append(f"  max_model_len: {cfg.engine.max_model_len}")
    lines += ["scheduler:", "  # measured output tokens/s: the ETA starts from it before the job measures its own",
              f"  tokens_per_second: {best.tokens_per_s:.1f}"]
    return "\n".join(lines) + "\n"
