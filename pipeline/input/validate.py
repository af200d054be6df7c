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
from typing import Any, Collection, Optional

import pyarrow as pa

from overnight.pipeline.config import MAX_LOGPROBS, MAX_N, ConfigError, InputConfig, SamplingConfig
from overnight.pipeline.records import Result
from overnight.pipeline.input.source import (INPUT_ERROR_COLUMN, OVERRIDE_COLUMNS, RAW_PROMPT_COLUMN,
                                             SCHEDULING_COLUMNS, SourceBatch)

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
            if unreadable[i] is not None:
                raise RowError(unreadable[i])
            if row_id is None:
                raise RowError(f"column {cfg.id_column!r} is null; give every row an id, or drop the column "
                               f"so ids are derived from file and row")
            sampling = dict(defaults)
            for col, values in overrides.items():
                if values[i] is not None:
                    key, value = _OVERRIDE_CHECKS[col](values[i])
                    sampling[key] = value
            if overrides:
                _check_request(sampling, loras)
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
                             prompt_hash(prompt, chat), raw=chat is None and bool(raw[i])))
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


def _stop_token_ids(value) -> list:
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        return value
    raise RowError(f"stop_token_ids is {_short(value)}; it must be a list of token ids (non-negative integers)")


def _penalty(name: str):
    def check(value) -> float:
        v = _number(value, name)
        if not -2 <= v <= 2:
            raise RowError(f"{name} is {v}; it must be between -2 and 2")
        return v
    return check


def _min_tokens(value) -> int:
    v = _integer(value, "min_tokens")
    if v < 0:
        raise RowError(f"min_tokens is {v}; it must be 0 or more")
    return v


def _schema(value, what: str = "json_schema") -> dict:
    """A JSON schema given as a JSON string or a struct, checked to be a valid schema."""
    import jsonschema

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise RowError(f"{what} is not valid JSON ({e}); give the schema as a JSON object") from None
    if not isinstance(value, dict):
        raise RowError(f"{what} is {_short(value)}; it must be a JSON schema object")
    try:
        jsonschema.validators.validator_for(value).check_schema(value)
    except jsonschema.exceptions.SchemaError as e:
        raise RowError(f"{what} is not a valid JSON schema: {e.message}") from None
    return value


def _response_format(value) -> dict:
    """OpenAI's response_format: {"type": "json_schema", "json_schema": {"schema": {...}}} or {"type": "json_object"}."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise RowError(f"response_format is not valid JSON ({e})") from None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_schema" and isinstance(value.get("json_schema"), dict) and "schema" in value["json_schema"]:
        return {"json": _schema(value["json_schema"]["schema"], "response_format.json_schema.schema")}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "text":
        return {}
    raise RowError(f"response_format is {_short(value)}; use OpenAI's shape: {{\"type\": \"json_schema\", "
                   f"\"json_schema\": {{\"schema\": {{...}}}}}}, {{\"type\": \"json_object\"}} or {{\"type\": \"text\"}}")


def _regex(value) -> dict:
    import re

    if not isinstance(value, str) or not value:
        raise RowError(f"regex is {_short(value)}; it must be a regular expression")
    try:
        re.compile(value)
    except re.error as e:
        raise RowError(f"regex {value!r} is not a valid regular expression: {e}") from None
    return {"regex": value}


def _choice(value) -> dict:
    if isinstance(value, list) and value and all(isinstance(c, str) for c in value):
        return {"choice": value}
    raise RowError(f"choice is {_short(value)}; it must be a non-empty list of strings")


def _n(value) -> int:
    v = _integer(value, "n")
    if not 1 <= v <= MAX_N:
        raise RowError(f"n is {v}; it must be 1 to {MAX_N} (completions of the row)")
    return v


def _logprobs(value) -> int:
    v = _integer(value, "logprobs")
    if not 0 <= v <= MAX_LOGPROBS:
        raise RowError(f"logprobs is {v}; it must be 0 to {MAX_LOGPROBS} (top alternatives per token), or null for "
                       f"none")
    return v


def _lora(value) -> str:
    if not isinstance(value, str) or not value.strip():
        raise RowError(f"lora is {_short(value)}; it must be the name of an adapter registered with --lora "
                       f"NAME=PATH, or null for the base model")
    return value.strip()


def _check_request(sampling: dict, loras: Optional[Collection[str]]) -> None:
    """What a row's columns ask for together: n > 1 needs sampling, and its adapter must be registered."""
    n = sampling.get("n", 1)
    if n > 1 and sampling.get("temperature", 1.0) == 0:
        raise RowError(f"n is {n} but the temperature is 0 (greedy), which gives the same completion each time; "
                       f"set the row's temperature above 0, or n to 1")
    name = sampling.get("lora")
    if name is not None and loras is not None and name not in loras:
        known = f"registered: {', '.join(sorted(loras))}" if loras else "none is registered"
        raise RowError(f"lora is {name!r}, which is not a registered adapter ({known}); register it with "
                       f"--lora {name}=PATH, or set the row's lora to null for the base model")


def job_structured(cfg: SamplingConfig) -> Optional[dict]:
    """The job's structured output (--json-schema FILE or JSON, --regex, --choice) as vLLM's parameters."""
    if cfg.json_schema is not None:
        text = cfg.json_schema
        if not text.lstrip().startswith("{"):
            try:
                with open(text) as f:
                    text = f.read()
            except OSError as e:
                raise ConfigError(f"--json-schema {cfg.json_schema}: cannot read it ({e.strerror}). Give a JSON "
                                  f"schema file, or the schema itself as JSON.") from None
        try:
            return {"json": _schema(text)}
        except RowError as e:
            raise ConfigError(f"--json-schema {cfg.json_schema}: {e}") from None
    if cfg.regex is not None:
        try:
            return _regex(cfg.regex)
        except RowError as e:
            raise ConfigError(f"--regex: {e}") from None
    if cfg.choice is not None:
        return {"choice": list(cfg.choice)}
    return None


def _named(key: str, check):
    return lambda value: (key, check(value))


_OVERRIDE_CHECKS = {
    "max_tokens": _named("max_tokens", _max_tokens),
    "temperature": _named("temperature", _temperature),
    "top_p": _named("top_p", _top_p),
    "seed": _named("seed", _seed),
    "stop": _named("stop", _stop),
    "stop_token_ids": _named("stop_token_ids", _stop_token_ids),
    "presence_penalty": _named("presence_penalty", _penalty("presence_penalty")),
    "frequency_penalty": _named("frequency_penalty", _penalty("frequency_penalty")),
    "min_tokens": _named("min_tokens", _min_tokens),
    # a row's structured output replaces the job's
    "json_schema": _named("structured", lambda v: {"json": _schema(v)}),
    "response_format": _named("structured", _response_format),
    "regex": _named("structured", _regex),
    "choice": _named("structured", _choice),
    "n": _named("n", _n),
    "logprobs": _named("logprobs", _logprobs),
    "lora": _named("lora", _lora),
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
