"""The `overnight` command: a Click group whose commands live one per module."""

from __future__ import annotations

import logging
import sys

import click

from overnight.jobs.export import export
from overnight.jobs.inspection import inspect_cmd
from overnight.jobs.models import models
from overnight.jobs.plan import plan
from overnight.jobs.predictor import predictor
from overnight.jobs.report import report
from overnight.jobs.run import run
from overnight.jobs.status import status
from overnight.jobs.tune import tune
from overnight.pipeline.signals import release_from_start


class OvernightGroup(click.Group):
    """An error keeps the promises of the options: with --log-format json, a JSON line on stderr (in every
    command, and for an unknown command too, and an unforeseen fault's with its traceback), and for a usage error
    or an unforeseen fault with `run --json`, still one JSON document on stdout."""

    def invoke(self, ctx: click.Context):
        args = [*ctx._protected_args, *ctx.args]
        if args[:1] != ["run"]:  # only a run handles signals itself (jobs/entry.py)
            release_from_start()
        try:
            return super().invoke(ctx)
        except click.ClickException as e:
            logger = logging.getLogger("overnight")
            if ctx.params.get("log_format") == "json" and not getattr(logger, "json_lines", False):
                setup_logging(ctx.params.get("verbose", False), "json")  # (an unknown command: before the callback)
            if getattr(logger, "json_lines", False):
                e.show = lambda file=None, message=e.format_message(): logger.error(f"Error: {message}")
            if not isinstance(e, click.UsageError):
                raise
            if args[:1] == ["run"] and "--json" in args[1:]:
                import json

                click.echo(json.dumps({"state": "failed", "exit_code": e.exit_code, "message": e.format_message()},
                                      indent=2))
            raise
        except (click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as e:  # a fault no message was written for (a bug, an OSError of the machine's)
            logger = logging.getLogger("overnight")
            message = f"{type(e).__name__}: {e}"
            if args[:1] == ["run"] and "--json" in args[1:]:
                import json

                click.echo(json.dumps({"state": "failed", "exit_code": 1, "message": message}, indent=2))
            if not getattr(logger, "json_lines", False):
                raise  # its traceback, as Python prints it
            logger.error(f"Error: {message}", exc_info=True)  # one JSON object, the traceback in it
            ctx.exit(1)


@click.group(cls=OvernightGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("-v", "--verbose", is_flag=True, help="Debug logging, including vLLM's own start-up logs.")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="stderr lines as text, or as one JSON object each (time, level, message, counters) for log "
                   "shippers.")
@click.version_option(package_name="overnight")
def cli(verbose: bool, log_format: str) -> None:
    """Offline bulk LLM inference over Parquet, on vLLM.

    \b
    Example:
        overnight models prepare
        overnight run prompts.parquet --out results/
        overnight inspect results/ --sql "select status, count(*) from results group by 1"
    """
    setup_logging(verbose, log_format)


class StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is now (test runners swap it per invocation)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO), level, message, and the counters a progress line carries."""

    def format(self, record: logging.LogRecord) -> str:
        import datetime as dt
        import json

        doc = {"time": dt.datetime.fromtimestamp(record.created, dt.timezone.utc).isoformat(timespec="milliseconds"),
               "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        counters = getattr(record, "counters", None)
        if counters:
            doc["counters"] = counters
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup_logging(verbose: bool, log_format: str = "text") -> None:
    from overnight.pipeline.streams import quiet_libraries

    quiet_libraries(verbose)
    logger = logging.getLogger("overnight")
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    if not logger.handlers:
        logger.addHandler(StderrHandler())
        logger.propagate = False
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(
        "%(asctime)s overnight %(levelname)s %(message)s", datefmt="%Y-%m-%dT%H:%M:%S")
    for handler in logger.handlers:
        handler.setFormatter(formatter)
    logger.json_lines = log_format == "json"  # the run's own error line follows (jobs/run.py)


cli.add_command(run)
cli.add_command(plan)
cli.add_command(status)
cli.add_command(report)
cli.add_command(export)
cli.add_command(inspect_cmd)
cli.add_command(predictor)
cli.add_command(tune)
cli.add_command(models)


# Seconds the engine's processes get to exit on their own when the command ends, before they are killed.
# Everything is written by then. With vLLM's own default (5 s, after its worker's graceful exit) a finished job's
# process exited 8.6 s after its last row on this machine; with 1 s, 5.2 s; with 0.5 s (and the stderr filter not
# waiting on the engine), about 3 s (docs/BENCHMARKS.md).
ENGINE_EXIT_S = 0.5


def main() -> None:
    try:
        cli(prog_name="overnight")
    finally:
        engines = sys.modules.get("overnight.pipeline.engine.vllm")
        if engines is not None:
            engines.shutdown_engines(timeout=ENGINE_EXIT_S)
