"""`overnight plan`: a dry run that forecasts a job without starting the engine."""

from __future__ import annotations

import json
from dataclasses import asdict

import click

from overnight.jobs.options import (build_config, given, input_options, plan_schedule_options, sampling_options,
                                    user_errors)
from overnight.pipeline.config import Policy
from overnight.pipeline.progress import fmt_duration


@click.command()
@click.argument("input_path", metavar="INPUT", required=False)
@click.option("--out", help="The job's output folder: rows already done there are left out, and its last "
                            "measured throughput is used.")
@input_options
@sampling_options
@plan_schedule_options
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@user_errors
def plan(input_path, out, config_file, as_json, **options):
    """Predict output lengths, bucket the rows and forecast the job, without the engine.

    Prints the buckets with their row and token counts, the predicted total of
    output tokens, the ETA from the measured or configured throughput, and, with
    a deadline, whether it is feasible and what would be left.

    \b
    Example:
        overnight plan prompts.parquet
        overnight plan prompts.parquet --throughput 2500 --deadline 2026-11-23T06:00
        overnight plan prompts.parquet --out results/ --time-budget 2h
    """
    from overnight.pipeline.scheduling.plan import make_plan
    from overnight.pipeline.report import iso

    cfg = build_config(input_path, None, config_file, options)
    p = make_plan(cfg, out=out or cfg.output.path, throughput=given(options, "scheduler.tokens_per_second"))
    if as_json:
        click.echo(json.dumps(asdict(p), indent=2))
        return
    dup = f", {p.num_duplicates} duplicate ids skipped" if p.num_duplicates else ""
    click.echo(f"{p.num_rows} rows: {p.num_todo} to run, {p.num_done} already done, {p.num_errors} error rows{dup} "
               f"(predictor: {p.predictor})")
    click.echo(f"{'bucket (predicted tokens)':>26s} {'rows':>8s} {'prompt tokens':>14s} {'predicted output':>17s}")
    for b in p.buckets:
        click.echo(f"{b.label:>26s} {b.num_rows:>8d} {b.prompt_tokens:>14d} {b.predicted_tokens:>17d}")
    click.echo(f"predicted output tokens: {p.predicted_tokens}")
    if p.tokens_per_s:
        if p.startup_s is not None:
            start = f"; {fmt_duration(p.startup_s)} of it the start-up to the first row, as the last run measured it"
        elif p.num_todo:
            start = ("; not counting the start-up, which no run in --out measured" if out or cfg.output.path
                     else "; not counting the start-up (--out of an earlier run of the job counts it)")
        else:
            start = ""
        if p.calibration is not None:
            start += (f"; the predictions times {p.calibration:.2f}, the actual over predicted output tokens of "
                      f"{p.calibration_rows} rows done in --out, as this plan predicts them")
        click.echo(f"ETA: {fmt_duration(p.eta_s)} at {p.tokens_per_s:.0f} output tok/s ({p.throughput_source})"
                   f"{start}")
    else:
        click.echo("ETA: unknown: pass --throughput, set scheduler.tokens_per_second (see `overnight tune`), "
                   "or --out a folder a run has measured")
    if p.deadline_at is not None:
        after = (f", {fmt_duration(max(0.0, p.time_left_s - p.startup_s))} after the start-up"
                 if p.startup_s is not None else "")
        when = f"deadline {iso(p.deadline_at)}: {fmt_duration(p.time_left_s)} to work in{after}"
        if p.is_feasible is None:
            click.echo(f"{when}; feasibility unknown without a throughput")
        elif p.is_feasible:
            click.echo(f"{when}: feasible")
        else:
            how = {"auto": "running the shortest first once at risk", "shortest-first": "running the shortest "
                   "first", "longest-first": "running the longest first", "priority": "running the lowest "
                   "priority value first", "fifo": "running in input order"}[Policy(cfg.scheduler.policy).value]
            click.echo(f"{when}: NOT feasible; about {p.rows_left} rows ({p.tokens_left} predicted output tokens) "
                       f"would be left, {how}")
    for e in p.errors:
        click.echo(f"error row: {e}")
