"""`overnight export OUT`: the job's results as one file, in input order.

    parquet | jsonl | csv   every row of every part (all shards and workers), one file, in the input's order
    openai                  the OpenAI Batch API's output lines: a chat.completion body per ok row, its n samples
                            as ``choices`` (index = sample_index), logprobs in OpenAI's ``choices[i].logprobs``;
                            error rows and the rows never done (as ``batch_expired``, like OpenAI at its 24-hour
                            limit) go to the --errors file, or into the output when none is given

Input order comes from the input itself (its ids, or its file and row for derived ids), read with DuckDB from
the path the manifest records (OpenAI Batch request lines: each line's custom_id, streamed line by line); rows
whose id is no longer in the input come last.
"""

from __future__ import annotations

import itertools
import json
import os
import uuid
from typing import Optional

from overnight.pipeline.output.checkpoint import OutputError
from overnight.pipeline.tools.inspection import open_results

FORMATS = ("parquet", "jsonl", "csv", "openai")
EXPIRED = "This request could not be executed before the completion window expired."


def _q(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _ordered(con, manifest: dict) -> tuple[str, bool]:
    """A view of results in input order, and whether the input could be read for it."""
    fields = manifest.get("fingerprint_fields", {})
    id_col = fields.get("id_column", "id")
    url = (manifest.get("input") or {}).get("url")
    cols = {r[0] for r in con.execute("describe results").fetchall()}
    if not url or id_col not in cols:
        return "select * from results", False
    from overnight.pipeline.input.openai_batch import is_jsonl_input

    try:
        jsonl = is_jsonl_input(url)
    except Exception:  # a folder of both kinds: the run would have refused it
        jsonl = False
    if jsonl:
        if not _line_ids(con, url):
            return "select * from results", False
        return _in_order(id_col, cols), True
    path = url if not os.path.isdir(url) else os.path.join(url, "**", "*.parquet")
    try:
        names = {r[0] for r in con.execute(f"describe select * from read_parquet({_q(path)}, union_by_name = true)"
                                           ).fetchall()}
    except Exception:  # the input moved or is not reachable from here: finish order
        return "select * from results", False
    if id_col in names:
        src = f"select \"{id_col}\" as _id, row_number() over () as _pos from read_parquet({_q(path)}, " \
              f"union_by_name = true)"
    else:
        src = f"select parse_filename(filename) || '#' || (file_row_number) as _id, " \
              f"row_number() over (order by filename, file_row_number) as _pos from read_parquet({_q(path)}, " \
              f"filename = true, file_row_number = true, union_by_name = true)"
    con.sql(f"create or replace temp view _input as {src}")
    return _in_order(id_col, cols), True


def _in_order(id_col: str, cols: set) -> str:
    """The results ordered by the view or table ``_input`` (_id, _pos)."""
    samples = f", r.\"{id_col}\", r.sample_index" if "sample_index" in cols else ""  # a row's samples together
    return (f"select r.* from results r left join (select _id, min(_pos) _pos from _input group by 1) i "
            f"on r.\"{id_col}\"::varchar = i._id::varchar order by i._pos nulls last{samples}")


def _line_ids(con, url: str) -> bool:
    """The table ``_input`` (_id, _pos) of an OpenAI Batch input: each line's custom_id and its position, read
    line by line into DuckDB in batches (the file is never loaded whole). False when the input cannot be read."""
    import pyarrow as pa

    from overnight.pipeline.input.openai_batch import line_ids

    schema = pa.schema([("_id", pa.string()), ("_pos", pa.int64())])

    def batches():
        ids, pos = line_ids(url), 0
        while chunk := list(itertools.islice(ids, 65536)):
            yield pa.record_batch([pa.array(chunk, pa.string()),
                                   pa.array(range(pos + 1, pos + len(chunk) + 1), pa.int64())], schema=schema)
            pos += len(chunk)

    reader = pa.RecordBatchReader.from_batches(schema, batches())
    try:
        con.register("_input_lines", reader)
        con.execute("create or replace temp table _input as select * from _input_lines")
    except Exception:  # the input moved or is not reachable from here: finish order
        return False
    finally:
        con.unregister("_input_lines")
    return True


def export(url: str, fmt: str, output: str, errors: Optional[str] = None) -> dict:
    if fmt not in FORMATS:
        raise OutputError(f"--format {fmt}: use one of {', '.join(FORMATS)}.")
    con, manifest = open_results(url)
    query, in_order = _ordered(con, manifest or {})
    if fmt in ("parquet", "csv"):
        opts = "(format parquet, compression zstd)" if fmt == "parquet" else "(header, format csv)"
        con.sql(f"copy ({query}) to {_q(output)} {opts}")
        n = con.execute(f"select count(*) from ({query})").fetchone()[0]
        return {"rows": n, "in_input_order": in_order, "output": output}
    if fmt == "jsonl":
        cur = con.execute(query)
        names = [d[0] for d in cur.description]
        n = 0
        with open(output, "w", encoding="utf-8") as f:
            while batch := cur.fetchmany(10_000):
                for row in batch:
                    f.write(json.dumps(dict(zip(names, row)), default=str) + "\n")
                    n += 1
        return {"rows": n, "in_input_order": in_order, "output": output}
    return _openai(con, manifest or {}, query, in_order, output, errors)


def _openai(con, manifest: dict, query: str, in_order: bool, output: str, errors: Optional[str]) -> dict:
    id_col = manifest.get("fingerprint_fields", {}).get("id_column", "id")
    model = manifest.get("fingerprint_fields", {}).get("model", "")
    cols = {r[0] for r in con.execute("describe results").fetchall()}
    index = "sample_index" if "sample_index" in cols else "0"
    logprobs = "logprobs" if "logprobs" in cols else "null"
    lora = "lora::varchar" if "lora" in cols else "null"   # a row's adapter answers as its model, as in vLLM
    cur = con.execute(f"select \"{id_col}\", status, text, finish_reason, prompt_tokens, output_tokens, error, "
                      f"epoch(finished_at), {index}, {logprobs}, {lora} from ({query})")
    ok = bad = expired = 0
    out = open(output, "w", encoding="utf-8")
    err = open(errors, "w", encoding="utf-8") if errors else out
    try:
        for rows in _by_row(cur):
            rid, status, _, _, ptok, _, error, finished, _, _, adapter = rows[0]
            if status == "ok":
                choices = [_choice(r[2], r[3], r[8], r[9]) for r in rows]
                otok = sum(r[5] or 0 for r in rows)
                out.write(json.dumps(_ok_line(rid, choices, ptok, otok, finished, adapter or model)) + "\n")
                ok += 1
            else:
                err.write(json.dumps(_error_line(rid, "invalid_request", error or "failed")) + "\n")
                bad += 1
        if in_order:  # rows of the input that no part holds: not done when the job stopped
            done_ids = f"select \"{id_col}\"::varchar from results where \"{id_col}\" is not null"
            left = con.execute(f"select _id from _input where _id::varchar not in ({done_ids}) order by _pos")
            while batch := left.fetchmany(10_000):
                for (rid,) in batch:
                    err.write(json.dumps(_error_line(rid, "batch_expired", EXPIRED)) + "\n")
                    expired += 1
    finally:
        out.close()
        if err is not out:
            err.close()
    return {"rows": ok + bad + expired, "ok": ok, "errors": bad, "expired": expired, "output": output,
            "errors_output": errors or output, "in_input_order": in_order}


def _by_row(cur):
    """The result rows grouped by input row: a row's samples (consecutive, in sample_index order) together."""
    group: list = []
    while batch := cur.fetchmany(10_000):
        for r in batch:
            if group and (r[0] != group[0][0] or r[0] is None or r[8] == 0):
                yield group
                group = []
            group.append(r)
    if group:
        yield group


def _choice(text, finish, index, logprobs) -> dict:
    return {"index": index or 0, "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": None if logprobs is None else {"content": [_token(t, True) for t in logprobs],
                                                       "refusal": None},
            "finish_reason": finish or "stop"}


def _token(t: dict, top: bool) -> dict:
    """One token of the logprobs column in OpenAI's shape (bytes: the token text's UTF-8)."""
    token = t.get("token") or ""
    logprob = t.get("logprob")
    out = {"token": token, "logprob": max(logprob, -9999.0) if logprob is not None else -9999.0,
           "bytes": list(token.encode("utf-8", "surrogatepass"))}
    if top:
        out["top_logprobs"] = [_token(a, False) for a in t.get("top_logprobs") or []]
    return out


def _ok_line(rid, choices, ptok, otok, finished, model) -> dict:
    request = f"req_{uuid.uuid4().hex}"
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": str(rid), "error": None,
            "response": {"status_code": 200, "request_id": request, "body": {
                "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(finished or 0),
                "model": model,
                "choices": choices,
                "usage": {"prompt_tokens": ptok or 0, "completion_tokens": otok or 0,
                          "total_tokens": (ptok or 0) + (otok or 0)}}}}


def _error_line(rid, code: str, message: str) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": None if rid is None else str(rid),
            "response": None, "error": {"code": code, "message": message}}
