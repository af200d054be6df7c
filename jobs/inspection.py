"""`overnight inspect`: DuckDB over the completed parts of an output folder."""

from __future__ import annotations

import json
import logging

import click

from overnight.jobs.options import user_errors

log = logging.getLogger("overnight")


@click.command("inspect")
@click.argument("out")
@click.option("--sql", help="Query to run; the results are in a view named `results`.")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table",
              show_default=True, help="How to print query results.")
@click.option("--price-per-hour", type=click.FloatRange(min=0),
              help="What an engine-hour costs, for the cost line [default: the run's --price-per-hour].")
@user_errors
def inspect_cmd(out: str, sql: str, fmt: str, price_per_hour) -> None:
    """Summarise an output folder, or query it with SQL through DuckDB.

    The view `results` holds every completed part: one row per input id, or per sample where rows ask for n > 1.

    \b
    Example:
        overnight inspect results/
        overnight inspect results/ --sql "select finish_reason, count(*) from results group by 1"
    """
    from overnight.pipeline.tools.inspection import open_results, render, summary_lines

    con, m = open_results(out)
    if sql:
        import duckdb

        try:
            cur = con.execute(sql)
        except duckdb.Error as e:
            raise click.ClickException(f"SQL failed: {e}. The view is named `results`; "
                                       f"see its columns with --sql 'describe results'.") from None
        if cur is None or cur.description is None:  # a statement that returns nothing (a comment, a SET)
            return
        columns, rows = [d[0] for d in cur.description], cur.fetchall()
        if fmt == "json":
            from overnight.pipeline.tools.export import json_value

            keys = _unique(columns)  # `select 1 as a, 2 as a`: a and a_1, not one of them dropped
            click.echo(json.dumps([{k: json_value(v) for k, v in zip(keys, r)} for r in rows], default=str,
                                  indent=2, allow_nan=False))
        else:
            click.echo(render(columns, rows, csv=(fmt == "csv")))
        return
    state = None
    if m:
        from overnight.pipeline.tools.status import job_status
        try:
            state = job_status(out)["state"]  # a killed run: stopped, not the manifest's running
        except Exception as e:  # (the summary below still holds)
            log.debug("the job's state for inspect: %s", e)
    for line in summary_lines(con, m, price_per_hour, state):
        click.echo(line)


def _unique(names: list) -> list:
    seen: set = set()
    out = []
    for n in names:
        k, i = n, 0
        while k in seen:
            i += 1
            k = f"{n}_{i}"
        seen.add(k)
        out.append(k)
    return out
