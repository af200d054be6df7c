"""OpenAI Batch files in and out with the real engine: `overnight run requests.jsonl` on chat and completions
lines with the embedded model, then `overnight export --format openai`, read with OpenAI's own types (a chat
completion for a chat line, a text completion for a completions line), in the file's line order; a completions
prompt reaches the model raw (its prompt tokens are the tokenizer's encoding of the text), a chat through the
template; a bad line is an error row naming its line, in the errors file."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import overnight_cmd

pytestmark = pytest.mark.engine

LINES = [
    {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "gpt-4o-mini", "messages": [{"role": "system", "content": "You answer in one sentence."},
                                                   {"role": "user", "content": "What is the capital of France?"}],
              "max_tokens": 12, "temperature": 0}},
    {"custom_id": "chat-parts", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": [
         {"type": "text", "text": "Name three colours."}, {"type": "text", "text": "Be brief."}]}],
              "max_completion_tokens": 10, "seed": 7, "temperature": 0.8, "stop": ["\n\n"]}},
    {"custom_id": "completion-1", "method": "POST", "url": "/v1/completions",
     "body": {"model": "gpt-3.5-turbo-instruct", "prompt": "Write a haiku about the sea.", "max_tokens": 8,
              "temperature": 0}},
    {"custom_id": "embedding", "method": "POST", "url": "/v1/embeddings", "body": {"input": "not a completion"}},
    {"custom_id": "completion-2", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": ["Count from one to five."], "max_tokens": 4, "top_p": 0.9}},
    # vLLM's own keys, as `vllm run-batch` reads them: structured output and its sampling keys
    {"custom_id": "guided", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Is water wet?"}], "max_tokens": 4,
              "guided_choice": ["yes", "no"], "temperature": 1.0, "top_k": 1, "min_p": 0.05,
              "repetition_penalty": 1.2}},
    # a key that would change the answer and is not run here: a 400, not an answer without it
    {"custom_id": "bias", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hi"}], "logit_bias": {"42": 5}}},
]


def test_openai_batch_file_in_and_out(tmp_path, model_path):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(x) + "\n" for x in LINES))
    out = tmp_path / "out"
    run = subprocess.run([*overnight_cmd(), "run", str(requests), "--out", str(out), "--kv-cache-space", "1",
                          "--json"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout)
    assert (summary["state"], summary["num_rows"], summary["num_ok"], summary["num_error"]) == ("completed", 7, 5, 2)

    ok, errors = tmp_path / "results.jsonl", tmp_path / "errors.jsonl"
    exported = subprocess.run([*overnight_cmd(), "export", str(out), "--format", "openai", "--output", str(ok),
                               "--errors", str(errors)], capture_output=True, text=True, timeout=300)
    assert exported.returncode == 0, exported.stderr
    answers = {x["custom_id"]: x for x in map(json.loads, ok.read_text().splitlines())}
    assert list(answers) == ["chat-1", "chat-parts", "completion-1", "completion-2", "guided"]  # the file's order
    limits = {"chat-1": 12, "chat-parts": 10, "completion-1": 8, "completion-2": 4, "guided": 4}
    for cid, x in answers.items():   # a user's parser works unchanged: a chat's body, or a completion's
        if cid.startswith(("chat", "guided")):
            completion = ChatCompletion.model_validate(x["response"]["body"])
            assert completion.object == "chat.completion" and completion.choices[0].message.content
        else:
            completion = Completion.model_validate(x["response"]["body"])
            assert completion.object == "text_completion" and completion.choices[0].text
        assert 0 < completion.usage.completion_tokens <= limits[cid]
    assert "Paris" in answers["chat-1"]["response"]["body"]["choices"][0]["message"]["content"]
    assert answers["guided"]["response"]["body"]["choices"][0]["message"]["content"] in ("yes", "no")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    prompt_tokens = {cid: x["response"]["body"]["usage"]["prompt_tokens"] for cid, x in answers.items()}
    assert prompt_tokens["completion-1"] == len(tok("Write a haiku about the sea.")["input_ids"])   # raw
    assert prompt_tokens["completion-2"] == len(tok("Count from one to five.")["input_ids"])
    chat = tok.apply_chat_template(LINES[0]["body"]["messages"], tokenize=False, add_generation_prompt=True)
    assert prompt_tokens["chat-1"] == len(tok(chat, add_special_tokens=False)["input_ids"])         # templated
    failed = [json.loads(x) for x in errors.read_text().splitlines()]
    assert [e["custom_id"] for e in failed] == ["embedding", "bias"]
    assert failed[1]["response"]["status_code"] == 400 and "body.logit_bias" in \
        failed[1]["response"]["body"]["error"]["message"]
    assert failed[0]["error"] is None and failed[0]["response"]["status_code"] == 400   # as OpenAI writes a bad request
    error = failed[0]["response"]["body"]["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"] == ('requests.jsonl#4: line 4: url "/v1/embeddings" is not supported; use '
                                '/v1/chat/completions (body.messages) or /v1/completions (body.prompt)')
