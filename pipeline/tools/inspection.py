"""DuckDB over an output folder's completed parts: the view ``results``.

The same works from a notebook:

    import duckdb
    con = duckdb.connect()
    con.sql("select status, count(*) from read_parquet('results/parts/part-*.parquet', union_by_name = true) "
            "group by 1").show()

A sharded job's parts are in OUT/shards/*/parts/: read_parquet('results/**/part-*.parquet', union_by_name = true)
reads them all.
"""

from __future__ import annotations

import csv as csvlib
import io
from typing import Optional

from overnight.pipeline.output.checkpoint import OutputDir, OutputError
from overnight.pipeline.output.layout import job_dirs, job_manifest
from overnight.pipeline.progress import fmt_duration
from overnight.pipeline.output.storage import is_local, unstrip


def open_results(url: str):
    """A DuckDB connection with a view ``results`` over OUT's parts, and OUT's manifest."""
    import duckdb

    out = OutputDir(url)
    if not out.fs.exists(out.root):
        raise OutputError(f"Output folder {url} does not exist. Pass the --out folder of a run.")
    dirs = job_dirs(url)
    if not dirs:
        raise OutputError(f"{url} is not an overnight output folder (no manifest.json, no parts/, at its top or "
                          f"in shards/). Pass the --out folder of a run.")
    manifest = job_manifest(url)
    if manifest is not None and "num_duplicates" not in manifest.get("counts", {}):
        from overnight.pipeline.tools.status import duplicates

        manifest.setdefault("counts", {})["num_duplicates"] = sum(duplicates(d) for d in dirs)
    con = duckdb.connect()
    if not is_local(out.fs):
        con.register_filesystem(out.fs)
    # Each part by its own name (DuckDB reads a name as a glob: OUT's own *, ? or [ are escaped).
    parts = [_literal(unstrip(d.out.fs, p)) for d in dirs for p in d.out.part_paths()]
    if parts:
        listed = ", ".join("'" + p.replace("'", "''") + "'" for p in parts)
        try:
            con.sql(f"create view results as select * from read_parquet([{listed}], union_by_name = true)")
        except duckdb.Error as e:  # a part that is not Parquet (damaged on its storage): name it, not a traceback
            raise OutputError(f"{_damaged(dirs) or url}: a result part cannot be read "
                              f"({str(e).strip().splitlines()[0]}). Delete the damaged part and rerun the job, "
                              f"which answers its rows again; then inspect it.") from None
    else:  # no part yet (a job stopped before its first flush): no rows, with the columns parts will have
        con.register("_no_parts", _empty_results(manifest or {}))
        con.sql("create view results as select * from _no_parts")
    return con, manifest


def _damaged(dirs) -> Optional[str]:
    """The first part whose footer cannot be read, as a user names it."""
    import pyarrow.parquet as pq

    for d in dirs:
        for p in d.out.part_paths():
            try:
                with d.out.fs.open(p, "rb") as f:
                    pq.ParquetFile(f).metadata
            except Exception:
                return d.out.shown("parts", p.rsplit("/", 1)[-1])
    return None


def _literal(path: str) -> str:
    """A path that DuckDB's read_parquet reads as that one file: its glob characters each in a [class]."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in path)


def _empty_results(manifest: dict):
    """An empty table with the output schema (output.schema) of the job the manifest describes; the input's
    passthrough columns are unknown until a part is written, so it has none."""
    import pyarrow as pa

    from overnight.pipeline.output.schema import OutputSchema

    cfg = manifest.get("config", {})
    sampling = cfg.get("sampling") or {}
    id_name = manifest.get("fingerprint_fields", {}).get("id_column") or (cfg.get("input") or {}).get("id_column")
    given = manifest.get("input") or {}   # (an OUT before stop 44 records neither: the job's settings tell)
    schema = OutputSchema(id_name or "id", pa.string(), [],
                          samples=given.get("samples", (sampling.get("n") or 1) > 1),
                          logprobs=given.get("logprobs", sampling.get("logprobs") is not None))
    return schema.schema.empty_table()


def _limit(manifest: dict) -> str:
    limit = ((manifest.get("config") or {}).get("input") or {}).get("limit")
    shards = sum(str(s.get("shard", "")).count("/") == 1 for s in manifest.get("shards") or [])
    if isinstance(limit, int) and shards:  # each shard reads its first N rows: the whole is more than N
        return f" within --limit {limit} per shard"
    return f" within --limit {limit}" if isinstance(limit, int) else ""


def summary_lines(con, manifest: Optional[dict], price_per_hour: Optional[float] = None,
                  state: Optional[str] = None) -> list[str]:
    """state: the job's state as `overnight status` tells it (a run killed while it ran is stopped, where its
    manifest still says running); the manifest's when not given."""
    lines = []
    if manifest:
        c = manifest.get("counts", {})
        attempts = manifest.get("attempts", [])
        state = state or manifest.get("state")
        if manifest.get("shards"):
            ray = all(str(x.get("shard", "")).startswith("w") for x in manifest["shards"])  # workers/w<i>
            kind = "Ray worker" if ray else "shard"
            lines.append(f"job in {len(manifest['shards'])} {kind} folders  state: {state}  "
                         f"(per {kind.split()[-1]}: overnight status)")
        else:
            lines.append(f"run {manifest.get('run_id')}  state: {state}  attempts: {len(attempts)}")
        lines.append(f"model: {manifest.get('fingerprint_fields', {}).get('model')}  "
                     f"input: {manifest.get('input', {}).get('url')} "
                     f"({c['num_rows'] if c.get('num_rows') is not None else '?'} rows{_limit(manifest)})")
    columns = {r[0] for r in con.execute("describe results").fetchall()}
    # With n > 1 a row's samples are output rows of their own (sample_index 0 .. n-1): a row counts once.
    row = "coalesce(sample_index, 0) = 0" if "sample_index" in columns else "true"
    n, ok, err, ptok, otok, num_samples = con.execute(
        f"select count(*) filter ({row}), count(*) filter (status = 'ok' and {row}), "
        f"count(*) filter (status = 'error' and {row}), coalesce(sum(prompt_tokens) filter ({row}), 0), "
        f"coalesce(sum(output_tokens), 0), count(*) filter (status = 'ok') from results").fetchone()
    counts = (manifest or {}).get("counts", {})
    total = counts.get("num_rows")
    if total is None:  # shards not started yet: the rows not done are the started shards', and theirs besides
        total = (manifest or {}).get("rows_of_started_shards")
    # Duplicate ids are skipped, neither done nor left; a completed job has none left; results no longer in the
    # input (known once a run has read it all) are not its rows done.
    here = n - (counts.get("num_removed") or 0) - (counts.get("num_outside") or 0)  # (and those past a --limit)
    not_done = total - here - (counts.get("num_duplicates") or 0) if isinstance(total, int) else 0
    left = f", {not_done} not done" if not_done > 0 and state != "completed" else ""  # (the job's, as status says)
    if (manifest or {}).get("shards_not_started"):
        k = manifest["shards_not_started"]
        left += f", and the rows of {k} shard{'s' if k > 1 else ''} not started"
    samples = f"; {num_samples} samples" if "sample_index" in columns else ""
    gone = counts.get("num_removed") or 0   # (the results are kept, and counted in ok and error)
    gone = f"; {gone} no longer in the input, not counted as done" if gone else ""
    lines.append(f"rows: {n} ({ok} ok, {err} error{left}{gone}{samples})")
    if ok:
        first, last, avg_out, p50, p90 = con.execute(
            f"select min(queued_at), max(finished_at), sum(output_tokens) / {ok}, "
            f"quantile_cont(epoch(finished_at - queued_at), 0.5) filter ({row}), "
            f"quantile_cont(epoch(finished_at - queued_at), 0.9) filter ({row}) from results where status = 'ok'"
        ).fetchone()
        lines.append(f"tokens: {ptok} prompt, {otok} output (mean {avg_out:.0f} per row)")
        lines.append(f"row latency (queued -> finished): p50 {p50:.1f} s, p90 {p90:.1f} s")
        reasons = con.execute("select coalesce(finish_reason, 'null'), count(*) from results where status = 'ok' "
                          "group by 1 order by 2 desc").fetchall()
        lines.append("finish_reason: " + ", ".join(f"{r} {k}" for r, k in reasons))
        if first is not None and last is not None:
            span = (last - first).total_seconds()
            lines.append(f"wall time from the first row queued to the last finished: {fmt_duration(span)}")
    lines += cost_lines(con, manifest, price_per_hour, n)
    if err:
        lines.append("most common errors:")
        # one line per kind: messages that differ only in their numbers (a prompt's tokens, a row's value) are one
        kinds = con.execute(
            "select min(m), count(*), count(distinct m) from (select regexp_replace(error, '^[^:]*#[0-9]+: ', '') m "
            "from results where status = 'error') group by regexp_replace(m, '[0-9]+', 'N', 'g') "
            "order by 2 desc, 1").fetchall()
        for msg, k, variants in kinds[:5]:
            lines.append(f"  {k} x {msg}" + (f" (and {variants - 1} like it, with other numbers)" if variants > 1
                                              else ""))
        if len(kinds) > 5:
            lines.append(f"  {sum(k for _, k, _ in kinds[5:])} more rows with {len(kinds) - 5} other kinds of error")
    return lines


def cost_lines(con, manifest: Optional[dict], price_per_hour: Optional[float], rows: int) -> list[str]:
    """Engine-hours of the rows in the output (their engine_seconds), and with a price their cost."""
    columns = {r[0] for r in con.execute("describe results").fetchall()}
    if "engine_seconds" not in columns:
        return []
    seconds = con.execute("select coalesce(sum(engine_seconds), 0) from results").fetchone()[0]
    if price_per_hour is None:
        price_per_hour = ((manifest or {}).get("config", {}).get("output") or {}).get("price_per_hour")
    line = f"engine time: {seconds / 3600:.4f} engine-hours ({seconds:.1f} s)"
    if price_per_hour is not None:
        cost = seconds / 3600 * price_per_hour
        per = f", {1000 * cost / rows:.4f} per 1,000 rows" if rows else ""
        line += f"; at {price_per_hour:g} per hour: {cost:.4f}{per}"
    return [line]


def _width(s: str) -> int:
    """Columns a terminal gives the text: two for a wide (CJK) character, none for a combining mark."""
    import unicodedata

    if s.isascii():
        return len(s)
    return sum(0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in s)


def render(columns: list[str], rows: list[tuple], csv: bool = False, max_width: int = 60) -> str:
    if csv:
        from overnight.pipeline.tools.export import csv_cell

        buf = io.StringIO()
        w = csvlib.writer(buf)
        w.writerow(columns)
        w.writerows([csv_cell(v) for v in r] for r in rows)
        return buf.getvalue().rstrip("\n")

    def cell(v) -> str:
        s = "NULL" if v is None else str(v).replace("\n", "\\n")
        if len(s) <= 4 * max_width and _width(s) <= max_width:
            return s
        s = s[:4 * max_width]  # (a long text: enough of it to fill the cell)
        while _width(s) > max_width - 3:
            s = s[:-1]
        return s + "..."

    def pad(s: str, w: int) -> str:
        return s + " " * (w - _width(s))

    cells = [[cell(v) for v in r] for r in rows]
    widths = [max([_width(c)] + [_width(r[i]) for r in cells]) for i, c in enumerate(columns)]
    sep = "  "
    out = [sep.join(pad(c, w) for c, w in zip(columns, widths)), sep.join("-" * w for w in widths)]
    out += [sep.join(pad(v, w) for v, w in zip(r, widths)) for r in cells]
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(out)
