"""`overnight export OUT`: the job's results as one file, in input order.

    parquet | jsonl | csv   every row of every part (all shards and workers), one file, in the input's order
    openai                  the OpenAI Batch API's output lines: a chat.completion body per ok row (a
                            text_completion for a /v1/completions request line), its n samples as ``choices``
                            (index = sample_index), logprobs in OpenAI's ``choices[i].logprobs``; error rows and
                            the rows of the job never done (as ``batch_expired``, like OpenAI at its 24-hour
                            limit) go to the --errors file, or into the output when none is given

Input order comes from the input itself (input_order.py); the OpenAI lines are built in openai_lines.py.
"""

from __future__ import annotations

import base64
import decimal
import itertools
import json
import math
import os
import re
from typing import Optional

from overnight.pipeline.output.checkpoint import OutputError
from overnight.pipeline.tools.input_order import INPUT_KEY, RAW, _in_order, _ordered, _result_key
from overnight.pipeline.tools.inspection import open_results
from overnight.pipeline.tools.openai_lines import (EXPIRED, ID_AS_TEXT, LOGPROBS_AS_WRITTEN, choice, error_line,
                                                   expired_line, ok_line, ok_line_sql, one_sample, text_choice)

FORMATS = ("parquet", "jsonl", "csv", "openai")


def _q(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def export(url: str, fmt: str, output: str, errors: Optional[str] = None) -> dict:
    import duckdb

    if fmt not in FORMATS:
        raise OutputError(f"--format {fmt}: use one of {', '.join(FORMATS)}.")
    if errors and fmt != "openai":  # every other format writes error rows among the others
        raise OutputError(f"--errors is for --format openai; --format {fmt} writes error rows into --output with "
                          f"the others (their status column says which). Leave --errors out.")
    con, manifest = open_results(url)
    if fmt == "openai":
        from overnight.pipeline.tools.status import job_status

        if job_status(url)["state"] == "running":  # (a batch's output file exists once the batch has ended)
            raise OutputError(f"{url} is still running: --format openai would write the rows not done yet as "
                              f"expired (batch_expired). Export it once the job has ended (`overnight status "
                              f"{url}`), or export the rows done so far with --format jsonl or parquet.")
    query, in_order = _ordered(con, manifest or {}, url)
    if fmt == "csv":  # a nested value (logprobs, a list of stops, a struct passed through) as JSON text in its cell
        query = _nested_as_json(con, query)
    if fmt in ("parquet", "csv"):
        opts = "(format parquet, compression zstd)" if fmt == "parquet" else "(header, format csv)"
        try:
            con.sql(f"copy ({query}) to {_q(output)} {opts}")
        except duckdb.IOException as e:
            raise OutputError(f"--output {output}: cannot be written ({_first_line(e)}); give a path in a folder "
                              f"that exists and is writable.") from None
        n = con.execute(f"select count(*) from ({query})").fetchone()[0]
        return {"rows": n, "in_input_order": in_order, "output": output}
    if fmt == "jsonl":
        with _writing(output, "--output") as f:
            n = _write_jsonl(con, query, f)
        return {"rows": n, "in_input_order": in_order, "output": output}
    return _openai(con, manifest or {}, in_order, output, errors, url)


def _nested_as_json(con, query: str) -> str:
    """Each nested column's value as JSON text, the JSON jsonl writes for it: DuckDB's to_json where it writes the
    same as json's encoder, json's encoder (a Python function DuckDB calls for each value, ~4x slower:
    benchmarks/export_formats.py) where it does not (``_to_json_keeps``), and for a value in which to_json wrote NaN
    or Infinity, which JSON has not, that text read back and written again with them null (``_finite_json``)."""
    cells = []
    for name, kind, *_ in con.execute(f"describe ({query})").fetchall():
        if not _is_nested(kind):
            continue
        col = _ident(name)
        if not _to_json_keeps(kind):
            cells.append(f"{_python_json(con, kind)}({col}) as {col}")
        elif _holds_floats(kind):
            text = f"to_json({col})::varchar"
            cells.append(f"case when regexp_matches({text}, '{NON_FINITE}') then {_finite_json_function(con)}({text}) "
                         f"else {text} end as {col}")
        else:
            cells.append(f"to_json({col}) as {col}")
    return f"select * replace ({', '.join(cells)}) from ({query})" if cells else query


def _is_nested(kind: str) -> bool:
    return kind.endswith("]") or kind.startswith(("STRUCT", "MAP", "UNION"))


def _holds_floats(kind: str) -> bool:
    """A type with floats in it, in which to_json may write NaN or Infinity."""
    return "FLOAT" in kind or "DOUBLE" in kind


# A bare NaN or Infinity in to_json's text, as a value (after [ , or :, before ] , or }). Inside a string it may
# match too (a token "x:NaN}"); that text then only takes the slower path, to the same JSON.
NON_FINITE = r"[\[,:](?:NaN|-?Infinity)[\],}]"
_NANOSECONDS = re.compile(r"\b(?:TIMESTAMP|TIMESTAMPTZ|TIME)_NS\b")
_WIDE_DECIMAL = re.compile(r"DECIMAL\((?:1[6-9]|[2-9]\d)\b")   # 16 digits or more: to_json writes 1, json 1.0
_TEXT_KEY_MAP = re.compile(r"MAP\((?:VARCHAR|BOOLEAN|U?(?:TINY|SMALL|BIG|HUGE)?INT(?:EGER)?|UUID),")


def _to_json_keeps(kind: str) -> bool:
    """Whether to_json writes each finite value of this nested type as json's encoder does (a nanosecond timestamp
    or time keeps its nanoseconds, which a Python datetime drops). Not: bytes (raw text), a time (12:00:00.5 against
    12:00:00.500000; a field's name with TIME in it only takes the slower path), an interval, bits, a union
    (tagged), JSON (itself, against text), a VARIANT or GEOMETRY (whatever they hold), a DECIMAL of 16 digits or
    more, or a map keyed by other than text, an integer or a uuid (to_json writes a key of 1.50 as "1.50", json
    "1.5"). Such a type with nanoseconds in it too goes through json's encoder, and loses them."""
    rest = _NANOSECONDS.sub("", kind)
    return not (any(t in rest for t in ("BLOB", "TIME", "INTERVAL", "BIT", "UNION", "JSON", "VARIANT", "GEOMETRY"))
                or _WIDE_DECIMAL.search(kind) or kind.count("MAP(") != len(_TEXT_KEY_MAP.findall(kind)))


def _python_json(con, kind: str) -> str:
    """A DuckDB function of one value of this type: json's own encoder's JSON text for it (_json)."""
    name = f"overnight_json_{next(_FUNCTIONS)}"
    con.create_function(name, _json, [con.sqltype(kind)], "VARCHAR", side_effects=False)
    return name


def _python_str(con, kind: str) -> str:
    """A DuckDB function of one value of this type: the text json's encoder writes for it (str(), for a date or a
    datetime out of what strftime writes as Python does: infinity, before year 1 or after 9999)."""
    name = f"overnight_str_{next(_FUNCTIONS)}"
    con.create_function(name, _default, [con.sqltype(kind)], "VARCHAR", side_effects=False)
    return name


def _finite_json(text: str) -> str:
    """JSON text that may hold NaN or Infinity (to_json's) with null for them, as json's encoder writes them."""
    return json.dumps(_finite(json.loads(text)), separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _finite_json_function(con) -> str:
    name = f"overnight_finite_json_{next(_FUNCTIONS)}"
    con.create_function(name, _finite_json, ["VARCHAR"], "VARCHAR", side_effects=False)
    return name


_FUNCTIONS = itertools.count()


def _jsonl_cell(con, name: str, kind: str) -> str:
    """SQL for one column's value in a jsonl line: the JSON json's own encoder writes for what DuckDB fetches."""
    col = _ident(name)
    if _is_nested(kind):
        # to_json's own, its NaN and Infinity made null in the whole line (_write_jsonl)
        return col if _to_json_keeps(kind) else f"{_python_json(con, kind)}({col})::json"
    if kind in ("FLOAT", "DOUBLE"):
        return f"case when isfinite({col}) then {col} end"   # NaN and infinity: null
    if kind == "BLOB":
        return f"base64({col})"
    if kind in ("TIMESTAMP", "TIMESTAMP_MS", "TIMESTAMP_S"):   # as Python writes a datetime
        ts = f"{col}::timestamp"
        return (f"case when {ts} between '0001-01-01' and '9999-12-31 23:59:59.999999' then (case when "
                f"microsecond({ts}) % 1000000 = 0 then strftime({ts}, '%Y-%m-%d %H:%M:%S') "
                f"else strftime({ts}, '%Y-%m-%d %H:%M:%S.%f') end) else {_python_str(con, kind)}({col}) end")
    if kind == "DATE":
        return f"case when {col} between '0001-01-01' and '9999-12-31' then {col}::varchar " \
               f"else {_python_str(con, kind)}({col}) end"
    if kind == "JSON":
        return f"{col}::varchar"   # text, as fetched
    if _AS_IS.match(kind) or _NANOSECONDS.search(kind):
        return col
    return f"{_python_json(con, kind)}({col})::json"   # (a time, a zoned timestamp, an interval, bits, a wide DECIMAL)


# Types DuckDB writes into JSON as json's encoder writes the Python value it fetches (a DECIMAL of up to 15 digits
# as a number both).
_AS_IS = re.compile(r"^(?:VARCHAR|BOOLEAN|U?(?:TINY|SMALL|BIG|HUGE)?INT(?:EGER)?|UUID|DECIMAL\((?:\d|1[0-5]),.*|"
                    r'ENUM\(.*|"NULL")$')
# Characters a JSON string may hold raw that str.splitlines() splits a line at (DuckDB writes them raw; json's
# encoder escapes every character past ASCII). The others (\n, \r, \v, \f, \x1c-\x1e) are control characters,
# which JSON escapes.
_LINE_BREAKS = (("\x85", "\\u0085"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))
_BATCH_ROWS = 2048   # lines held at once (a line of 256 tokens' logprobs, top 5, is ~100 KB)


def _write_jsonl(con, query: str, f) -> int:
    """Write the query's rows to ``f`` as JSON lines, DuckDB building each line (10-12x faster than json's encoder
    per row: benchmarks/export_formats.py); the values are those json's encoder writes for what DuckDB fetches
    (NaN and infinity as null, bytes as base64, a DECIMAL as a number, a timestamp as str() gives it). A line in
    which to_json wrote NaN or Infinity (a nested float) is read back and written again with them null. Returns the
    number of lines."""
    import pyarrow.compute as pc

    cols = con.execute(f"describe ({query})").fetchall()
    fields = ", ".join(f"{_ident(name)} := {_jsonl_cell(con, name, kind)}" for name, kind, *_ in cols)
    line = f"to_json(struct_pack({fields}))::varchar"
    if any(_is_nested(kind) and _to_json_keeps(kind) and _holds_floats(kind) for _, kind, *_ in cols):
        line = f"case when regexp_matches({line}, '{NON_FINITE}') then {_finite_json_function(con)}({line}) " \
               f"else {line} end"
    try:   # a batch's text may pass 2 GiB (Arrow's offsets in a plain string array)
        con.execute("set arrow_large_buffer_size = true")
    except Exception:  # noqa: BLE001 (a DuckDB without the setting)
        pass
    lines = con.sql(f"select {line} as line from ({query})")
    reader = lines.to_arrow_reader(_BATCH_ROWS) if hasattr(lines, "to_arrow_reader") else lines.fetch_record_batch(
        _BATCH_ROWS)
    n = 0
    for batch in reader:
        text = batch.column(0)
        for char, escaped in _LINE_BREAKS:
            text = pc.replace_substring(text, char, escaped)
        if len(text):
            f.write("\n".join(text.to_pylist()) + "\n")
            n += len(text)
    return n


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _writing(path: str, option: str):
    """``path`` opened for writing, or an OutputError that names the option and the path."""
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as e:
        raise OutputError(f"{option} {path}: cannot be written ({e.strerror or e}); give a path in a folder that "
                          f"exists and is writable.") from None


def _json(value) -> str:
    """One JSON line, each value as json_value gives it (the same JSON type on every line): json's own encoder,
    with DECIMAL and bytes through its ``default`` hook; the walk of _finite only for a line with a NaN. (A DuckDB
    function of one value too: _python_json.)"""
    return _dumps(value)


def _dumps(value, **style) -> str:
    try:
        return json.dumps(value, default=_default, allow_nan=False, **style)
    except (ValueError, TypeError):  # (TypeError: a map's key that is not text, as bytes)
        return json.dumps(_finite(value), default=str, allow_nan=False, **style)


def _line(value) -> str:
    """An OpenAI line built in Python, written as DuckDB writes the others (ok_line_sql): compact, characters past
    ASCII as UTF-8 but for the line breaks of _LINE_BREAKS."""
    text = _dumps(value, separators=(",", ":"), ensure_ascii=False)
    for char, escaped in _LINE_BREAKS:
        if char in text:
            text = text.replace(char, escaped)
    return text


def _default(value):
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    return str(value)


def json_value(value):
    """A value as JSON holds it: a float JSON cannot hold (NaN, infinity) as null, a DECIMAL as a number, bytes
    (a binary passthrough column's) as base64 text."""
    return _finite(value)


def csv_cell(value):
    """A value in a CSV cell, as `export --format csv` writes it: a nested one (a list, a struct, a map) as JSON,
    bytes as base64, a float JSON cannot hold as itself (the cell is text); anything else as csv writes it."""
    if isinstance(value, (dict, list, tuple)):
        return _json(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    return value


def _finite(value):
    if isinstance(value, decimal.Decimal):
        value = float(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k if isinstance(k, (str, int, bool)) or k is None or isinstance(k, float) and math.isfinite(k) else
                _finite(k) if isinstance(k, (bytes, bytearray, memoryview, decimal.Decimal)) else str(k): _finite(v)
                for k, v in value.items()}  # (a key JSON cannot hold: bytes as base64, NaN as "nan")
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _openai(con, manifest: dict, in_order: bool, output: str, errors: Optional[str], url: str) -> dict:
    id_col = manifest.get("fingerprint_fields", {}).get("id_column", "id")
    model = manifest.get("fingerprint_fields", {}).get("model", "")
    kinds = {r[0]: r[1] for r in con.execute("describe results").fetchall()}
    cols = set(kinds)
    index = "sample_index" if "sample_index" in cols else "0"
    logprobs = "logprobs" if "logprobs" in cols else "null"
    # A row's adapter answers as its model, as in vLLM: the model column names it (an OUT written before it did:
    # the row's lora column, when passed through)
    quoted = model.replace("'", "''")
    before = "nullif(trim(lora::varchar), '')" if "lora" in cols else "null"
    lora = f"case when model is distinct from '{quoted}' then model else {before} end"
    query = _in_order(id_col, cols, raw=True) if in_order else f"select *, {_raw_guess(manifest, cols)} as {RAW} " \
                                                               f"from results"
    # An ok row of one sample (most rows): its line built by DuckDB, but for a /v1/completions line's logprobs
    by_duckdb = (one_sample(con, index) and ID_AS_TEXT.match(kinds.get(id_col, "")) is not None
                 and (logprobs == "null" or LOGPROBS_AS_WRITTEN.match(kinds[logprobs]) is not None))
    raw = f"coalesce({RAW}, false)"
    line = ok_line_sql(f'"{id_col}"', "text", "finish_reason", "prompt_tokens", "output_tokens", "epoch(finished_at)",
                       f"coalesce(nullif({lora}, ''), '{quoted}')", logprobs, raw) if by_duckdb else "null"
    fast = (f"status = 'ok' and \"{id_col}\" is not null and not ({raw} and {logprobs} is not null)" if by_duckdb
            else "false")
    cur = con.execute(f"select \"{id_col}\", status, case when {fast} then null else text end, finish_reason, "
                      f"prompt_tokens, output_tokens, error, epoch(finished_at), {index}, "
                      f"case when {fast} then null else {logprobs} end, {lora}, coalesce({RAW}, false), "
                      f"case when {fast} then {line} end from ({query})")
    ok = bad = expired = 0
    same = not errors or os.path.abspath(errors) == os.path.abspath(output)  # one file: opened once
    err = None if same else _writing(errors, "--errors")  # before --output, which opening empties
    try:
        out = _writing(output, "--output")
    except OutputError:
        if err is not None:
            err.close()
        raise
    err = out if same else err
    try:
        # a row's logprobs as Python objects: some 0.35 MB at 40 tokens of 5 alternatives (10k rows held 3.5 GB)
        for rows in _by_row(cur, 10_000 if logprobs == "null" else 500):
            rid, status, _, _, ptok, _, error, finished, _, _, adapter, raw, built = rows[0]
            if built is not None:
                out.write(built + "\n")
                ok += 1
            elif status == "ok":
                one = text_choice if raw else choice  # a /v1/completions line: a text_completion
                choices = [one(r[2], r[3], r[8], r[9]) for r in rows]
                otok = sum(r[5] or 0 for r in rows)
                out.write(_line(ok_line(rid, choices, ptok, otok, finished, adapter or model, raw)) + "\n")
                ok += 1
            else:
                line = error_line(rid, error or "failed")
                err.write(_line(line) + "\n")
                if line["response"] is None:  # its own deadline passed before it ran: OpenAI's batch_expired
                    expired += 1
                else:
                    bad += 1
        if in_order:  # rows of the input that no part holds (by id, or without one by origin): not done
            done = f"select {_result_key(id_col)} k from results"
            left = con.execute(f"select arg_min(_id, _pos), min(_pos) from (select *, {INPUT_KEY} _key from _input) "
                               f"where _in_job and _key not in (select k from ({done}) where k is not null) "
                               f"group by _key order by 2")  # a duplicate id's later rows were skipped, not left
            while batch := left.fetchmany(10_000):
                for rid, _ in batch:
                    err.write(_line(expired_line(rid, EXPIRED)) + "\n")
                    expired += 1
    finally:
        out.close()
        if err is not out:
            err.close()
    return {"rows": ok + bad + expired, "ok": ok, "errors": bad, "expired": expired, "output": output,
            "errors_output": errors or output, "in_input_order": in_order}


def _by_row(cur, rows: int):
    """The result rows grouped by input row: a row's samples (consecutive, in sample_index order) together."""
    group: list = []
    while batch := cur.fetchmany(rows):
        for r in batch:
            if group and (r[0] != group[0][0] or r[0] is None or not r[8]):  # (no sample_index: a part before n)
                yield group
                group = []
            group.append(r)
    if group:
        yield group


def _raw_guess(manifest: dict, cols: set) -> str:
    """Without the input, whether a row came from a /v1/completions line, from its passthrough columns: such a
    line is a prompt without messages (a JSONL job's rows carry both columns unless --passthrough left them out)."""
    from overnight.pipeline.input.openai_batch import SUFFIXES

    given = manifest.get("input") or {}
    url = given.get("url") or ""
    fields = manifest.get("fingerprint_fields", {})
    prompt, messages = fields.get("prompt_column", "prompt"), fields.get("messages_column", "messages")
    jsonl = given.get("jsonl", url.rstrip("/").endswith(SUFFIXES))  # the run's word; before it was kept, the name's
    if not jsonl or prompt not in cols or messages not in cols:
        return "null::boolean"
    return f"(\"{messages}\" is null and \"{prompt}\" is not null)"

