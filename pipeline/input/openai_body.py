"""One OpenAI Batch request line's body as column values: ``messages`` (text content parts joined, OpenAI's
``developer`` role as ``system``), ``prompt``, and the per-row columns (``max_tokens``, ``temperature``, ...,
``logprobs``), each type-checked.

A value of the wrong type raises LineError, whose message names the line, the body key and the fix; the source
(``openai_batch``) turns it into the row's INPUT_ERROR_COLUMN. Ranges are not checked here: ``validate`` checks
the values as for any input.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional

import pyarrow as pa

ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system message
# Per-row columns and their types; each is read from the body key of the same name (see OpenAIBatchSource._row
# for the others).
_COLUMNS = (("max_tokens", pa.int64()), ("temperature", pa.float64()), ("top_p", pa.float64()),
            ("top_k", pa.int64()), ("min_p", pa.float64()), ("repetition_penalty", pa.float64()),
            ("seed", pa.int64()), ("stop", pa.list_(pa.string())), ("presence_penalty", pa.float64()),
            ("frequency_penalty", pa.float64()), ("min_tokens", pa.int64()),
            ("stop_token_ids", pa.list_(pa.int64())), ("response_format", pa.string()), ("n", pa.int64()),
            ("logprobs", pa.int64()), ("json_schema", pa.string()), ("regex", pa.string()),
            ("choice", pa.list_(pa.string())))
# vLLM's own structured-output keys in a request body (older vLLM's OpenAI server and run-batch honour them): the
# column each fills. ``structured_outputs`` ({"json": ..., "regex": ..., "choice": ...}) fills the same columns.
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice"}
STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice"}
_INT64 = (-2 ** 63, 2 ** 63 - 1)


class LineError(ValueError):
    "One line is not a request overnight can run; the message says what and how to fix it."


def _messages(value, line_no: int) -> list:
    """OpenAI's messages as [{role, content}]: text content parts are joined with newlines."""
    if not isinstance(value, list):
        raise LineError(f"line {line_no}: body.messages is {_short(value)}; give a list of {{role, content}}")
    out = []
    for j, m in enumerate(value):
        where = f"line {line_no}: body.messages[{j}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise LineError(f"{where} is {_short(m)}; give {{\"role\": ..., \"content\": ...}}")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for k, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else None
                    raise LineError(f"{where}.content[{k}] is {_short(kind or part)}; only text parts "
                                    f"({{\"type\": \"text\", \"text\": ...}}) are supported")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise LineError(f"{where}.content is {_short(content)}; give a string or a list of text parts "
                            f"(tool calls are not supported)")
        out.append({"role": ROLE_ALIASES.get(m["role"], m["role"]), "content": content})
    return out


def _prompt(value, line_no: int) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, str) for p in value):
        raise LineError(f"line {line_no}: body.prompt is a list of {len(value)} prompts; give one prompt per "
                        f"line, each with its own custom_id")
    raise LineError(f"line {line_no}: body.prompt is {_short(value)}; give the prompt as text (token ids are "
                    f"not supported)")


def _parameters(body: dict, line_no: int, endpoint: str = "messages") -> dict:
    """The per-row columns, type-checked; ranges are validate's to check. endpoint: "messages" for
    /v1/chat/completions, "prompt" for /v1/completions (their logprobs differ)."""
    out: dict[str, Any] = {}
    guided = _guided(body, line_no)
    for name, t in _COLUMNS:
        value = body.get(name)
        if name == "max_tokens" and body.get("max_completion_tokens") is not None:
            name, value = "max_completion_tokens", body["max_completion_tokens"]
        if name == "logprobs":
            value = _logprobs(body, line_no, endpoint)
        if name in ("json_schema", "regex", "choice"):
            name, value = guided.get(name, (name, None))
        if value is None:
            continue
        where = f"line {line_no}: body.{name}"
        column = {"max_completion_tokens": "max_tokens"}.get(name) or (
            STRUCTURED_KEYS.get(name.rsplit(".", 1)[-1]) if name.startswith("structured_outputs.") else None) or \
            GUIDED.get(name, name)
        if name == "response_format":
            out[column] = json.dumps(value)
        elif column == "json_schema":
            out[column] = value if isinstance(value, str) else json.dumps(value)
        elif column == "regex":
            if not isinstance(value, str):
                raise LineError(f"{where} is {_short(value)}; give the regular expression as a string")
            out[column] = value
        elif column == "choice":
            if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                raise LineError(f"{where} is {_short(value)}; give a list of strings to choose among")
            out[column] = value
        elif name == "stop":
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                raise LineError(f"{where} is {_short(value)}; give a string or a list of strings")
            out[column] = value
        elif name == "stop_token_ids":
            if not isinstance(value, list) or not all(_is_int(v) for v in value):
                raise LineError(f"{where} is {_short(value)}; give a list of token ids (integers)")
            out[column] = [int(v) for v in value]
        elif pa.types.is_integer(t):
            if not _is_int(value):
                whole = (isinstance(value, int) and not isinstance(value, bool)) or (
                    isinstance(value, float) and value.is_integer())
                raise LineError(f"{where} is {_short(value)} ({type(value).__name__}); " +
                                ("it is out of range: give a whole number between -2**63 and 2**63-1" if whole
                                 else "it must be an integer"))
            out[column] = int(value)
            given = "top_logprobs" if name == "logprobs" and body.get("top_logprobs") is not None else name
            if given != column:  # a body key of another name than the column: its range checked here, by its name
                _in_range(column, out[column], f"line {line_no}: body.{given}")
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
                raise LineError(f"{where} is {_short(value)} ({type(value).__name__}); it must be a number")
            out[column] = float(value)
    return out


def _in_range(column: str, value, where: str) -> None:
    """validate's check of the column, its message naming the body key (``where``) rather than the column."""
    from overnight.pipeline.input.checks import _OVERRIDE_CHECKS, RowError

    try:
        _OVERRIDE_CHECKS[column](value)
    except RowError as e:
        text = str(e)
        raise LineError(where + text[len(column):] if text.startswith(column) else f"{where}: {text}") from None


def _finite(value) -> bool:
    """A number a float holds (an integer of 309 digits does not: OverflowError)."""
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _guided(body: dict, line_no: int) -> dict:
    """vLLM's structured-output keys (guided_json, guided_regex, guided_choice, structured_outputs) as
    {column: (body key, value)}; a kind overnight does not run (a grammar, json_object) is the line's error."""
    found = {column: (key, body[key]) for key, column in GUIDED.items() if body.get(key) is not None}
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise LineError(f"line {line_no}: body.structured_outputs is {_short(so)}; give an object such as "
                            f"{{\"json\": SCHEMA}}, {{\"regex\": ...}} or {{\"choice\": [...]}}")
        for key, value in so.items():
            if value is None or value is False:
                continue
            if key not in STRUCTURED_KEYS:
                raise LineError(f"line {line_no}: body.structured_outputs.{key} is not supported; overnight runs "
                                f"json, regex and choice")
            column = STRUCTURED_KEYS[key]
            if column in found and found[column][1] != value:
                raise LineError(f"line {line_no}: body.structured_outputs.{key} and body.{found[column][0]} differ; "
                                f"give one of them")
            found.setdefault(column, (f"structured_outputs.{key}", value))
    if body.get("guided_grammar") is not None:
        raise LineError(f"line {line_no}: body.guided_grammar is not supported; overnight runs guided_json, "
                        f"guided_regex and guided_choice")
    return found


# Body keys that would change the answer and that overnight does not run: a line that sets one is its error (400),
# not answered without it. Each with the values that change nothing (a line may carry them).
REFUSED = {"logit_bias": ({},), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
           "function_call": ("none",), "parallel_tool_calls": (True, False), "echo": (False,), "suffix": ("",),
           "best_of": (1,), "prediction": (), "audio": (), "modalities": (["text"],),
           # vLLM's own (its server's and run-batch's extra parameters)
           "ignore_eos": (False,), "bad_words": ([],), "allowed_token_ids": (), "chat_template_kwargs": ({},),
           "add_generation_prompt": (True,), "continue_final_message": (False,),
           "include_stop_str_in_output": (False,), "skip_special_tokens": (True,), "truncate_prompt_tokens": (),
           "prompt_logprobs": ()}


def refused(body: dict, line_no: int) -> None:
    for key, neutral in REFUSED.items():
        value = body.get(key)
        if value is not None and not any(value == v for v in neutral):  # (1.0 and true are 1, as vLLM reads them)
            raise LineError(f"line {line_no}: body.{key} is {_short(value)}, which overnight does not support; "
                            f"remove it from the request (the line would be answered without it)")


def _logprobs(body: dict, line_no: int, endpoint: str = "messages") -> Optional[int]:
    """Top alternatives per token: chat's logprobs=true with top_logprobs=K (0 without), or completions' K. As
    OpenAI and vLLM read them: chat's logprobs is a boolean, completions' an integer."""
    value, top = body.get("logprobs"), body.get("top_logprobs")
    if endpoint == "messages" and value is not None and not isinstance(value, bool):
        raise LineError(f"line {line_no}: body.logprobs is {_short(value)}; for /v1/chat/completions give true, "
                        f"with top_logprobs: K for K alternatives per token")
    if endpoint == "prompt" and isinstance(value, bool):
        raise LineError(f"line {line_no}: body.logprobs is {_short(value)}; for /v1/completions give the number "
                        f"of top alternatives per token (0 for the chosen token's alone)")
    if endpoint == "prompt" and top is not None:
        raise LineError(f"line {line_no}: body.top_logprobs is for /v1/chat/completions; for /v1/completions give "
                        f"\"logprobs\": K, the number of top alternatives per token")
    if value is None or value is False:
        if top is not None:
            raise LineError(f"line {line_no}: body.top_logprobs is set but body.logprobs is not true; add "
                            f"\"logprobs\": true")
        return None
    if value is True:
        if top is None:
            return 0
        if not _is_int(top):
            raise LineError(f"line {line_no}: body.top_logprobs is {_short(top)}; it must be an integer")
        return int(top)
    if _is_int(value):
        return int(value)
    raise LineError(f"line {line_no}: body.logprobs is {_short(value)}; give true (with top_logprobs: K) or, "
                    f"for /v1/completions, an integer")


def _is_int(value) -> bool:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return isinstance(value, int) and not isinstance(value, bool) and _INT64[0] <= value <= _INT64[1]


def _is_text(value) -> bool:
    try:
        return isinstance(value, str) and bool(value.encode("utf-8"))
    except UnicodeError:
        return False



def _short(value, limit: int = 60) -> str:
    text = json.dumps(value) if not isinstance(value, (bytes, set)) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def readable_id(raw: bytes) -> Optional[str]:
    """The custom_id of a request line that is not valid UTF-8, where the JSON around its bad bytes reads and the
    id itself is whole text; else None (its error row is then known by its origin)."""
    try:
        req = json.loads(raw.decode("utf-8-sig", "replace"))
    except (ValueError, RecursionError):
        return None
    cid = req.get("custom_id") if isinstance(req, dict) else None
    return cid if isinstance(cid, str) and cid and "\ufffd" not in cid and _is_text(cid) else None
