"""The run's manifest: identity, resolved config, fingerprint, counts, state and attempts.

The fingerprint covers what determines the outputs (model, sampling defaults,
prompt/messages/id columns, chat settings). Engine tuning (max_num_seqs, ...)
is left out, so a job may be resumed with different throughput settings.
"""

from __future__ import annotations

import datetime as dt
import enum
import hashlib
import json
import os
import socket
import uuid
from typing import Optional

from overnight.pipeline.output.checkpoint import OutputUsageError

FORMAT = 1


class RunState(str, enum.Enum):
    RUNNING = "running"
    COMPLETED = "completed"
    # Stopped early at the deadline; rerunning the command continues.
    PARTIAL = "partial"
    # Stopped by SIGTERM / SIGINT; rerunning the command continues.
    INTERRUPTED = "interrupted"
    FAILED = "failed"


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


# Sampling settings added later: in the fingerprint only when set, so that an OUT written before keeps its own.
LATER_SAMPLING = {"stop_token_ids": [], "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0,
                  "json_schema": None, "regex": None, "choice": None, "n": 1, "logprobs": None, "min_p": 0.0}


def fingerprint_fields(cfg, model: str, chat: bool, as_given: bool = False, lora_as_given: bool = False) -> dict:
    """as_given: --json-schema as the user gave it, a file's path, as fingerprints did before stop 37 (an OUT
    written then resumes); otherwise the schema itself, so that an edited schema file is a change of settings
    and the same schema given inline or from another path is not. Likewise the --lora adapters: by their content
    (``adapter_digest``), or, as_given or lora_as_given, by their folders as given, as before stop 45. --model: a
    folder by its absolute path (``model_key``: a relative and an absolute path to one folder are one setting, the
    same relative words from another folder are not; before stop 47, as typed: see ``same_settings``)."""
    from overnight.pipeline.tools.models import model_key

    fields = _fields(cfg, model_key(model), chat)
    for k, default in LATER_SAMPLING.items():
        value = getattr(cfg.sampling, k)
        if value != default:
            fields["sampling"][k] = value
    if cfg.sampling.json_schema is not None and not as_given:
        from overnight.pipeline.input.checks import job_structured

        fields["sampling"]["json_schema"] = job_structured(cfg.sampling)["json"]
    if cfg.engine.kind != "vllm":  # the echo engine's rows are not a model's: a vLLM run does not resume them
        fields["engine"] = cfg.engine.kind
    if cfg.engine.lora:  # the adapters rows may pick (name -> content), likewise only when registered
        from overnight.pipeline.engine.lora import adapter_digest

        fields["lora"] = {name: path if as_given or lora_as_given else adapter_digest(path)
                          for name, path in sorted(cfg.engine.lora.items())}
    return fields


def engine_kind(manifest: Optional[dict]) -> str:
    """The engine that wrote an OUT's rows: vllm, or echo (a fake for tests and fault injection)."""
    return (((manifest or {}).get("config") or {}).get("engine") or {}).get("kind") or "vllm"


def older_fields(cfg, model: str, chat: bool) -> list:
    """These settings as earlier versions fingerprinted them, for ``same_settings``'s ``also``: an OUT they wrote
    resumes."""
    return ([fingerprint_fields(cfg, model, chat, as_given=True)] if cfg.sampling.json_schema is not None else []) + (
        [fingerprint_fields(cfg, model, chat, lora_as_given=True)] if cfg.engine.lora else [])


def schema_by_path(previous: dict, cfg, model: str, chat: bool) -> bool:
    """Whether an OUT's settings fingerprinted --json-schema as given, a file's path (before stop 37)."""
    return cfg.sampling.json_schema is not None and same_settings(
        previous, fingerprint_fields(cfg, model, chat, as_given=True))


def _model_keys(previous: dict) -> tuple:
    """The model an OUT's settings name, and the model keys that name stands for. Before stop 47 a folder was named
    as typed: it is keyed from the folder the OUT began in (``began_in``; for an OUT begun before, the folder its
    last attempt ran in), or, where no such folder is here (OUT and the model moved, another machine), from this
    one, as the typed name was read before."""
    from overnight.pipeline.tools.models import model_key

    typed = (previous.get("fingerprint_fields") or {}).get("model")
    if typed is None or previous.get("model_keyed"):  # (an OUT begun since stop 47 holds the key itself)
        return None, []
    key = model_key(typed, previous.get("began_in") or (previous.get("input") or {}).get("cwd"))
    return typed, list(dict.fromkeys([key, model_key(typed)])) if key == typed else [key]


def _fields(cfg, model: str, chat: bool) -> dict:
    return {
        "model": model,
        "prompt_column": cfg.input.prompt_column,
        "messages_column": cfg.input.messages_column,
        "id_column": cfg.input.id_column,
        "chat": chat,
        "system_prompt": cfg.prompt.system_prompt,
        "sampling": {
            "max_tokens": cfg.sampling.max_tokens,
            "temperature": cfg.sampling.temperature,
            "top_p": cfg.sampling.top_p,
            "top_k": cfg.sampling.top_k,
            "repetition_penalty": cfg.sampling.repetition_penalty,
            "seed": cfg.sampling.seed,
            "stop": list(cfg.sampling.stop),
        },
    }


def fingerprint(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def differences(previous: dict, fields: dict) -> str:
    typed, model_keys = _model_keys(previous)
    old, new = _flatten(previous.get("fingerprint_fields", {})), _flatten(fields)
    if typed is not None:  # the folder it names, not its spelling
        old["model"] = new.get("model") if new.get("model") in model_keys else model_keys[0]
    keys = set(old) | set(new) | {"engine"}  # fingerprinted only when not vllm (and only since stop 45)
    old = {k: old.get(k, engine_kind(previous) if k == "engine" else None) for k in keys}
    new = {k: new.get(k, "vllm" if k == "engine" else None) for k in keys}
    diffs = [f"{k}: {old[k]!r} -> {new[k]!r}" for k in sorted(old) if old[k] != new[k]]
    return "; ".join(diffs[:6]) or "settings differ"


def same_settings(previous: dict, fields: dict, also: Optional[list] = None) -> bool:
    """Whether a manifest was written with these settings. also: the same settings as older versions
    fingerprinted them (``older_fields``)."""
    candidates = [fields, *(also or [])]
    typed, keys = _model_keys(previous)
    candidates += [{**c, "model": typed} for c in candidates if c.get("model") not in (typed, None) and
                   c.get("model") in keys]  # (an OUT that named the folder as typed)
    if "engine" not in previous.get("fingerprint_fields", {}):  # before stop 45, the engine was its config's only
        if engine_kind(previous) != fields.get("engine", "vllm"):
            return False
        candidates = [{k: v for k, v in f.items() if k != "engine"} for f in candidates]
    return previous.get("fingerprint") in [fingerprint(f) for f in candidates]


RESUME_FIX = ("Rerun with the original settings to continue, pass --fresh to discard those results and start over, "
              "or choose another --out.")


def check_resume(previous: dict, fields: dict, out_url: str, also: Optional[list] = None,
                 fix: str = RESUME_FIX) -> None:
    """Refuse to mix outputs of different settings in one OUT. fix: what to do, as the command refusing says it."""
    if same_settings(previous, fields, also):
        return
    detail = differences(previous, fields)
    raise OutputUsageError(
        f"{out_url} holds results of a run with different settings ({detail}). Resuming would mix outputs. {fix}")


def new_manifest(cfg_dict: dict, fields: dict, input_info: dict) -> dict:
    return {
        "format": FORMAT,
        "run_id": f"run-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}",
        "created_at": now_iso(),
        "updated_at": now_iso(),
        "state": RunState.RUNNING.value,
        "fingerprint": fingerprint(fields),
        "fingerprint_fields": fields,
        "config": cfg_dict,
        "input": input_info,
        "began_in": input_info.get("cwd"),  # the folder the first attempt ran in, kept (input.cwd is the last's)
        "model_keyed": True,  # its settings name a model folder by its absolute path (model_key), since stop 47
        "counts": {},
        "attempts": [],
    }


def start_attempt(manifest: dict, cfg_dict: dict, input_info: dict) -> dict:
    # an OUT begun before stop 47 keeps the folder its last attempt ran in, which its typed --model was read from
    manifest.setdefault("began_in", (manifest.get("input") or {}).get("cwd"))
    manifest["config"] = cfg_dict
    manifest["input"] = input_info
    manifest["state"] = RunState.RUNNING.value
    manifest["updated_at"] = now_iso()
    manifest["attempts"].append({
        "attempt": len(manifest["attempts"]) + 1,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started_at": now_iso(),
        "ended_at": None,
        "state": RunState.RUNNING.value,
    })
    return manifest


def end_attempt(manifest: dict, state: RunState, message: Optional[str] = None) -> dict:
    manifest["state"] = state.value
    manifest["updated_at"] = now_iso()
    attempt = manifest["attempts"][-1]
    attempt["ended_at"] = now_iso()
    attempt["state"] = state.value
    if message:
        attempt["message"] = message
    return manifest
