"""The results of OUT in the input's order: the table ``_input`` read from the input itself, and the view over it.

Input order comes from the input, at the path the manifest records, read as the run read it, up to its --limit
(each shard's own; past it only when OUT holds rows beyond it, as after a rerun with a lower --limit, and only the
rows within it are the job's, which the openai format says were never done): through the run's own source
(``input.source``: its listing, and for derived ids its file names and row numbers) for Parquet; OpenAI Batch
request lines streamed line by line (each line's custom_id and endpoint). Rows whose id is no longer in the input
come last. ``export`` writes them (tools/export.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import posixpath
from typing import Optional

import pyarrow as pa

from overnight.pipeline.output.checkpoint import OutputDir
from overnight.pipeline.output.layout import job_dirs
from overnight.pipeline.output.storage import is_local


# The table ``_input``: each input row's id, its position in input order, whether its request line asked
# /v1/completions (its prompt went to the model raw; false for every Parquet row), and for a row without an id its
# origin ("<file>#<row>"), which its error row's message starts with.
INPUT_SCHEMA = pa.schema([("_id", pa.string()), ("_pos", pa.int64()), ("_raw", pa.bool_()), ("_origin", pa.string())])
LOADED_SCHEMA = INPUT_SCHEMA.append(pa.field("_in_job", pa.bool_()))  # the row is within the run's --limit


def _key(id_expr: str, origin_expr: str) -> str:
    """A row's key in the join of results and ``_input``: its id, or without one its origin (chr(0) first, so that
    no id equals it)."""
    return f"coalesce({id_expr}::varchar, chr(0) || {origin_expr})"


def _result_key(id_col: str, alias: str = "") -> str:
    """The key of a result row: a row without an id is an error row whose message starts with its origin."""
    a = f"{alias}." if alias else ""
    return _key(f'{a}"{id_col}"', f"split_part({a}error, ': ', 1)")


INPUT_KEY = _key("_id", "_origin")
CHUNK = 65536
RAW = "_overnight_raw"  # the results' column that says so, in the openai format's query


def _ordered(con, manifest: dict, out_url: str) -> tuple[str, bool]:
    """A view of results in input order, and whether the input could be read for it."""
    id_col = manifest.get("fingerprint_fields", {}).get("id_column", "id")
    cols = {r[0] for r in con.execute("describe results").fetchall()}
    if id_col not in cols:
        return "select * from results", False
    for url in _input_urls(manifest, out_url):
        if _read_input(con, manifest, url, out_url, id_col):
            return _in_order(id_col, cols), True
    return "select * from results", False  # the input moved or is not reachable from here: finish order


def _in_order(id_col: str, cols: set, raw: bool = False) -> str:
    """The results ordered by the table ``_input``; with ``raw``, each row's ``_raw`` as the column RAW."""
    # a row's samples together: two rows of one id (from two shards' or workers' files) apart, by what is the
    # same for every sample of a row and tells two rows apart (their run, when each was queued, their prompt)
    row = "".join(f", r.{c}" for c in ("run_id", "queued_at", "prompt_hash") if c in cols)
    samples = f", r.\"{id_col}\"{row}, r.sample_index" if "sample_index" in cols else ""
    return (f"select r.*{f', i._raw as {RAW}' if raw else ''} from results r left join "
            f"(select {INPUT_KEY} _key, min(_pos) _pos, arg_min(_raw, _pos) _raw from _input group by 1) i "
            f"on {_result_key(id_col, 'r')} = i._key order by i._pos nulls last{samples}")


def _input_urls(manifest: dict, out_url: str) -> list[str]:
    """Where the input the manifest names may be, best first. A relative local path is relative to the folder the
    run started in: the one the manifest records (``input.cwd``), else the one the run's status.json shows (its
    absolute OUT, less --out as the run gave it), then the one where OUT is now shows (OUT and its input moved
    together); only when none is known, the folder export runs in."""
    given = manifest.get("input") or {}
    url = given.get("url")
    if not url:
        return []
    if "://" in url or os.path.isabs(url):
        return [url]
    folders = ([given["cwd"]] if given.get("cwd") else []) + _run_folders(manifest, out_url)
    return list(dict.fromkeys(os.path.join(f, url) for f in folders)) or [url]


def _run_folders(manifest: dict, out_url: str) -> list[str]:
    """The folders the run ran in, as OUT's paths show: --out as the run gave it (relative, without ..) is the end
    of the absolute path each job folder's status.json names, and of OUT's path now."""
    given = ((manifest.get("config") or {}).get("output") or {}).get("path") or ""
    if not given or "://" in given or os.path.isabs(given):
        return []
    tail = [p for p in os.path.normpath(given).split(os.sep) if p not in ("", ".")]
    if not tail or ".." in tail:
        return []
    root = OutputDir(out_url)
    outs = []
    for d in job_dirs(out_url):
        shown = (d.out.read_status() or {}).get("out")
        if not isinstance(shown, str) or not os.path.isabs(shown):
            continue
        parts = os.path.normpath(shown).split(os.sep)
        below = [p for p in posixpath.relpath(d.out.root, root.root).split("/") if p != "."]  # a shard's folder
        if not below or parts[-len(below):] == below:
            outs.append(parts[:len(parts) - len(below)])
    if is_local(root.fs):
        outs.append(os.path.normpath(os.path.abspath(root.root)).split(os.sep))
    return list(dict.fromkeys(os.sep.join(p[:-len(tail)]) or os.sep for p in outs if p[-len(tail):] == tail))


def _read_input(con, manifest: dict, url: str, out_url: str, id_col: str) -> bool:
    """The table ``_input`` of the input at ``url``: its rows as the run read them, in input order, and whether each
    is within the run's --limit (``_in_job``; a shard's limit is its own, from its own manifest). Read up to the
    limit, and past it only when OUT holds rows beyond it (a rerun lowered --limit), for their places in the
    order. False when the input cannot be read."""
    from overnight.pipeline.config import InputConfig
    from overnight.pipeline.input.openai_batch import is_jsonl_input
    from overnight.pipeline.input.shards import Shard

    known = {f.name for f in dataclasses.fields(InputConfig)}
    given = {k: v for k, v in ((manifest.get("config") or {}).get("input") or {}).items() if k in known}
    try:
        cfg = InputConfig(**{**given, "path": url})
        jsonl = is_jsonl_input(url)
    except Exception:  # a folder of both kinds (the run would have refused it), a config this version refuses
        return False
    dirs = [d for d in job_dirs(out_url) if d.shard is not None]
    n = max((d.shard.n for d in dirs), default=None)
    plan = [(None, cfg.limit)]
    if n is not None:
        own = {d.shard.k: _limit_of(d.out.read_manifest(), cfg.limit) for d in dirs}
        plan = [(Shard(k, n), own.get(k, cfg.limit)) for k in range(n)]  # (a shard not begun: the job's)
        if all(limit is None for _, limit in plan):
            plan = [(None, None)]  # every row, as the shards' ranges together read them
    if not _load_plan(con, cfg, manifest, url, jsonl, plan, past_limit=False):
        return False
    if any(limit is not None for _, limit in plan) and _unplaced(con, id_col):
        return _load_plan(con, cfg, manifest, url, jsonl, plan, past_limit=True)
    return True


def _limit_of(m: Optional[dict], default: Optional[int]) -> Optional[int]:
    """A job folder's --limit, as its manifest's latest attempt ran with it."""
    return ((m.get("config") or {}).get("input") or {}).get("limit") if m else default


def _unplaced(con, id_col: str) -> bool:
    """Whether results hold a row the table ``_input`` does not."""
    return con.execute(f"select count(*) from (select {_result_key(id_col)} k from results) "
                       f"where k not in (select {INPUT_KEY} from _input)").fetchall()[0][0] > 0


def _load_plan(con, cfg, manifest: dict, url: str, jsonl: bool, plan, past_limit: bool) -> bool:
    """Load ``_input`` from each (shard, --limit) of ``plan``: up to the limit, or (past_limit) every row."""
    from overnight.pipeline.input.shards import rule_of
    from overnight.pipeline.input.source import InputError, open_source

    def read_to(limit):
        return None if past_limit else limit

    if jsonl and plan[0][0] is None:
        return _load(con, _marked(_line_rows(url, read_to(plan[0][1])), plan[0][1]))
    try:
        sources = [(open_source(dataclasses.replace(cfg, limit=read_to(limit)), shard,
                                rule_of(manifest.get("input"))), limit) for shard, limit in plan]
    except (InputError, OSError, ValueError):
        return False
    return _load(con, (b for source, limit in sources for b in _marked(_source_rows(source), limit)))


def _marked(batches, limit: Optional[int]):
    """Batches of INPUT_SCHEMA with ``_in_job``: whether each row is within --limit (counted from the first)."""
    import numpy as np

    seen = 0
    for b in batches:
        n = b.num_rows
        flags = pa.array(np.ones(n, bool) if limit is None else np.arange(seen, seen + n) < limit)
        seen += n
        yield pa.record_batch([*b.columns, flags], schema=LOADED_SCHEMA)


def _load(con, batches) -> bool:
    """Stream record batches of LOADED_SCHEMA into the table ``_input`` (the input is never loaded whole)."""
    reader = pa.RecordBatchReader.from_batches(LOADED_SCHEMA, batches)
    try:
        con.register("_input_rows", reader)
        con.execute("create or replace temp table _input as select * from _input_rows")
    except Exception:  # the input moved or is not reachable from here: finish order
        return False
    finally:
        con.unregister("_input_rows")
    return True


def _batch(ids, pos, raw=None, origins=None) -> pa.RecordBatch:
    ids = ids if isinstance(ids, pa.Array) else pa.array(ids, pa.string())
    raw = pa.array([False] * len(ids), pa.bool_()) if raw is None else raw
    origins = pa.nulls(len(ids), pa.string()) if origins is None else pa.array(origins, pa.string())
    return pa.record_batch([ids, pa.array(pos, pa.int64()), raw, origins], schema=INPUT_SCHEMA)


def _line_rows(url: str, limit: Optional[int]):
    """An OpenAI Batch input's request lines in input order, up to --limit: each line's custom_id, whether it
    asks /v1/completions and, without a custom_id, its origin (``openai_batch.request_lines``)."""
    from overnight.pipeline.input.openai_batch import request_lines

    rows, pos = itertools.islice(request_lines(url), limit), 0
    while chunk := list(itertools.islice(rows, CHUNK)):
        yield _batch([c for c, _, _ in chunk], range(pos + 1, pos + len(chunk) + 1),
                     pa.array([r for _, r, _ in chunk], pa.bool_()), [o for _, _, o in chunk])
        pos += len(chunk)


def _source_rows(source):
    """The rows a source (``input.source``, the run's own reader) reads, in input order and up to its --limit: the
    id column (and a request line's raw-prompt marker), or without one the id the run derives, "<file>#<row>"
    from the source's file names and row numbers (computed, not read). A row's position: its file's index, then
    its row number there."""
    from overnight.pipeline.input.source import RAW_PROMPT_COLUMN

    if not source.has_id_column:
        for i, rows in _derived_rows(source):
            name = source.files[i].name
            yield _batch([f"{name}#{r}" for r in rows], [(i << 40) + r for r in rows])
        return
    index = {f.path: i for i, f in enumerate(source.files)}
    id_col = source.cfg.id_column
    columns = [n for n in source.schema.names if n in (id_col, RAW_PROMPT_COLUMN)]
    source.read_columns = lambda: columns  # batches() reads these alone
    for sb in source.batches():
        i, names = index[sb.file.path], sb.batch.schema.names
        raw = None
        if RAW_PROMPT_COLUMN in names and RAW_PROMPT_COLUMN in sb.file.internal_columns:
            raw = sb.batch.column(RAW_PROMPT_COLUMN).fill_null(False)
        ids = sb.batch.column(id_col).cast(pa.string())
        origins = None
        if ids.null_count:  # a row without an id: its origin, which its error row's message starts with
            origins = [None if v.is_valid else f"{sb.file.name}#{sb.row_number(k)}" for k, v in enumerate(ids)]
        yield _batch(ids, [(i << 40) + sb.row_number(k) for k in range(sb.batch.num_rows)], raw, origins)


def _derived_rows(source):
    """(file index, row numbers) of the rows ``source.batches()`` reads, without reading them: its fragments in
    order, its shard's rows under the hash split, up to --limit."""
    from overnight.pipeline.input.shards import hash_shard

    hashed = source.selection.hash_of if source.selection is not None else None
    left = source.cfg.limit
    if left == 0:
        return
    for frag in source.fragments():
        f = source.files[frag.file_index]
        start = 0 if frag.row_group is None else sum(f.row_groups[:frag.row_group])
        lo, hi = (start + frag.rows[0], start + frag.rows[1]) if frag.rows else (start, start + frag.num_rows)
        for a in range(lo, hi, CHUNK):
            rows = range(a, min(hi, a + CHUNK))
            if hashed is not None:
                rows = [r for r in rows if hash_shard(f"{f.name}#{r}", hashed.n) == hashed.k]
            if left is not None:
                rows = rows[:left]
                left -= len(rows)
            if len(rows):
                yield frag.file_index, rows
            if left == 0:
                return
