"""`overnight report`: the job in OUT as plots, in one self-contained HTML file (and PNGs)."""

from __future__ import annotations

import click

from overnight.jobs.options import user_errors


@click.command("report")
@click.argument("out")
@click.option("--html", "html_path", default="report.html", show_default=True,
              help="The HTML file to write (plots embedded; opens with no network).")
@click.option("--png", "png_dir", help="Also write each plot as a PNG file into this folder.")
@user_errors
def report(out: str, html_path: str, png_dir: str) -> None:
    """Plot the job in OUT: rows and tokens/s over time against the deadline, the ETA as it evolved,
    predicted against actual lengths, buckets, latency and errors, one lane per shard or worker.

    \b
    Example:
        overnight report results/ --html night.html
        overnight report results/ --png plots/
    """
    from overnight.pipeline.tools.report import build, write

    for path in write(build(out), html_path, png_dir):
        click.echo(path)
