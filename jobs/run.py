"""`overnight run`: parse options, build the config, run the job, report."""

from __future__ import annotations

import json
import logging
import time

import click

from overnight.jobs.options import (build_config, cluster_options, engine_options, input_options, output_options,
                                    sampling_options, schedule_options, user_errors)


@click.command()
@click.argument("input_path", metavar="INPUT", required=False)
@click.option("--out", "out", help="Output folder (local or fsspec URL). Rerunning resumes it.")
@input_options
@sampling_options
@engine_options
@schedule_options
@output_options
@cluster_options
@click.option("--fresh", is_flag=True, help="Discard the results already in OUT and start over.")
@click.option("--retry-errors", is_flag=True,
              help="On a resume, answer again the rows that ended as errors (their error rows in OUT are replaced).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
@user_errors
def run(input_path, out, config_file, fresh, retry_errors, as_json, **options):
    """Run a bulk inference job over INPUT (Parquet file, folder or glob, or OpenAI Batch request lines in
    .jsonl / .jsonl.gz; local or fsspec URL).

    Finished rows are written to OUT/parts/ as they complete; rerunning the same
    command after a kill processes only the rows not yet written. INPUT may also
    be a YAML config file, as in `overnight run nightly.yaml`.

    With --deadline or --time-budget the job forecasts its finish from measured
    throughput and predicted output lengths, warns as soon as the deadline is at
    risk, and at the deadline (minus a safety margin) stops, keeps what is done,
    and exits 75.

    SIGTERM or Ctrl-C stops admitting rows, lets those in flight finish for --grace,
    aborts the rest, saves what finished and exits 75; a second signal aborts at once.

    Exit codes: 0 done, 1 failed, 2 bad usage, 69 the engine failed (finished rows
    are saved), 75 stopped early at the deadline or by a signal (rerun to continue).

    \b
    Example:
        overnight run prompts.parquet --out results/
        overnight run 's3://bucket/prompts/*.parquet' --out s3://bucket/results/ --max-tokens 256
        overnight run --config nightly.yaml --limit 100
        overnight run prompts.parquet --out results/ --deadline 2026-11-23T06:00
        overnight run requests.jsonl --out results/     # OpenAI Batch lines; custom_id is the id
    """
    from overnight.pipeline.api import run_job
    from overnight.pipeline.engine import EngineError
    from overnight.pipeline.report import EXIT_ENGINE

    from overnight.pipeline.streams import filtered_stderr, reserved_stdout

    from overnight.jobs.options import USER_ERRORS
    from overnight.pipeline.config import ConfigError

    def failed(e: Exception, code: int, stdout=None) -> None:
        """A job that fails before it has a summary: the error on stderr and, with --json, still one JSON document
        on stdout."""
        logger = logging.getLogger("overnight")
        if getattr(logger, "json_lines", False):  # --log-format json: every stderr line a JSON object, this too
            logger.error(f"Error: {e}")
        else:
            click.echo(f"Error: {e}", err=True)
        if as_json:
            click.echo(json.dumps({"state": "failed", "exit_code": code, "message": str(e)}, indent=2), file=stdout)
        click.get_current_context().exit(code)

    try:
        cfg = build_config(input_path, out, config_file, options)
    except ConfigError as e:  # an option's value or the config file's: bad usage, as Click's own checks say it
        failed(e, 2)
    except USER_ERRORS as e:
        failed(e, 1)
    verbose = logging.getLogger("overnight").isEnabledFor(logging.DEBUG)
    began = time.time()
    # What the engine and its libraries print goes to stderr, without the noise unless -v.
    with filtered_stderr(verbose, getattr(logging.getLogger("overnight"), "json_lines", False)), \
            reserved_stdout() as stdout:
        try:
            summary = run_job(cfg, fresh=fresh, retry_errors=retry_errors)
        except EngineError as e:
            failed_metrics(cfg, e, EXIT_ENGINE, began)
            failed(e, EXIT_ENGINE, stdout)
        except ConfigError as e:  # one only the job can check (--shard auto's index and count, a column or model
            # an option names that is not there, an OUT of other settings): bad usage still
            failed_metrics(cfg, e, 2, began)
            failed(e, 2, stdout)
        except USER_ERRORS as e:
            failed_metrics(cfg, e, 1, began)
            failed(e, 1, stdout)
        if as_json:
            from dataclasses import asdict
            click.echo(json.dumps(asdict(summary), indent=2), file=stdout)
        else:
            click.echo(summary.line(), file=stdout)
    click.get_current_context().exit(summary.exit_code)


def failed_metrics(cfg, e: Exception, code: int, since: float) -> None:
    """A job that fails before it writes its status (its input missing, an OUT of other settings): its
    --metrics-file says so (state failed, the exit code), where it said the last run's "completed, exit 0". Not
    where this run wrote it since ``since`` (a job that failed mid-run: its rows and tokens are there), nor where
    another run holds OUT (the file is that run's)."""
    from overnight.pipeline.output.lock import LockError

    if not cfg.output.metrics_file or isinstance(e, LockError):
        return
    try:
        from prometheus_client.parser import text_string_to_metric_families

        from overnight.pipeline.output.checkpoint import OutputDir
        from overnight.pipeline.output.metrics import Metrics
        from overnight.pipeline.tools.status import _is_running

        try:
            with open(cfg.output.metrics_file) as f:
                written = [s.value for fam in text_string_to_metric_families(f.read()) for s in fam.samples
                           if s.name == "overnight_last_update_timestamp_seconds"]
        except (OSError, ValueError):
            written = []
        out = OutputDir(cfg.output.path)
        if any(t >= since for t in written) or (out.fs.exists(out.root) and _is_running(out)):
            return
        Metrics(cfg.output.metrics_file, None, out.shown()).update({"state": "failed", "exit_code": code})
    except Exception as err:  # (monitoring must not hide the error itself)
        logging.getLogger("overnight").debug("could not write the metrics file: %s", err)
