"""The OpenAI Batch API's output lines, as `overnight export --format openai` writes them (pipeline/tools/export.py):
a result row's chat.completion or text_completion, a failed request (HTTP 400/500 in ``response``), and a request
never run (``batch_expired``)."""

from __future__ import annotations

import os
import re

EXPIRED = "This request could not be executed before the completion window expired."


def new_id() -> str:
    """128 random bits as 32 hex digits, as uuid4().hex looks, straight from the OS's random source (thread- and
    fork-safe): three ids a line, where uuid4 cost a third of a million-row export's time."""
    return os.urandom(16).hex()


def choice(text, finish, index, logprobs) -> dict:
    return {"index": index or 0, "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": None if logprobs is None else {"content": [token(t, True) for t in logprobs],
                                                       "refusal": None},
            "finish_reason": finish or "stop"}


def text_choice(text, finish, index, logprobs) -> dict:
    """A /v1/completions choice; logprobs in the legacy shape: tokens, token_logprobs, top_logprobs ({token:
    logprob} of the K most likely) and text_offset (where each token starts in the text)."""
    lp = None
    if logprobs is not None:
        offsets, at = [], 0
        for t in logprobs:
            offsets.append(at)
            at += len(t.get("token") or "")
        lp = {"tokens": [t.get("token") or "" for t in logprobs],
              "token_logprobs": [logprob(t) for t in logprobs],
              "top_logprobs": [{a.get("token") or "": logprob(a) for a in t.get("top_logprobs") or []}
                               for t in logprobs],
              "text_offset": offsets}
    return {"text": text or "", "index": index or 0, "logprobs": lp, "finish_reason": finish or "stop"}


def logprob(t: dict) -> float:
    return max(t["logprob"], -9999.0) if t.get("logprob") is not None else -9999.0


def token(t: dict, top: bool) -> dict:
    """One token of the logprobs column in OpenAI's shape (bytes: the token text's UTF-8)."""
    text = t.get("token") or ""
    out = {"token": text, "logprob": logprob(t), "bytes": list(text.encode("utf-8", "surrogatepass"))}
    if top:
        out["top_logprobs"] = [token(a, False) for a in t.get("top_logprobs") or []]
    return out


def ok_line(rid, choices, ptok, otok, finished, model, text: bool = False) -> dict:
    """An OpenAI Batch output line: a chat.completion body, or for a /v1/completions line (``text``) a
    text_completion."""
    request = f"req_{new_id()}"
    kind, prefix = ("text_completion", "cmpl") if text else ("chat.completion", "chatcmpl")
    return {"id": f"batch_req_{new_id()}", "custom_id": str(rid), "error": None,
            "response": {"status_code": 200, "request_id": request, "body": {
                "id": f"{prefix}-{new_id()}", "object": kind, "created": int(finished or 0),
                "model": model,
                "choices": choices,
                "usage": {"prompt_tokens": ptok or 0, "completion_tokens": otok or 0,
                          "total_tokens": (ptok or 0) + (otok or 0)}}}}


def ok_line_sql(rid: str, text: str, finish: str, ptok: str, otok: str, finished: str, model: str,
                logprobs: str = "null", raw: str = "false") -> str:
    """DuckDB's SQL for ok_line's JSON text of a chat.completion with one choice, from SQL for its values (as
    ok_line and choice take them: ``finished`` in epoch seconds, ``logprobs`` the column or null): the same JSON,
    built in DuckDB rather than Python's json (benchmarks/export_openai.py). Where ``raw`` (SQL for a boolean: the
    row came from a /v1/completions line) is true, a text_completion's as text_choice makes it, without logprobs
    (the legacy shape's {token: logprob} objects are Python's). Its ids are random UUIDs' 32 hex digits
    (gen_random_uuid: 122 random bits). One line, compact: U+0085, U+2028 and U+2029, which JSON strings hold raw
    and str.splitlines() splits at, escaped."""
    def new() -> str:
        return "replace(gen_random_uuid()::varchar, '-', '')"

    ptok, otok = f"coalesce({ptok}, 0)::bigint", f"coalesce({otok}, 0)::bigint"
    finish = f"coalesce(nullif({finish}, ''), 'stop')"

    def line_of(prefix: str, kind: str, choice: str) -> str:
        return (f"to_json({{'id': 'batch_req_' || {new()}, 'custom_id': ({rid})::varchar, 'error': null, "
                f"'response': {{'status_code': 200, 'request_id': 'req_' || {new()}, 'body': {{"
                f"'id': '{prefix}-' || {new()}, 'object': '{kind}', "
                f"'created': coalesce(trunc({finished})::bigint, 0), 'model': {model}, 'choices': [{choice}], "
                f"'usage': {{'prompt_tokens': {ptok}, 'completion_tokens': {otok}, "
                f"'total_tokens': {ptok} + {otok}}}}}}}}})::varchar")

    line = line_of("chatcmpl", "chat.completion",
                   f"{{'index': 0, 'message': {{'role': 'assistant', 'content': {text}, 'refusal': null}}, "
                   f"'logprobs': {_logprobs_sql(logprobs)}, 'finish_reason': {finish}}}")
    if raw != "false":
        text_line = line_of("cmpl", "text_completion",
                            f"{{'text': coalesce({text}, ''), 'index': 0, 'logprobs': null, "
                            f"'finish_reason': {finish}}}")
        line = f"case when {raw} then {text_line} else {line} end"
    for char in (0x85, 0x2028, 0x2029):
        line = f"replace({line}, chr({char}), '\\u{char:04x}')"
    return line


def _logprobs_sql(column: str) -> str:
    """choice's ``logprobs`` in SQL: null, or the tokens of the logprobs column as token() writes them."""
    if column == "null":
        return "null"

    def token_sql(t: str, top: bool) -> str:
        text = f"coalesce({t}.token, '')"
        hexed = f"hex(encode({text}))"
        value = f"{t}.logprob::double"   # NaN and +inf: null, as json_value writes what JSON cannot hold
        out = (f"'token': {text}, 'logprob': case when isnan({value}) or {value} = 'infinity'::double then null "
               f"else greatest(coalesce({value}, -9999.0), -9999.0) end, "
               f"'bytes': list_transform(range(octet_length(encode({text}))), "
               f"lambda i: ('0x' || substr({hexed}, 2 * i + 1, 2))::integer)")
        if top:
            out += (f", 'top_logprobs': list_transform(coalesce({t}.top_logprobs, []), "
                    f"lambda a: {token_sql('a', False)})")
        return "{" + out + "}"

    return (f"case when {column} is null then null else {{'content': list_transform({column}, lambda t: "
            f"{token_sql('t', True)}), 'refusal': null}} end")


def one_sample(con, index: str) -> bool:
    """Whether every row of the results (a DuckDB view) is one sample: no row asked for n > 1 (a part written before
    sample_index was, beside one after it: null)."""
    return index == "0" or not con.execute(f"select max(coalesce({index}, 0)) from results").fetchall()[0][0]


# The id types whose ::varchar in ok_line_sql is the str() of ok_line's custom_id
ID_AS_TEXT = re.compile(r"^(?:VARCHAR|U?(?:TINY|SMALL|BIG|HUGE)?INT(?:EGER)?)$")
# A logprobs column of the shape the output writes (pipeline/output/schema.py: each token's top_logprobs, as
# _logprobs_sql reads them); another (a folder written by hand) goes through Python's token()
LOGPROBS_AS_WRITTEN = re.compile(r"^STRUCT\(.*\btoken VARCHAR, logprob (?:FLOAT|DOUBLE), top_logprobs STRUCT\(.*"
                                 r"\btoken VARCHAR, logprob (?:FLOAT|DOUBLE)\)\[\]\)\[\]$")


def error_line(rid, message: str) -> dict:
    """An error row as OpenAI writes a failed request: the HTTP error in ``response`` (400, ``invalid_request_error``;
    500, ``server_error``, for the engine's own internal error) and ``error`` null; a row whose own deadline passed
    before it could start as one OpenAI never reached (``_expired_line``)."""
    from overnight.pipeline.records import DEADLINE_PASSED, ENGINE_INTERNAL_ERROR, NO_ROOM_FOR_OUTPUT

    if DEADLINE_PASSED in message:
        return expired_line(rid, message)
    status, kind = (500, "server_error") if ENGINE_INTERNAL_ERROR in message else (400, "invalid_request_error")
    code = "context_length_exceeded" if NO_ROOM_FOR_OUTPUT in message else None
    return {"id": f"batch_req_{new_id()}", "custom_id": None if rid is None else str(rid),
            "response": {"status_code": status, "request_id": f"req_{new_id()}",
                         "body": {"error": {"message": message, "type": kind, "param": None, "code": code}}},
            "error": None}


def expired_line(rid, message: str) -> dict:
    """A row never run: OpenAI's line for a request its batch did not reach in the completion window."""
    return {"id": f"batch_req_{new_id()}", "custom_id": None if rid is None else str(rid),
            "response": None, "error": {"code": "batch_expired", "message": message}}
