"""`overnight status`: the job in OUT as a whole and per shard, for a person or an Airflow sensor."""

from __future__ import annotations

import json

import click

from overnight.jobs.options import user_errors


@click.command("status")
@click.argument("out")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@user_errors
def status(out: str, as_json: bool) -> None:
    """Show the state of the job in OUT: rows done and left, tokens/s, ETA and exit code, per shard.

    It reads the files the job keeps in OUT and changes nothing, so it is safe to poll while the job runs.
    The job's state is completed only once every shard is; its exit code is the worst of its shards'
    (69, then 1, then 75), or none while any shard runs.

    \b
    Example:
        overnight status results/
        overnight status s3://bucket/results/ --json | jq .state
    """
    from overnight.pipeline.output.checkpoint import OutputError
    from overnight.pipeline.tools.status import job_status, status_lines

    try:
        s = job_status(out)
    except OutputError as e:  # no job there (yet): with --json, still one document, for a sensor's XCom or jq
        if as_json:
            click.echo(json.dumps({"state": "missing", "exit_code": None, "message": str(e)}, indent=2))
        raise
    if as_json:
        click.echo(json.dumps(s, indent=2))
    else:
        for line in status_lines(s):
            click.echo(line)
