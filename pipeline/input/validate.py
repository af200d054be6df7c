"""Per-row checks: a record batch becomes parsed rows and error results, never an exception.

A row with a null or empty prompt, a malformed chat, or a per-row column of
the wrong type becomes an error result whose message names the file, the row
and the column, and says what a valid value looks like.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Optional

import pyarrow as pa

from overnight.pipeline.config import InputConfig, SamplingConfig
from overnight.pipeline.records import Result
from overnight.pipeline.input.source import OVERRIDE_COLUMNS, SCHEDULING_COLUMNS, SourceBatch

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


class RowError(ValueError):
    "One row's value is invalid; becomes that row's error message."


def prompt_hash(prompt, messages) -> str:
    """16 hex digits of BLAKE2b over the prompt text, or the chat as JSON."""
    data = messages if messages is not None else prompt
    if data is None:
        return ""
    text = data if isinstance(data, str) else json.dumps(data, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def sampling_defaults(cfg: SamplingConfig) -> dict:
    return {
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "repetition_penalty": cfg.repetition_penalty,
        "seed": cfg.seed,
        "stop": list(cfg.stop),
    }


def parse_batch(sb: SourceBatch, cfg: InputConfig, defaults: dict,
                passthrough: list[str]) -> tuple[list[Parsed], list[Result]]:
    batch = sb.batch
    names = batch.schema.names
    n = batch.num_rows
    ids = _column(batch, cfg.id_column) if cfg.id_column in names else None
    prompts = _texts(batch.column(cfg.prompt_column)) if cfg.prompt_column in names else [None] * n
    messages = _column(batch, cfg.messages_column) if cfg.messages_column in names else None
    overrides = {c: _column(batch, c) for c in OVERRIDE_COLUMNS if c in names}
    scheduling = {c: _column(batch, c) for c in SCHEDULING_COLUMNS if c in names}
    kept = [c for c in passthrough if c in names]
    carried = batch.select(kept).to_pylist() if kept else [{} for _ in range(n)]

    parsed: list[Parsed] = []
    errors: list[Result] = []
    for i in range(n):
        row_no = sb.row_number(i)
        origin = f"{sb.file.name}#{row_no}"
        row_id = ids[i] if ids is not None else origin
        try:
            if row_id is None:
                raise RowError(f"column {cfg.id_column!r} is null; give every row an id, or drop the column "
                               f"so ids are derived from file and row")
            sampling = dict(defaults)
            for col, values in overrides.items():
                if values[i] is not None:
                    sampling[col] = _OVERRIDE_CHECKS[col](values[i])
            sched = {}
            for col, values in scheduling.items():
                if values[i] is not None:
                    key, value = _SCHEDULING_CHECKS[col](values[i])
                    sched[key] = value
            chat = _messages(messages[i]) if messages is not None and messages[i] is not None else None
            prompt = None
            if chat is None:
                prompt = _prompt(prompts[i], cfg.prompt_column)
        except RowError as e:
            err = Result.failed(row_id, carried[i], f"{origin}: {e}")
            err.prompt_hash = prompt_hash(prompts[i], messages[i] if messages is not None else None)
            errors.append(err)
            continue
        parsed.append(Parsed(row_id, origin, carried[i], sampling, prompt, chat, sched,
                             prompt_hash(prompt, chat)))
    return parsed, errors


# -- columns -----------------------------------------------------------------------------------

def _column(batch: pa.RecordBatch, name: str) -> list:
    col = batch.column(name)
    try:
        return col.to_pylist()
    except UnicodeDecodeError:
        return _texts(col)


class _BadText(str):
    """Marks a value that was not valid UTF-8; carries the reason."""


def _texts(col: pa.Array) -> list:
    """Column values as str, decoding binary columns; invalid UTF-8 becomes a _BadText marker."""
    t = col.type
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return [None if v is None else _decode(v) for v in col.to_pylist()]
    try:
        return col.to_pylist()
    except UnicodeDecodeError:
        return [None if v is None else _decode(v) for v in col.cast(pa.binary()).to_pylist()]


def _decode(raw: bytes):
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return _BadText(f"byte {e.start} is not valid UTF-8 ({raw[e.start:e.start + 1]!r})")


# -- checks --------------------------------------------------------------------------------------

def _prompt(value, column: str) -> str:
    if value is None:
        raise RowError(f"prompt column {column!r} is null; give the row a prompt or a 'messages' chat")
    if isinstance(value, _BadText):
        raise RowError(f"prompt column {column!r} is not valid text: {value}; re-encode the file as UTF-8")
    if not value.strip():
        raise RowError(f"prompt column {column!r} is empty; give the row a prompt")
    return value


def _messages(value) -> list:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise RowError("messages is a string but not JSON; give a list of {role, content}") from None
    if not isinstance(value, list) or not value:
        raise RowError(f"messages must be a non-empty list of {{role, content}}, got {_short(value)}")
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise RowError(f"messages[{j}] must be a {{role, content}} mapping, got {_short(m)}")
        role, content = m["role"], m["content"]
        if role not in CHAT_ROLES:
            raise RowError(f"messages[{j}].role is {role!r}; use one of {', '.join(CHAT_ROLES)}")
        if not isinstance(content, str):
            raise RowError(f"messages[{j}].content must be a string, got {_short(content)}")
        out.append({"role": role, "content": content})
    if not any(m["content"].strip() for m in out):
        raise RowError("messages has no content; give at least one non-empty message")
    return out


def _number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise RowError(f"{name} is {_short(value)} ({type(value).__name__}); it must be a number")
    return float(value)


def _integer(value, name: str) -> int:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RowError(f"{name} is {_short(value)} ({type(value).__name__}); it must be an integer")
    return value


def _max_tokens(value) -> int:
    v = _integer(value, "max_tokens")
    if v < 1:
        raise RowError(f"max_tokens is {v}; it must be at least 1 (or null for the job default)")
    return v


def _temperature(value) -> float:
    v = _number(value, "temperature")
    if v < 0:
        raise RowError(f"temperature is {v}; it must be 0 (greedy) or more")
    return v


def _top_p(value) -> float:
    v = _number(value, "top_p")
    if not 0 < v <= 1:
        raise RowError(f"top_p is {v}; it must be in (0, 1]")
    return v


def _seed(value) -> int:
    return _integer(value, "seed")


def _stop(value) -> list:
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [s for s in value if s]
    raise RowError(f"stop is {_short(value)}; it must be a string or a list of strings")


_OVERRIDE_CHECKS = {
    "max_tokens": _max_tokens,
    "temperature": _temperature,
    "top_p": _top_p,
    "seed": _seed,
    "stop": _stop,
}


def _priority(value) -> tuple[str, int]:
    return "priority", _integer(value, "priority")


def _value(value) -> tuple[str, float]:
    v = _number(value, "value")
    if v < 0:
        raise RowError(f"value is {v}; it must be 0 or more")
    return "value", v


def _deadline(value) -> tuple[str, float]:
    return "deadline_at", parse_time(value, "deadline")


def parse_time(value, name: str) -> float:
    """Seconds since the epoch from a datetime (naive: UTC, as Arrow stores it) or an ISO string
    (naive: local time, as a person writes it)."""
    import datetime as dt

    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.timezone.utc)
        return value.timestamp()
    if isinstance(value, str):
        try:
            parsed = dt.datetime.fromisoformat(value.strip())
        except ValueError:
            raise RowError(f"{name} is {_short(value)}; use an ISO time such as 2026-11-23T06:00 or "
                           f"2026-11-23T06:00+01:00") from None
        return parsed.timestamp()  # naive: local time
    raise RowError(f"{name} is {_short(value)} ({type(value).__name__}); use a timestamp or an ISO time string")


_SCHEDULING_CHECKS = {"priority": _priority, "value": _value, "deadline": _deadline}


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
