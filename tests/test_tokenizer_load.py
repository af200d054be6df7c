"""The tokenizer overnight loads before the engine starts: the class AutoTokenizer would pick, without
AutoTokenizer's imports where the folder names transformers' own TokenizersBackend (the embedded model's,
as `overnight models prepare` saves it), and through AutoTokenizer otherwise."""

import json
import shutil
import subprocess
import sys

import pyarrow.parquet as pq

from conftest import EXAMPLE


def test_the_embedded_models_tokenizer_is_autotokenizers_without_torch(model_path):
    """The same class, token ids, chat template, special tokens and vocabulary as AutoTokenizer's; and the
    process that loads it (an echo run's, `plan`'s) imports no torch, which AutoTokenizer's imports take
    3.5-5 s to load here."""
    probe = ("import sys; from overnight.pipeline.tools.models import load_tokenizer, resolve; "
             "t = load_tokenizer(resolve('smollm2-135m')); print(type(t).__name__, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
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


def test_a_folder_that_names_another_class_is_loaded_by_autotokenizer(tiny_model, tmp_path):
    """A tokenizer class of its own (here GPT2's, which splits words its own way) is AutoTokenizer's to pick:
    TokenizersBackend would read the same files into other token ids."""
    from overnight.pipeline.tools.models import _load_tokenizer, resolve

    folder = tmp_path / "gpt2-named"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "TokenizersBackend"   # (the tiny model takes the path above)
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    named = _load_tokenizer(resolve(str(folder)), False)
    backend = _load_tokenizer(resolve(tiny_model), False)
    assert (type(named).__name__, type(backend).__name__) == ("GPT2Tokenizer", "TokenizersBackend")
    assert named.encode("hello world, what?") != backend.encode("hello world, what?")
