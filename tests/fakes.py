"""Test doubles: a fake clock, the echo engine with failure hooks, and a tiny model folder (tokenizer only)."""

from __future__ import annotations

import json
import os
import socket
import time

from overnight.pipeline.engine.echo import EchoEngine


class FakeClock:
    """A clock that moves only when a test (or FakeEngine's steps) moves it: ``clock.t += seconds``."""

    def __init__(self, t: float = 1_900_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeEngine(EchoEngine):
    """EchoEngine whose steps can advance a fake clock and which can die after N steps."""

    def __init__(self, max_num_seqs: int = 4, max_model_len: int = 2048, length_of=None, fail_after_steps=None,
                 clock=None, step_seconds: float = 0.0, step_sleep: float = 0.0):
        super().__init__(max_num_seqs, max_model_len, length_of or (lambda ids: 3 + len(ids) % 5), step_sleep)
        self.fail_after_steps = fail_after_steps
        self.clock = clock
        self.step_seconds = step_seconds

    def _step(self):
        if self.fail_after_steps is not None and self.num_steps >= self.fail_after_steps:
            raise RuntimeError("engine died")
        if self.clock is not None:
            self.clock.t += self.step_seconds
        return super()._step()


def given(engine):
    """An engine factory for run_job that hands over this one engine; a restart, which needs a new engine, fails
    with a message that says so."""
    return lambda job: engine


# -- a tiny model folder -------------------------------------------------------------------------------

# ChatML, as SmolLM2's template, with a default system message when the chat has none.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named Tiny: a tokenizer and a chat template, "
    "without a model, for tests.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# What the template adds to a one-message user chat, in tokens: <|im_start|> system, the 23 of the system
# message, <|im_end|> <|im_start|> user ... <|im_end|> <|im_start|> assistant. As many as SmolLM2-135M's
# template adds, so a prompt of n common words is n + 31 tokens on both: the tests' prompt lengths, and the fake
# engine's output lengths drawn from them, stay close to what they were on the embedded model.
TINY_TEMPLATE_TOKENS = 31

TINY_CONTEXT = 2048

_WORDS = ("you are a helpful ai assistant named tiny tokenizer and chat template without model for the tests "
          "system user tell me about weather word say hi bye question what is how many of in to it").split()


def write_tiny_model(folder) -> str:
    """A model folder that overnight resolves and tokenizes with, without weights: a word-level tokenizer
    (lowercased words and runs of punctuation; words outside a small vocabulary are <|endoftext|>, the
    unknown token), a ChatML chat template, and a config.json with a 2048-token context.

    Unit tests need a tokenizer and a context, not the converted model; this takes a second to write."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(special + _WORDS + list("0123456789.,?!:;'\"-()"))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>",
                                   chat_template=TINY_CHAT_TEMPLATE)
    fast.save_pretrained(folder)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": len(vocab),
              "max_position_embeddings": TINY_CONTEXT, "bos_token_id": 1, "eos_token_id": 2}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return folder


def write_lock(out, **info):
    """OUT/.overnight.lock as a run on this host (unless told otherwise) would write it."""
    os.makedirs(out, exist_ok=True)
    base = {"host": socket.gethostname(), "pid": os.getpid(), "started_at": "2026-11-22T01:00:00+00:00",
            "run_id": "run-x", "token": "t", "heartbeat": time.time()}
    base.update(info)
    tmp = out / ".overnight.lock.writing"  # written whole, then renamed, as a run writes it: a heartbeat's read of
    tmp.write_text(json.dumps(base))  # the lock meanwhile (another thread) never sees it half written
    os.replace(tmp, out / ".overnight.lock")
