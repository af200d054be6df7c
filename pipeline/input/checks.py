"""Per-column checks of a row's request: sampling overrides (``max_tokens`` ... ``lora``), structured output
(``json_schema``, ``response_format``, ``regex``, ``choice``) and scheduling (``priority``, ``value``,
``deadline``). Each check turns a column's value into the parameter it sets, or raises RowError, whose message
names the column and says what a valid value looks like; ``validate.parse_batch`` makes it the row's error result.
``job_structured`` reads the job's own structured output with the same checks.
"""

from __future__ import annotations

import decimal
import json
import math
from typing import Collection, Optional

from overnight.pipeline.config import MAX_LOGPROBS, MAX_N, MAX_TEMPERATURE, ConfigError, SamplingConfig


class RowError(ValueError):
    "One row's value is invalid; becomes that row's error message."


def _number(value, name: str) -> float:
    if isinstance(value, decimal.Decimal) and value.is_finite():  # a DECIMAL column (DuckDB writes 0.7 as one)
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise RowError(f"{name} is {_short(value)} ({type(value).__name__}); it must be a number")
    return float(value)


def _integer(value, name: str) -> int:
    if isinstance(value, decimal.Decimal) and value.is_finite() and value == value.to_integral_value():
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RowError(f"{name} is {_short(value)} ({type(value).__name__}); it must be an integer")
    return value


def _whole(v: int) -> str:
    """An integer as a message shows it: 1e+300 (from a float column), not its 301 digits."""
    text = str(v)
    return text if len(text) <= 24 else f"{float(v):.3g}"


def _max_tokens(value) -> int:
    v = _integer(value, "max_tokens")
    if v < 1:
        raise RowError(f"max_tokens is {_whole(v)}; it must be at least 1 (or null for the job default)")
    return v


def _temperature(value) -> float:
    v = _number(value, "temperature")
    if not 0 <= v <= MAX_TEMPERATURE:
        raise RowError(f"temperature is {v}; it must be 0 (greedy) to {MAX_TEMPERATURE:g}")
    return v


def _top_p(value) -> float:
    v = _number(value, "top_p")
    if not 0 < v <= 1:
        raise RowError(f"top_p is {v}; it must be in (0, 1]")
    return v


def _top_k(value) -> int:
    v = _integer(value, "top_k")
    if not -1 <= v < PRIORITY_BOUND:  # (vLLM keeps it as a 32-bit integer)
        raise RowError(f"top_k is {_whole(v)}; it must be 0 or -1 (off), or the number of most likely tokens to "
                       f"sample from")
    return v


def _min_p(value) -> float:
    v = _number(value, "min_p")
    if not 0 <= v <= 1:
        raise RowError(f"min_p is {v}; it must be 0 (off) to 1")
    return v


def _repetition_penalty(value) -> float:
    v = _number(value, "repetition_penalty")
    if not 0 < v < math.inf:
        raise RowError(f"repetition_penalty is {v}; it must be above 0 (1 is off, above 1 discourages repeats)")
    return v


# vLLM's client sends a request's integers as 64-bit (msgpack), and a sample i of n > 1 draws with seed + i: a
# seed or priority beyond these bounds failed the engine itself, not the row.
SEED_BOUND = 2 ** 62
PRIORITY_BOUND = 2 ** 31


def _seed(value) -> int:
    v = _integer(value, "seed")
    if not -SEED_BOUND <= v <= SEED_BOUND:
        raise RowError(f"seed is {_whole(v)}; it must be within ±2**62 ({SEED_BOUND})")
    return v


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
        raise RowError(f"min_tokens is {_whole(v)}; it must be 0 or more")
    return v


def _schema(value, what: str = "json_schema") -> dict:
    """A JSON schema given as a JSON string or a struct, checked to be a valid schema."""
    import jsonschema

    if isinstance(value, str):
        value = _json(value, what, "give the schema as a JSON object")
    else:
        value = _unfilled(value)
    if not isinstance(value, dict):
        raise RowError(f"{what} is {_short(value)}; it must be a JSON schema object")
    try:
        jsonschema.validators.validator_for(value).check_schema(value)
    except jsonschema.exceptions.SchemaError as e:
        raise RowError(f"{what} is not a valid JSON schema: {e.message}") from None
    except Exception as e:  # jsonschema fails on some schemas instead of judging them ($schema not a string ...)
        raise RowError(f"{what} is not a valid JSON schema ({type(e).__name__}: {_clip(str(e))}); check its "
                       f"$schema (a URI string) and keywords") from None
    return value


def _json(text: str, what: str, fix: str):
    try:
        return json.loads(text)
    except ValueError as e:
        raise RowError(f"{what} is not valid JSON ({e}); {fix}") from None
    except RecursionError:
        raise RowError(f"{what} is nested too deeply to read; {fix}") from None


def _unfilled(value):
    """A struct column's value without the keys Arrow filled with null: a struct column has the union of every row's
    keys, so one row's schema carries the other rows' keys as None. (A JSON null in a schema, such as a
    ``"default": null``, cannot be told apart in a struct; give such a schema as a JSON string.)"""
    if isinstance(value, dict):
        return {k: _unfilled(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_unfilled(v) for v in value]
    return value


def _response_format(value) -> dict:
    """OpenAI's response_format: {"type": "json_schema", "json_schema": {"schema": {...}}} or {"type": "json_object"}."""
    if isinstance(value, str):
        value = _json(value, "response_format", "give it as a JSON object")
    else:
        value = _unfilled(value)
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
    except (re.error, OverflowError, RecursionError, ValueError) as e:  # a{4294967296}: OverflowError
        raise RowError(f"regex {value!r} is not a valid regular expression: {e}") from None
    return {"regex": value}


def _choice(value) -> dict:
    if isinstance(value, list) and value and all(isinstance(c, str) for c in value):
        return {"choice": value}
    raise RowError(f"choice is {_short(value)}; it must be a non-empty list of strings")


def _n(value) -> int:
    v = _integer(value, "n")
    if not 1 <= v <= MAX_N:
        raise RowError(f"n is {_whole(v)}; it must be 1 to {MAX_N} (completions of the row)")
    return v


def _logprobs(value) -> int:
    v = _integer(value, "logprobs")
    if not 0 <= v <= MAX_LOGPROBS:
        raise RowError(f"logprobs is {_whole(v)}; it must be 0 to {MAX_LOGPROBS} (top alternatives per token), or "
                       f"null for none")
    return v


def _lora(value) -> str:
    if not isinstance(value, str) or not value.strip():
        raise RowError(f"lora is {_short(value)}; it must be the name of an adapter registered with --lora "
                       f"NAME=PATH, or null for the base model")
    return value.strip()


def _check_request(sampling: dict, loras: Optional[Collection[str]]) -> None:
    """What a row's columns ask for together: n > 1 needs sampling, min_tokens no more than max_tokens, and its
    adapter must be registered."""
    # (the resume filter's re-parse passes no job defaults: no max_tokens then)
    if sampling.get("max_tokens") is not None and sampling.get("min_tokens", 0) > sampling["max_tokens"]:
        raise RowError(f"min_tokens ({sampling['min_tokens']}) is above max_tokens ({sampling['max_tokens']}); lower "
                       f"the row's min_tokens or raise its max_tokens")
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


# The columns that set a row's structured output: a request takes one.
STRUCTURED_COLUMNS = ("json_schema", "response_format", "regex", "choice")

_OVERRIDE_CHECKS = {
    "max_tokens": _named("max_tokens", _max_tokens),
    "temperature": _named("temperature", _temperature),
    "top_p": _named("top_p", _top_p),
    "top_k": _named("top_k", _top_k),
    "min_p": _named("min_p", _min_p),
    "repetition_penalty": _named("repetition_penalty", _repetition_penalty),
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
    v = _integer(value, "priority")
    if not -PRIORITY_BOUND < v < PRIORITY_BOUND:
        raise RowError(f"priority is {_whole(v)}; it must be within ±2**31 ({PRIORITY_BOUND}), lower runs sooner")
    return "priority", v


def _value(value) -> tuple[str, float]:
    v = _number(value, "value")
    if not 0 <= v < math.inf:
        raise RowError(f"value is {v}; it must be a finite number, 0 or more")
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
        return _timestamp(value, value, name)
    if isinstance(value, str):
        try:
            from overnight.pipeline.scheduling.when import from_iso

            parsed = from_iso(value)
        except ValueError:
            raise RowError(f"{name} is {_short(value)}; use an ISO time such as 2026-11-23T06:00 or "
                           f"2026-11-23T06:00+01:00") from None
        return _timestamp(parsed, value, name)  # naive: local time
    raise RowError(f"{name} is {_short(value)} ({type(value).__name__}); use a timestamp or an ISO time string")


def _timestamp(when, value, name: str) -> float:
    import datetime as dt

    try:
        ts = when.timestamp()
        dt.datetime.fromtimestamp(ts, dt.timezone.utc)  # and back: an error row's message shows it in UTC
        return ts
    except (ValueError, OverflowError, OSError):  # 0001-01-01T00:00 in local time (or +05:00) falls before year 1
        raise RowError(f"{name} is {_short(value)}, out of the range of times this machine can hold; use a time "
                       f"such as 2026-11-23T06:00") from None


_SCHEDULING_CHECKS = {"priority": _priority, "value": _value, "deadline": _deadline}


def _clip(text: str, limit: int = 100) -> str:
    text = text.strip().splitlines()[0] if text.strip() else ""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
