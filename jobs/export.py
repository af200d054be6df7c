"""`overnight export`: the results of OUT as one file, or as OpenAI Batch output lines."""

from __future__ import annotations

import json

import click

from overnight.jobs.options import user_errors


@click.command("export")
@click.argument("out")
@click.option("--format", "fmt", type=click.Choice(["parquet", "jsonl", "csv", "openai"]), default="parquet",
              show_default=True, help="One compacted file in input order, or OpenAI Batch API output lines.")
@click.option("--output", required=True, help="The file to write.")
@click.option("--errors", "errors", help="openai: write error and unfinished (batch_expired) rows here instead.")
@user_errors
def export(out: str, fmt: str, output: str, errors: str) -> None:
    """Write the results in OUT (every shard and worker) as one file.

    With --format openai each line has OpenAI's Batch output shape (id, custom_id, response with status_code,
    request_id and a chat.completion body with usage, or a text_completion body for a /v1/completions request
    line, error), so a parser written for OpenAI's results reads it unchanged; rows of the job (up to its --limit)
    not done are written as batch_expired errors.

    \b
    Example:
        overnight export results/ --format parquet --output answers.parquet
        overnight export results/ --format openai --output results.jsonl --errors errors.jsonl
    """
    from overnight.pipeline.tools.export import export as run_export

    click.echo(json.dumps(run_export(out, fmt, output, errors)))
