"""Per-row checks: a record batch becomes parsed rows and error results, never an exception.

A row with a null or empty prompt, a malformed chat, or a per-row column of
the wrong type becomes an error result whose message names the file, the row
and the column, and says what a valid value looks like. The per-row columns'
checks are ``checks``'s. So does a row with a value Python cannot hold (text
that is not UTF-8, a timestamp out of range), an id that is not UTF-8, or a
value a check fails on unexpectedly.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Collection, Optional

import pyarrow as pa

from overnight.pipeline.config import InputConfig, SamplingConfig
from overnight.pipeline.records import Result
from overnight.pipeline.input.checks import (_OVERRIDE_CHECKS, _SCHEDULING_CHECKS, STRUCTURED_COLUMNS, RowError,
                                             _check_request, _short, job_structured)
from overnight.pipeline.input.arrow_types import BAD_IDS_KEY, BAD_VALUES_KEY
from overnight.pipeline.input.openai_body import ROLE_ALIASES
from overnight.pipeline.input.source import (INPUT_ERROR_COLUMN, OVERRIDE_COLUMNS, RAW_PROMPT_COLUMN,
                                             SCHEDULING_COLUMNS, SourceBatch, _first_line)

CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(slots=True)
class Parsed:
    """A row whose columns passed the checks; its prompt is not tokenized yet."""

    id: Any
    origin: str
    passthrough: dict
    sampling: dict
    prompt: Optional[str]
    messages: Optional[list]
    # priority / value / deadline_at, from the per-row columns when present
    scheduling: dict
    # Hash of the prompt (or chat) as given: a resume can tell when a row changed under the same id.
    prompt_hash: str
    # The prompt goes to the model as given, without the chat template (an OpenAI Batch /v1/completions line).
    raw: bool = False


NO_PROMPT = "\0no prompt"  # what a row with neither is hashed as: a prompt given later shows as changed


def prompt_hash(prompt, messages) -> str:
    """16 hex digits of BLAKE2b over the prompt text, or the chat as JSON (or NO_PROMPT, for neither)."""
    data = messages if messages is not None else prompt
    if data is None:
        data = NO_PROMPT
    text = data if isinstance(data, str) else json.dumps(data, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def sampling_defaults(cfg: SamplingConfig) -> dict:
    return {
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "repetition_penalty": cfg.repetition_penalty,
        "min_p": cfg.min_p,
        "seed": cfg.seed,
        "stop": list(cfg.stop),
        "stop_token_ids": list(cfg.stop_token_ids),
        "presence_penalty": cfg.presence_penalty,
        "frequency_penalty": cfg.frequency_penalty,
        "min_tokens": cfg.min_tokens,
        "structured": job_structured(cfg),
        "n": cfg.n,
        "logprobs": cfg.logprobs,
        "lora": None,
    }


def parse_batch(sb: SourceBatch, cfg: InputConfig, defaults: dict, passthrough: list[str],
                loras: Optional[Collection[str]] = None) -> tuple[list[Parsed], list[Result]]:
    """loras: the adapter names registered with --lora, which a row's lora column may pick (None: not checked)."""
    batch = sb.batch
    names = batch.schema.names
    n = batch.num_rows
    ids = _column(batch, cfg.id_column) if cfg.id_column in names else None
    prompts = _texts(batch.column(cfg.prompt_column)) if cfg.prompt_column in names else [None] * n
    messages = _column(batch, cfg.messages_column) if cfg.messages_column in names else None
    # Columns the JSONL source writes, honoured only from its files (a Parquet column of such a name is ordinary):
    # a row it could not read (a malformed line) carries its problem, a completions line its raw prompt.
    internal = [c for c in (INPUT_ERROR_COLUMN, RAW_PROMPT_COLUMN) if c in names and c in sb.file.internal_columns]
    unreadable = _column(batch, INPUT_ERROR_COLUMN) if INPUT_ERROR_COLUMN in internal else [None] * n
    raw = _column(batch, RAW_PROMPT_COLUMN) if RAW_PROMPT_COLUMN in internal else [None] * n
    overrides = {c: _column(batch, c) for c in OVERRIDE_COLUMNS if c in names}
    structured = [c for c in STRUCTURED_COLUMNS if c in overrides]
    scheduling = {c: _column(batch, c) for c in SCHEDULING_COLUMNS if c in names}
    kept = [c for c in passthrough if c in names]
    text = (cfg.prompt_column, cfg.messages_column)   # passed through as the text they are (job._as_output)
    carried_columns = {c: (_column(batch, c) if c in text else _carried(batch, c)) for c in kept}
    carried = [{c: v[i] for c, v in carried_columns.items()} for i in range(n)]
    # ids the source read as null because they were not valid UTF-8 (arrow_types.BAD_IDS_KEY): {row number: why}
    bad_ids = _bad_ids(batch, cfg.id_column) if ids is not None else {}
    # request values that could not take the type the files share (arrow_types.BAD_VALUES_KEY): {column: {row: value}}
    uncast = {c: v for c in (*overrides, *scheduling) if (v := _meta(batch, c, BAD_VALUES_KEY))}

    parsed: list[Parsed] = []
    errors: list[Result] = []
    for i in range(n):
        row_no = sb.row_number(i)
        origin = f"{sb.file.name}#{row_no}"
        row_id = ids[i] if ids is not None else origin
        try:
            if unreadable[i] is not None:
                raise RowError(unreadable[i])
            if isinstance(row_id, _BadText) or (row_id is None and str(row_no) in bad_ids):
                reason = row_id if row_id is not None else bad_ids[str(row_no)]
                row_id = None  # an error row without an id, matched by its origin on a resume, as a null id's
                raise RowError(f"column {cfg.id_column!r} is not valid text: {reason}; re-encode the ids as UTF-8, "
                               f"or drop the column so ids are derived from file and row")
            if row_id is None:
                raise RowError(f"column {cfg.id_column!r} is null; give every row an id, or drop the column "
                               f"so ids are derived from file and row")
            for col, bad in uncast.items():
                if str(row_no) in bad:
                    raise RowError(f"{col} is {bad[str(row_no)]}, which {batch.schema.field(col).type} (the type "
                                   f"{col!r} has in the input's other files) cannot hold; fix the value, or set it "
                                   f"to null")
            sampling = dict(defaults)
            given = [c for c in structured if overrides[c][i] is not None] if len(structured) > 1 else ()
            if len(given) > 1:
                raise RowError(f"the row sets {' and '.join(given)}, and a request takes one structured output; "
                               f"keep one of them and set the others to null")
            for col, values in overrides.items():
                if values[i] is not None:
                    key, value = _checked(col, _OVERRIDE_CHECKS[col], values[i])
                    sampling[key] = value
            if overrides:
                _check_request(sampling, loras)
            sched = {}
            for col, values in scheduling.items():
                if values[i] is not None:
                    key, value = _checked(col, _SCHEDULING_CHECKS[col], values[i])
                    sched[key] = value
            chat = _messages(messages[i]) if messages is not None and messages[i] is not None else None
            prompt = None
            if chat is None and messages is not None and cfg.prompt_column not in names:
                raise RowError(f"messages column {cfg.messages_column!r} is null, and the input has no prompt "
                               f"column {cfg.prompt_column!r}; give the row a chat")
            if chat is None:
                prompt = _prompt(prompts[i], cfg.prompt_column)
            for col in kept:
                if isinstance(carried[i][col], (_BadText, _Unreadable)):
                    raise RowError(_bad_value(f"passthrough column {col!r}", carried[i][col],
                                              "leave the column out of --passthrough"))
        except RowError as e:  # (a column's check that fails otherwise on an odd value raises one: _checked)
            message = str(e)
            keep = {c: (None if isinstance(v, (_BadText, _Unreadable)) else v) for c, v in carried[i].items()}
            err = Result.failed(row_id, keep, f"{origin}: {message}")
            err.prompt_hash = _safe_hash(prompts[i], messages[i] if messages is not None else None)
            errors.append(err)
            continue
        parsed.append(Parsed(row_id, origin, carried[i], sampling, prompt, chat, sched,
                             prompt_hash(prompt, chat), raw=chat is None and bool(raw[i])))
    return parsed, errors


def _checked(column: str, check, value):
    """check(value), with any exception but a RowError (a library failing on an odd value: RecursionError,
    OverflowError ...) as a RowError naming the column."""
    if isinstance(value, (_BadText, _Unreadable)):
        raise RowError(_bad_value(column, value, "set it to null"))
    try:
        return check(value)
    except (RowError, MemoryError):
        raise
    except Exception as e:
        raise RowError(f"{column} could not be checked ({type(e).__name__}: {_first_line(e)}); fix the value, or "
                       f"set it to null") from None


def _safe_hash(prompt, messages) -> str:
    try:
        return prompt_hash(prompt, messages)
    except Exception:  # a value that cannot be hashed as text (a chat too deeply nested for JSON, say)
        return ""


def _bad_ids(batch: pa.RecordBatch, name: str) -> dict:
    return _meta(batch, name, BAD_IDS_KEY)


def _meta(batch: pa.RecordBatch, name: str, key: bytes) -> dict:
    meta = batch.schema.field(name).metadata or {}
    return json.loads(meta[key]) if key in meta else {}


# -- columns -----------------------------------------------------------------------------------

def _column(batch: pa.RecordBatch, name: str) -> list:
    """The column's values as Python objects; a value Python cannot hold is a _BadText (text that is not UTF-8)
    or an _Unreadable (a timestamp out of range, say), which makes its row an error row."""
    col = batch.column(name)
    if _is_bytes(col.type):  # text stored without Parquet's UTF8 annotation, as some writers do: read as text
        return _texts(col)
    if (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)) and _is_bytes(col.type.value_type):
        return [None if v is None else _decoded_list(v) for v in col.to_pylist()]
    try:
        return col.to_pylist()
    except MemoryError:
        raise
    except Exception:
        if _is_text(col.type):
            return _texts(col)
        return [_value(col, j) for j in range(len(col))]


def _carried(batch: pa.RecordBatch, name: str) -> list:
    """A passthrough column's values, as the output column is built from them: as _column's, but a nanosecond
    timestamp, duration or time that Python's datetime cannot hold (without pandas, any with nanoseconds) as its
    int64 count, at the top or inside a list, struct or map, from which the output column of the same type is
    built again exactly; a binary column's values as the bytes they are (an image, a hash: written back to a
    binary column, not read as text)."""
    col = batch.column(name)
    t = col.type
    if _is_bytes(t) or ((pa.types.is_list(t) or pa.types.is_large_list(t)) and _is_bytes(t.value_type)):
        return col.to_pylist()  # (a list of them too: _column reads one as text, as a stop list may be stored)
    counts = _ns_as_int64(t)
    if counts is not None:
        try:
            return col.to_pylist()
        except (ValueError, pa.ArrowException):
            col = col.cast(counts)
            return [_value(col, j) for j in range(len(col))]
    return _column(batch, name)


def _is_ns(t: pa.DataType) -> bool:
    return (pa.types.is_timestamp(t) or pa.types.is_duration(t) or pa.types.is_time64(t)) and t.unit == "ns"


def _ns_as_int64(t: pa.DataType) -> Optional[pa.DataType]:
    """``t`` with each nanosecond timestamp, duration or time in it (itself, or inside a list, struct or map) as
    int64: a type its values can be cast to and read as Python objects; None where it holds none."""
    if _is_ns(t):
        return pa.int64()
    if pa.types.is_struct(t):
        fields = [t.field(i) for i in range(t.num_fields)]
        inner = [_ns_as_int64(f.type) for f in fields]
        return None if all(x is None for x in inner) else pa.struct(
            [f if x is None else f.with_type(x) for f, x in zip(fields, inner)])
    if pa.types.is_map(t):
        key, item = _ns_as_int64(t.key_type), _ns_as_int64(t.item_type)
        return None if key is None and item is None else pa.map_(key or t.key_type, item or t.item_type)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        inner = _ns_as_int64(t.value_type)
        if inner is None:
            return None
        field = t.value_field.with_type(inner)
        if pa.types.is_fixed_size_list(t):
            return pa.list_(field, t.list_size)
        return pa.large_list(field) if pa.types.is_large_list(t) else pa.list_(field)
    return None


def _value(col: pa.Array, j: int):
    try:
        return col[j].as_py()
    except UnicodeDecodeError as e:
        return _BadText(f"a string in it is not valid UTF-8 at byte {e.start} ({e.object[e.start:e.start + 1]!r})")
    except MemoryError:
        raise
    except Exception as e:
        return _Unreadable(f"{type(e).__name__}: {_first_line(e)}")


def _is_text(t: pa.DataType) -> bool:
    return (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t))


class _BadText(str):
    """Marks a value that was not valid UTF-8; carries the reason."""


class _Unreadable:
    """Marks a value Python cannot hold (a timestamp out of range, say); carries the reason."""
    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason

    def __repr__(self) -> str:
        return f"<unreadable: {self.reason}>"


def _bad_value(what: str, value, other: str) -> str:
    """The message of a _BadText or _Unreadable value of ``what`` (a column), with the fixes: the usual one, and
    ``other``."""
    if isinstance(value, _BadText):
        return f"{what} is not valid text: {value}; re-encode the file as UTF-8, or {other}"
    return f"{what} holds a value that cannot be read ({value.reason}); fix the value, or {other}"


def _texts(col: pa.Array) -> list:
    """Column values as str, decoding binary columns; invalid UTF-8 becomes a _BadText marker."""
    t = col.type
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return [None if v is None else _decode(v) for v in col.to_pylist()]
    try:
        return col.to_pylist()
    except UnicodeDecodeError:
        return [None if v is None else _decode(v) for v in col.cast(pa.binary()).to_pylist()]


def _is_bytes(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t)


def _decoded_list(values: list):
    """A list of byte strings as text; a _BadText for the whole value where one is not UTF-8."""
    out = [None if v is None else _decode(v) for v in values]
    return next((x for x in out if isinstance(x, _BadText)), out)


def _decode(raw: bytes):
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return _BadText(f"byte {e.start} is not valid UTF-8 ({raw[e.start:e.start + 1]!r})")


# -- prompt and chat ---------------------------------------------------------------------------

def _prompt(value, column: str) -> str:
    if value is None:
        raise RowError(f"prompt column {column!r} is null; give the row a prompt or a 'messages' chat")
    if isinstance(value, _BadText):
        raise RowError(f"prompt column {column!r} is not valid text: {value}; re-encode the file as UTF-8")
    if not value.strip():
        raise RowError(f"prompt column {column!r} is empty; give the row a prompt")
    return value


def _part_text(p) -> Optional[str]:
    "A text content part's text ({type: text, text}, as a struct or a map), else None."
    if isinstance(p, list) and all(isinstance(kv, tuple) and len(kv) == 2 for kv in p):
        p = dict(p)
    ok = isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
    return p["text"] if ok else None


def _messages(value) -> list:
    if isinstance(value, (_BadText, _Unreadable)):
        raise RowError(_bad_value("messages", value, "give the row a prompt instead"))
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise RowError("messages is a string but not JSON; give a list of {role, content}") from None
    if not isinstance(value, list) or not value:
        raise RowError(f"messages must be a non-empty list of {{role, content}}, got {_short(value)}")
    out = []
    for j, m in enumerate(value):
        if isinstance(m, list) and m and all(isinstance(p, tuple) and len(p) == 2 for p in m):
            m = dict(m)  # a map<string, string> message (Spark's array<map<string,string>>): (key, value) pairs
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise RowError(f"messages[{j}] must be a {{role, content}} mapping, got {_short(m)}")
        role, content = m["role"], m["content"]
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in CHAT_ROLES:
            raise RowError(f"messages[{j}].role is {role!r}; use one of {', '.join(CHAT_ROLES)} (or developer, "
                           f"read as system)")
        if isinstance(content, list) and content:
            texts = [_part_text(p) for p in content]  # OpenAI's text content parts, joined as the jsonl input joins them
            content = "\n".join(texts) if None not in texts else content
        if not isinstance(content, str):
            raise RowError(f"messages[{j}].content must be a string or a list of text parts "
                           f"({{type: text, text}}), got {_short(content)}")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:  # a JSON string's lone surrogate ("\ud800"): no text a tokenizer can take
            raise RowError(f"messages[{j}].content is not valid text (a lone UTF-16 surrogate); fix the "
                           f"message") from None
        out.append({"role": role, "content": content})
    if not any(m["content"].strip() for m in out):
        raise RowError("messages has no content; give at least one non-empty message")
    return out
