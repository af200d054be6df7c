"""Parsed rows become engine-ready Rows: chat template, tokenization, context-length check.

Tokenizing here, once, lets the job reject over-long prompts as error rows
before they reach vLLM, gives the length predictor its token counts, and
hands vLLM token ids so it does not tokenize again.
"""

from __future__ import annotations

from typing import Optional

from overnight.buckets.features import prompt_text
from overnight.pipeline.records import NO_ROOM_FOR_OUTPUT, Result, Row
from overnight.pipeline.input.validate import Parsed


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


class PromptBuilder:
    def __init__(self, tokenizer, chat: bool, system_prompt: Optional[str], max_model_len: int):
        self.tokenizer = tokenizer
        self.chat = chat
        self.system_prompt = system_prompt
        self.max_model_len = max_model_len

    def templated(self, p: Parsed) -> bool:
        """The row goes through the chat template: a chat job's rows, but for raw prompts (completions lines)."""
        return self.chat and not p.raw

    def render(self, p: Parsed) -> str:
        """The prompt text the model sees."""
        if not self.templated(p):  # as a --no-chat job sends it (a raw prompt: as OpenAI and vLLM's run_batch)
            if p.messages is not None:
                raise ValueError("this row has a 'messages' chat, but the job runs without a chat template "
                                 "(--no-chat); drop --no-chat or give the row a plain prompt")
            return f"{self.system_prompt}\n\n{p.prompt}" if self.system_prompt else p.prompt
        messages = p.messages if p.messages is not None else [{"role": "user", "content": p.prompt}]
        if self.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def build(self, parsed: list[Parsed]) -> tuple[list[Row], list[str], list[Result]]:
        """Rows ready for the engine, the text each one's length predictor reads, and error results."""
        texts, kept, errors = [], [], []
        for p in parsed:
            try:
                texts.append(self.render(p))
                kept.append(p)
            except Exception as e:  # a chat template may reject a conversation (e.g. roles out of order)
                err = Result.failed(p.id, p.passthrough, f"{p.origin}: chat template failed: {e}")
                err.prompt_hash = p.prompt_hash
                errors.append(err)
        if not kept:
            return [], [], errors
        # A chat template already holds the special tokens (BOS ...); plain prompts get the tokenizer's own.
        templated = [self.templated(p) for p in kept]
        encoded: list = [None] * len(kept)
        for special in (False, True):
            idx = [i for i, t in enumerate(templated) if t != special]
            if idx:
                ids = self.tokenizer([texts[i] for i in idx], add_special_tokens=special)["input_ids"]
                for i, x in zip(idx, ids):
                    encoded[i] = x
        rows, predictor_texts = [], []
        limit = self.max_model_len
        for p, ids, t in zip(kept, encoded, templated):
            n = len(ids)
            if n + 1 > limit:
                where = " after the chat template" if t else ""
                err = Result.failed(
                    p.id, p.passthrough,
                    f"{p.origin}: prompt is {n} tokens{where}, {NO_ROOM_FOR_OUTPUT}={limit}; shorten the prompt or "
                    f"raise --max-model-len (up to the model's context).")
                err.prompt_hash = p.prompt_hash
                errors.append(err)
                continue
            sampling = p.sampling
            if sampling["max_tokens"] > limit - n:  # the room the context leaves, for max_tokens and min_tokens
                sampling = dict(sampling, max_tokens=limit - n)
                if (sampling.get("min_tokens") or 0) > limit - n:
                    sampling["min_tokens"] = limit - n
            rows.append(Row(id=p.id, prompt_token_ids=ids, sampling=sampling, passthrough=p.passthrough,
                            origin=p.origin, prompt_hash=p.prompt_hash, **p.scheduling))
            predictor_texts.append(prompt_text(p.prompt, p.messages))
        return rows, predictor_texts, errors
