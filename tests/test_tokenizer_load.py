"""The tokenizer overnight loads before the engine starts: TokenizersBackend, without AutoTokenizer's imports,
for a folder AutoTokenizer would load as that class (one that names it, of a model type for which AutoTokenizer
keeps the class named: the embedded model's, as `overnight models prepare` saves it), and through AutoTokenizer
otherwise."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import transformers

from conftest import EXAMPLE

if not hasattr(transformers, "TokenizersBackend"):
    pytest.skip("transformers before 5 has no TokenizersBackend: every folder goes through AutoTokenizer",
                allow_module_level=True)


def test_the_embedded_models_tokenizer_is_autotokenizers_without_torch(model_path):
    """The same class, token ids, chat template, special tokens and vocabulary as AutoTokenizer's; and the
    process that loads it (an echo run's, `plan`'s) imports no torch, which AutoTokenizer's imports take
    3.5-5 s to load here."""
    probe = ("import sys; from overnight.pipeline.tools.models import load_tokenizer, resolve; "
             "t = load_tokenizer(resolve('smollm2-135m')); print(type(t).__name__, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.stdout.split() == ["TokenizersBackend", "False"], done.stdout + done.stderr[-2000:]

    from transformers import AutoTokenizer

    from overnight.pipeline.tools.models import _load_tokenizer, resolve

    ours, auto = _load_tokenizer(resolve(model_path), False), AutoTokenizer.from_pretrained(model_path)
    assert type(ours) is type(auto)
    texts = pq.read_table(EXAMPLE, columns=["prompt"]).column("prompt").to_pylist()[:50]
    for text in texts + ["", "héllo 🌍 naïve\tcafé", "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == auto.encode(text), text
        chat = [{"role": "user", "content": text}]
        assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
                == auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
        assert ours.decode(auto.encode(text)) == auto.decode(auto.encode(text))
    for name in ("eos_token_id", "bos_token_id", "pad_token_id", "all_special_ids", "model_max_length"):
        assert getattr(ours, name) == getattr(auto, name), name
    assert ours.get_vocab() == auto.get_vocab()


def test_the_model_types_taken_without_autotokenizer_are_those_it_keeps_the_named_class_for():
    """AutoTokenizer overrides a folder's TokenizersBackend for some model types (qwen2's own class, Mistral's
    tekken files); a model type overnight loads without it must be none of those in this transformers."""
    from transformers.models.auto.tokenization_auto import (MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
                                                            TOKENIZER_MAPPING_NAMES)

    from overnight.pipeline.tools.models import TOKENIZERS_BACKEND_MODEL_TYPES

    for model_type in TOKENIZERS_BACKEND_MODEL_TYPES:
        assert model_type not in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
        assert TOKENIZER_MAPPING_NAMES.get(model_type) in (None, "TokenizersBackend", "PreTrainedTokenizerFast")


def copy_of(tiny_model, folder, tokenizer=None, model=None):
    """The tiny model's folder with keys of its tokenizer_config.json and config.json replaced."""
    shutil.copytree(tiny_model, folder)
    for name, changed in (("tokenizer_config.json", tokenizer), ("config.json", model)):
        (folder / name).write_text(json.dumps({**json.loads((folder / name).read_text()), **(changed or {})}))
    return str(folder)


def test_other_folders_are_loaded_by_autotokenizer(tiny_model, tmp_path):
    """A tokenizer class of its own (GPT2's, which splits words its own way), a model type whose class
    AutoTokenizer puts in place of the one named (qwen2's), or code of its own (auto_map): AutoTokenizer's to
    load; TokenizersBackend would read the same files into other token ids."""
    from transformers import AutoTokenizer

    from overnight.pipeline.tools.models import _load_tokenizer, _names_tokenizers_backend, resolve

    assert json.loads((Path(tiny_model) / "tokenizer_config.json").read_text())["tokenizer_class"] == \
        "TokenizersBackend"   # (the tiny model, a llama, takes the path above)
    backend = _load_tokenizer(resolve(tiny_model), False)
    assert type(backend).__name__ == "TokenizersBackend"
    gpt2 = _load_tokenizer(resolve(copy_of(tiny_model, tmp_path / "gpt2", {"tokenizer_class": "GPT2Tokenizer"})),
                           False)
    assert type(gpt2).__name__ == "GPT2Tokenizer"
    assert gpt2.encode("hello world, what?") != backend.encode("hello world, what?")
    qwen2 = copy_of(tiny_model, tmp_path / "qwen2", model={"model_type": "qwen2"})
    assert not _names_tokenizers_backend(qwen2)
    assert type(_load_tokenizer(resolve(qwen2), False)) is type(AutoTokenizer.from_pretrained(qwen2))
    assert type(_load_tokenizer(resolve(qwen2), False)).__name__ != "TokenizersBackend"
    coded = copy_of(tiny_model, tmp_path / "coded", {"auto_map": {"AutoTokenizer": [None, "tok.MyTokenizer"]}})
    assert not _names_tokenizers_backend(coded)
