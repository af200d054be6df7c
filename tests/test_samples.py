"""n > 1 samples and logprobs per row (issue 12), through the echo engine: the output shape, the per-row columns
and their bad values, the job options, resume exactly once (also after a SIGKILL), the fingerprint, and `overnight
export --format openai`. LoRA adapters: tests/test_lora.py. The real engine: tests/test_engine_samples.py."""

import json
import os
import subprocess
from types import SimpleNamespace

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import overnight_cmd
from fakes import FakeEngine, given
from overnight.pipeline.api import run_job
from overnight.pipeline.config import ConfigError
from overnight.pipeline.engine import EngineError
from overnight.pipeline.output import manifest as mf
from overnight.pipeline.records import Finished, Result, Sample
from overnight.pipeline.tools.export import export


def parts(out) -> pa.Table:
    return pq.read_table(out / "parts")


def rows_by_id(table: pa.Table) -> dict:
    got: dict = {}
    for r in table.to_pylist():
        got.setdefault(r["id"], []).append(r)
    return got


# -- the output shape ---------------------------------------------------------------------------

def test_n_gives_one_output_row_per_sample_and_counts_each_row_once(write_parquet, tmp_path, cfg):
    inp = write_parquet({"id": [f"q{i}" for i in range(10)], "prompt": [f"question {i}?" for i in range(10)]})
    out = tmp_path / "out"
    s = run_job(cfg(inp, out, sampling={"n": 3}), engine_factory=given(FakeEngine()), is_tty=False)
    assert (s.num_done, s.num_ok) == (10, 10)
    t = parts(out)
    assert t.num_rows == 30 and "logprobs" not in t.column_names
    assert t.column_names.index("sample_index") == t.column_names.index("text") - 1
    keys = [(r["id"], r["sample_index"]) for r in t.to_pylist()]
    assert sorted(keys) == sorted((f"q{i}", k) for i in range(10) for k in range(3))   # (id, sample_index) unique
    for rid, samples in rows_by_id(t).items():
        assert [r["sample_index"] for r in samples] == [0, 1, 2]                        # together, in order
        assert len({r["text"] for r in samples}) == 3
        assert len({r["prompt_hash"] for r in samples}) == 1
    # the output tokens of every sample count; the engine time of a row is shared among its samples
    assert s.num_output_tokens == sum(t.column("output_tokens").to_pylist())
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["num_ok"] == 10 and manifest["fingerprint_fields"]["sampling"]["n"] == 3
    # DuckDB: one row per input row, its samples as a list
    grouped = duckdb.sql(f"select id, list(text order by sample_index) as texts from read_parquet('{out}/parts/*.parquet') "
                         f"group by id order by id").fetchall()
    assert len(grouped) == 10 and all(len(texts) == 3 for _, texts in grouped)
    from overnight.pipeline.tools.inspection import open_results, summary_lines

    con, manifest = open_results(str(out))
    assert "rows: 10 (10 ok, 0 error; 30 samples)" in summary_lines(con, manifest)


def test_jobs_that_ask_for_none_keep_their_schema(write_parquet, tmp_path, cfg):
    inp = write_parquet({"id": ["a", "b"], "prompt": ["one?", "two?"]})
    run_job(cfg(inp, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    names = parts(tmp_path / "out").column_names
    assert "sample_index" not in names and "logprobs" not in names
    fields = mf.fingerprint_fields(cfg(inp, tmp_path / "out"), "m", True)
    assert "n" not in fields["sampling"] and "logprobs" not in fields["sampling"] and "lora" not in fields


def test_per_row_columns_and_their_bad_values(write_parquet, tmp_path, cfg):
    inp = write_parquet({
        "id": [f"r{i}" for i in range(9)],
        "prompt": [f"question {i}?" for i in range(9)],
        "n": pa.array([None, 2, 4, 0, 1, 3, None, None, None], pa.int64()),
        "logprobs": pa.array([None, 2, None, None, 0, None, 21, -1, None], pa.int64()),
        "temperature": pa.array([None, None, None, None, None, 0.0, None, None, None], pa.float64()),
        "lora": pa.array([None] * 8 + ["missing"], pa.string()),
    })
    out = tmp_path / "out"
    s = run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    assert (s.num_ok, s.num_error) == (4, 5)
    t = parts(out)
    assert "input_logprobs" in t.column_names          # the input's logprobs column, kept, beside the output's
    got = rows_by_id(t)
    assert [len(got[f"r{i}"]) for i in range(9)] == [1, 2, 4, 1, 1, 1, 1, 1, 1]
    assert all(r["logprobs"] is None for r in got["r0"] + got["r2"])
    assert [len(tok["top_logprobs"]) for tok in got["r1"][1]["logprobs"]] == [2] * got["r1"][1]["output_tokens"]
    assert [len(tok["top_logprobs"]) for tok in got["r4"][0]["logprobs"]] == [0] * got["r4"][0]["output_tokens"]
    errors = {rid: rows[0]["error"] for rid, rows in got.items() if rows[0]["status"] == "error"}
    assert errors == {
        "r3": "in.parquet#3: n is 0; it must be 1 to 128 (completions of the row)",
        "r5": "in.parquet#5: n is 3 but the temperature is 0 (greedy), which gives the same completion each time; "
              "set the row's temperature above 0, or n to 1",
        "r6": "in.parquet#6: logprobs is 21; it must be 0 to 20 (top alternatives per token), or null for none",
        "r7": "in.parquet#7: logprobs is -1; it must be 0 to 20 (top alternatives per token), or null for none",
        "r8": "in.parquet#8: lora is 'missing', which is not a registered adapter (none is registered); register it "
              "with --lora missing=PATH, or set the row's lora to null for the base model",
    }
    assert all(rows[0]["sample_index"] == 0 for rows in got.values())   # where sample_index = 0: one per row


def test_n_and_logprobs_of_the_wrong_type_are_error_rows(write_parquet, tmp_path, cfg):
    inp = write_parquet({"id": ["a", "b", "c"], "prompt": ["x?", "y?", "z?"],
                         "n": pa.array([1.5, 2.0, None]), "logprobs": pa.array([None, None, "3"])})
    out = tmp_path / "out"
    s = run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    got = rows_by_id(parts(out))
    assert got["a"][0]["error"] == "in.parquet#0: n is 1.5 (float); it must be an integer"
    assert len(got["b"]) == 2                                              # 2.0 is the integer 2
    assert got["c"][0]["error"] == "in.parquet#2: logprobs is '3' (str); it must be an integer"
    assert (s.num_ok, s.num_error) == (1, 2)


def test_logprobs_column_queries_in_duckdb(write_parquet, tmp_path, cfg):
    inp = write_parquet({"id": ["a", "b"], "prompt": ["one?", "two?"]})
    out = tmp_path / "out"
    run_job(cfg(inp, out, sampling={"logprobs": 3}), engine_factory=given(FakeEngine()), is_tty=False)
    t = parts(out)
    assert "sample_index" not in t.column_names and "logprobs" in t.column_names
    rows = duckdb.sql(f"""
        select id, t.token, t.logprob, len(t.top_logprobs) as k, t.top_logprobs[1].token as best
        from (select id, unnest(logprobs) as t from read_parquet('{out}/parts/*.parquet')) order by id""").fetchall()
    assert rows and all(k == 3 and tok == best for _, tok, _, k, best in rows)
    per_row = duckdb.sql(f"select id, output_tokens, len(logprobs), list_sum([x.logprob for x in logprobs]) "
                         f"from read_parquet('{out}/parts/*.parquet') order by id").fetchall()
    assert all(n == m and total < 0 for _, n, m, total in per_row)


# -- job options ----------------------------------------------------------------------------------

@pytest.mark.parametrize("sampling,message", [
    ({"n": 0}, "sampling.n is 0; it must be 1 to 128."),
    ({"n": 2, "temperature": 0.0}, "sampling.n is 2 but the temperature is 0 (greedy), which gives the same "
                                   "completion each time. Set a temperature above 0 (--temperature 0.7), or n to 1."),
    ({"logprobs": 21}, "sampling.logprobs is 21; it must be 0 to 20 (top alternatives per token)."),
])
def test_bad_job_options_fail_at_construction(cfg, tmp_path, sampling, message):
    with pytest.raises(ConfigError) as e:
        cfg(tmp_path / "in.parquet", tmp_path / "out", sampling=sampling)
    assert str(e.value).endswith(message)


def test_config_keys_mirror_the_options():
    from overnight.pipeline.configio import build

    cfg = build({"sampling": {"n": 2, "logprobs": 0}, "engine": {"lora": {"sql": "a/sql"}, "max_loras": 1}})
    assert (cfg.sampling.n, cfg.sampling.logprobs, cfg.engine.lora, cfg.engine.max_loras) == (2, 0, {"sql": "a/sql"}, 1)
    with pytest.raises(ConfigError, match=r"config: engine.lora must be a mapping, got \['sql'\]."):
        build({"engine": {"lora": ["sql"]}})
    with pytest.raises(ConfigError, match="config: engine.lora.sql must be a string, got 3."):
        build({"engine": {"lora": {"sql": 3}}})
    with pytest.raises(ConfigError, match="engine.max_lora_rank is 12; use one of 1, 8, 16"):
        build({"engine": {"max_lora_rank": 12}})


# -- resume exactly once ---------------------------------------------------------------------------

def test_resume_after_an_engine_death_writes_every_sample_once(write_parquet, tmp_path, cfg):
    inp = write_parquet({"id": [f"q{i}" for i in range(40)], "prompt": [f"question {i} " + "w " * (i % 7)
                                                                      for i in range(40)]})
    out = tmp_path / "out"
    job = cfg(inp, out, sampling={"n": 3, "logprobs": 1})
    with pytest.raises(EngineError, match="engine died"):
        run_job(job, engine_factory=given(FakeEngine(fail_after_steps=12)), is_tty=False)
    first = parts(out).num_rows
    assert 0 < first < 120 and first % 3 == 0
    s = run_job(job, engine_factory=given(FakeEngine()), is_tty=False)
    assert s.exit_code == 0 and s.num_done == 40 and s.num_resumed == first // 3
    t = parts(out)
    keys = [(r["id"], r["sample_index"]) for r in t.to_pylist()]
    assert len(keys) == len(set(keys)) == 120
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["num_ok"] == 40
    assert manifest["counts"]["num_output_tokens"] == sum(t.column("output_tokens").to_pylist())


def test_a_sigkilled_job_never_leaves_part_of_a_rows_samples(write_parquet, tmp_path, tiny_model):
    inp = write_parquet({"id": [f"q{i}" for i in range(60)], "prompt": [f"question {i}?" for i in range(60)]})
    out = tmp_path / "out"
    args = [*overnight_cmd(), "run", inp, "--out", str(out), "--model", tiny_model, "--engine", "echo",
            "--echo-step-ms", "2", "--max-num-seqs", "4", "--n", "4", "--flush-rows", "7", "--max-tokens", "8"]
    env = dict(os.environ)
    for point in ("part.after_write=kill@2", "part.before_write=kill@2"):
        r = subprocess.run(args, env={**env, "OVERNIGHT_FAILPOINTS": point}, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == -9, r.stderr[-2000:]
        got = rows_by_id(parts(out))
        assert 0 < len(got) < 60 and all(sorted(x["sample_index"] for x in rows) == [0, 1, 2, 3]
                                         for rows in got.values())
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    keys = [(x["id"], x["sample_index"]) for x in parts(out).to_pylist()]
    assert len(keys) == len(set(keys)) == 240


# -- the engine's side -------------------------------------------------------------------------------

def test_vllm_logprobs_become_the_column_shape():
    """vLLM gives per position {token id: Logprob(logprob, rank, decoded_token)}: the top K and the chosen one."""
    from overnight.pipeline.engine.vllm import token_logprobs

    lp = lambda v, rank, tok: SimpleNamespace(logprob=v, rank=rank, decoded_token=tok)
    positions = [{5: lp(-0.1, 1, "A"), 6: lp(-2.5, 2, "B")},                     # the chosen one is the best
                 {6: lp(-0.3, 1, "B"), 7: lp(-1.9, 2, "C"), 9: lp(-4.0, 17, "Z")}]  # ... and the 17th
    assert token_logprobs([5, 9], positions, 2) == [
        {"token_id": 5, "token": "A", "logprob": -0.1,
         "top_logprobs": [{"token_id": 5, "token": "A", "logprob": -0.1}, {"token_id": 6, "token": "B", "logprob": -2.5}]},
        {"token_id": 9, "token": "Z", "logprob": -4.0,
         "top_logprobs": [{"token_id": 6, "token": "B", "logprob": -0.3}, {"token_id": 7, "token": "C", "logprob": -1.9}]},
    ]
    assert token_logprobs([5], positions[:1], 0)[0]["top_logprobs"] == []


def test_a_row_whose_any_sample_vllm_ended_or_failed_is_not_an_answer():
    """vLLM gives each of a row's n completions its own finish_reason: one "error" or "abort" among them makes the
    row's, so the runner writes an error row (or leaves it to a rerun), not n - 1 answers and a cut text."""
    from overnight.pipeline.engine.vllm import VllmEngine

    out = lambda i, reason: SimpleNamespace(index=i, text=f"t{i}", finish_reason=reason, token_ids=[1, 2],
                                            logprobs=None)
    outputs = [SimpleNamespace(request_id=rid, finished=True, prompt_token_ids=[1], metrics=None,
                               outputs=[out(1, r1), out(0, r0)])
               for rid, r0, r1 in (("ok", "stop", "length"), ("err", "stop", "error"), ("ab", "abort", "stop"))]
    engine = VllmEngine.__new__(VllmEngine)
    engine.engine, engine._top_k, engine.num_preemptions = SimpleNamespace(step=lambda: outputs), {}, 0
    got = {f.request_id: f for f in engine.step()}
    assert {k: f.finish_reason for k, f in got.items()} == {"ok": "stop", "err": "error", "ab": "abort"}
    assert [x.finish_reason for x in got["ok"].samples] == ["stop", "length"] and got["ok"].num_output_tokens == 4


def test_samples_share_the_rows_engine_time_in_the_table():
    from overnight.pipeline.output.schema import OutputSchema

    row = SimpleNamespace(id="a", passthrough={}, predicted_tokens=4, bucket=1, prompt_hash="h", sampling={})
    fin = Finished("r", "x", "stop", 3, 7, None, 1.0,
                   [Sample(0, "x", "stop", 3), Sample(1, "yy", "length", 4)])
    result = Result.from_engine(row, fin, 0.5, engine_seconds=0.2)
    assert result.output_tokens == 7
    t = OutputSchema("id", pa.string(), [], samples=True).table([result, Result.failed("b", {}, "bad")], "run", "m")
    assert t.column("sample_index").to_pylist() == [0, 1, 0]
    assert t.column("text").to_pylist() == ["x", "yy", None]
    assert t.column("output_tokens").to_pylist() == [3, 4, None]
    assert t.column("engine_seconds").to_pylist() == [0.1, 0.1, None]


# -- export ----------------------------------------------------------------------------------------

def test_export_openai_puts_samples_in_choices_and_logprobs_in_openais_shape(write_parquet, tmp_path, cfg):
    from openai.types.chat import ChatCompletion

    ids = [f"r{i}" for i in range(12)][::-1]
    inp = write_parquet({"id": ids, "prompt": [None if i == 4 else f"question {i}?" for i in range(12)],
                         "n": pa.array([3, 1, None, 2] * 3, pa.int64())})
    out = tmp_path / "out"
    run_job(cfg(inp, out, sampling={"n": 2, "logprobs": 2}), engine_factory=given(FakeEngine()), is_tty=False)
    ok_path, err_path = tmp_path / "results.jsonl", tmp_path / "errors.jsonl"
    info = export(str(out), "openai", str(ok_path), str(err_path))
    assert (info["ok"], info["errors"], info["expired"]) == (11, 1, 0)
    lines = [json.loads(x) for x in ok_path.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == [i for n, i in enumerate(ids) if n != 4]   # input order
    expected_n = {ids[i]: [3, 1, 2, 2][i % 4] for i in range(12)}
    table = rows_by_id(parts(out))
    for x in lines:
        completion = ChatCompletion.model_validate(x["response"]["body"])
        rows = table[x["custom_id"]]
        assert [c.index for c in completion.choices] == list(range(expected_n[x["custom_id"]]))
        assert [c.message.content for c in completion.choices] == [r["text"] for r in rows]
        assert completion.usage.completion_tokens == sum(r["output_tokens"] for r in rows)
        for choice, r in zip(completion.choices, rows):
            content = choice.logprobs.content
            assert [t.token for t in content] == [t["token"] for t in r["logprobs"]]
            assert all(len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode()) for t in content)
    # the other formats keep one line per sample, a row's samples together
    info = export(str(out), "jsonl", str(tmp_path / "all.jsonl"))
    got = [(json.loads(x)["id"], json.loads(x)["sample_index"]) for x in (tmp_path / "all.jsonl").read_text().splitlines()]
    assert got == [(i, k) for i in ids for k in range(expected_n[i] if i != ids[4] else 1)]
