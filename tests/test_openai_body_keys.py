"""The request keys a user of vLLM's OpenAI server or `vllm run-batch` brings: vLLM's sampling keys (top_k, min_p,
repetition_penalty) and structured outputs (guided_json, guided_regex, guided_choice, structured_outputs) are
honoured, as the per-row columns of a Parquet input are; a key that would change the answer and is not run here
(logit_bias, tools, echo, best_of, ...) makes the line an error row (a 400 on export), where it was answered
without it; and chat's logprobs is a boolean, completions' an integer, as OpenAI and vLLM read them. Echo engine."""

from __future__ import annotations

import json

import pyarrow as pa
from click.testing import CliRunner

from fakes import FakeEngine, given
from openai_lines import chat, completion, results, rows_of, write_lines
from overnight.jobs.cli import cli
from overnight.pipeline.api import run_job
from overnight.pipeline.config import InputConfig
from overnight.pipeline.input.source import INPUT_ERROR_COLUMN, open_source


class Sampled(FakeEngine):
    """The echo engine, keeping the sampling of each request by its row's id (the request id's head)."""

    def __init__(self):
        super().__init__()
        self.sampling = {}

    def add(self, request_id, prompt_token_ids, sampling, priority=0):
        self.sampling[len(self.sampling)] = dict(sampling)
        super().add(request_id, prompt_token_ids, sampling, priority)


def test_vllms_own_keys_fill_the_columns(tmp_path):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    path = write_lines(tmp_path / "requests.jsonl", [
        chat("k", top_k=5, min_p=0.1, repetition_penalty=1.2),
        chat("j", guided_json=schema), chat("r", guided_regex="[0-9]+"), chat("c", guided_choice=["yes", "no"]),
        chat("s", structured_outputs={"choice": ["x", "y"]}),
        chat("t", structured_outputs={"json": json.dumps(schema)}),
        completion("p", logprobs=0), chat("n", tools=[], echo=False, best_of=1, logit_bias={}, tool_choice="none"),
        completion("m", best_of=1.0, echo=0, ignore_eos=False, skip_special_tokens=True),  # as vLLM reads them
    ])
    rows = {r["id"]: r for r in rows_of(open_source(InputConfig(path=path)))}
    assert all(r[INPUT_ERROR_COLUMN] is None for r in rows.values()), rows
    assert (rows["k"]["top_k"], rows["k"]["min_p"], rows["k"]["repetition_penalty"]) == (5, 0.1, 1.2)
    assert json.loads(rows["j"]["json_schema"]) == schema == json.loads(rows["t"]["json_schema"])
    assert (rows["r"]["regex"], rows["c"]["choice"], rows["s"]["choice"]) == ("[0-9]+", ["yes", "no"], ["x", "y"])
    assert rows["p"]["logprobs"] == 0


def test_they_reach_the_engine(tmp_path, cfg):
    path = write_lines(tmp_path / "requests.jsonl", [chat("k", top_k=5, min_p=0.1, repetition_penalty=1.2),
                                                     chat("c", guided_choice=["yes", "no"])])
    engine = Sampled()
    s = run_job(cfg(path, tmp_path / "out", engine={"max_num_seqs": 1}), engine_factory=given(engine), is_tty=False)
    assert (s.num_ok, s.num_error) == (2, 0)
    first, second = engine.sampling[0], engine.sampling[1]
    assert (first["top_k"], first["min_p"], first["repetition_penalty"]) == (5, 0.1, 1.2)
    assert second["structured"] == {"choice": ["yes", "no"]} and second["top_k"] == -1  # the job's default


BAD = [
    (chat("bias", logit_bias={"50256": -100}), 'line 1: body.logit_bias is {"50256": -100}, which overnight does not '
                                               'support; remove it from the request (the line would be answered '
                                               'without it)'),
    (chat("tools", tools=[{"type": "function", "function": {"name": "f"}}]), "line 2: body.tools is"),
    (completion("echo", echo=True), "line 3: body.echo is true, which overnight does not support"),
    (completion("best", best_of=3), "line 4: body.best_of is 3, which overnight does not support"),
    (chat("lp", logprobs=3), "line 5: body.logprobs is 3; for /v1/chat/completions give true, with top_logprobs: K "
                             "for K alternatives per token"),
    (chat("lp0", logprobs=0), "line 6: body.logprobs is 0; for /v1/chat/completions give true"),
    (completion("lpt", logprobs=True), "line 7: body.logprobs is true; for /v1/completions give the number of top "
                                       "alternatives per token (0 for the chosen token's alone)"),
    (chat("gram", guided_grammar="root ::= 'a'"), "line 8: body.guided_grammar is not supported; overnight runs "
                                                  "guided_json, guided_regex and guided_choice"),
    (chat("sog", structured_outputs={"grammar": "x"}), "line 9: body.structured_outputs.grammar is not supported; "
                                                       "overnight runs json, regex and choice"),
    (chat("gre", guided_regex=7), "line 10: body.guided_regex is 7; give the regular expression as a string"),
    (chat("gch", guided_choice="yes"), 'line 11: body.guided_choice is "yes"; give a list of strings to choose among'),
    # ranges and combinations are validate's, as for a Parquet column
    (chat("topk", top_k=-2), "top_k is -2; it must be 0 or -1 (off), or the number of most likely tokens to sample "
                             "from"),
    (chat("minp", min_p=1.5), "min_p is 1.5; it must be 0 (off) to 1"),
    (chat("rep", repetition_penalty=0), "repetition_penalty is 0.0; it must be above 0"),
    (chat("two", guided_choice=["a"], response_format={"type": "json_object"}), "structured output"),
    (completion("ctop", logprobs=2, top_logprobs=2), "line 16: body.top_logprobs is for /v1/chat/completions; for "
                                                     "/v1/completions give \"logprobs\": K"),
    (chat("both", guided_json={"type": "object"}, structured_outputs={"json": {"type": "string"}}),
     "line 17: body.structured_outputs.json and body.guided_json differ; give one of them"),
    (completion("eos", ignore_eos=True), "line 18: body.ignore_eos is true, which overnight does not support"),
]


def test_what_is_not_run_here_or_mistyped_is_an_error_row(tmp_path, tiny_model):
    path = write_lines(tmp_path / "requests.jsonl", [x for x, _ in BAD] + [chat("ok")])
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["run", path, "--out", str(out), "--model", tiny_model, "--engine", "echo",
                                 "--max-tokens", "4"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    got = results(out)
    assert got["ok"]["status"] == "ok"
    for line, why in BAD:
        row = got[line["custom_id"]]
        assert row["status"] == "error" and why in row["error"], (line["custom_id"], row["error"])


def test_parquet_columns_of_vllms_sampling_keys(tmp_path, cfg, write_parquet):
    inp = write_parquet({"id": ["a", "b", "c", "d", "e"], "prompt": ["hi"] * 5,
                         "top_k": pa.array([3, None, 0, -5, 2], pa.int64()),
                         "min_p": pa.array([0.05, None, 2.0, None, None], pa.float64()),
                         "repetition_penalty": pa.array([1.3, None, None, None, -1.0], pa.float64())})
    engine = Sampled()
    s = run_job(cfg(inp, tmp_path / "out", engine={"max_num_seqs": 1}), engine_factory=given(engine), is_tty=False)
    assert (s.num_ok, s.num_error) == (2, 3)
    got = results(tmp_path / "out")
    assert "in.parquet#2: min_p is 2.0; it must be 0 (off) to 1" in got["c"]["error"]
    assert "top_k is -5; it must be 0 or -1 (off)" in got["d"]["error"]
    assert "repetition_penalty is -1.0; it must be above 0" in got["e"]["error"]
    a, b = engine.sampling[0], engine.sampling[1]
    assert (a["top_k"], a["min_p"], a["repetition_penalty"]) == (3, 0.05, 1.3)
    assert (b["top_k"], b["min_p"]) == (-1, 0.0)  # the job's (the preset's repetition_penalty stands too)


def test_a_parquet_column_named_for_a_setting_not_read_per_row_is_said(tmp_path, cfg, write_parquet, caplog):
    """Ray Data LLM's sampling_params, OpenAI's max_completion_tokens: a column a user means as the row's setting
    is passed through, not applied; one warning says so and names the columns that are."""
    import logging

    inp = write_parquet({"id": ["a"], "prompt": ["hi"], "max_completion_tokens": [3],
                         "sampling_params": [{"temperature": 0.0}]})
    with caplog.at_level(logging.WARNING, logger="overnight"):
        s = run_job(cfg(inp, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    assert s.num_ok == 1
    said = [m for m in caplog.messages if "not read as a row's request setting" in m]
    assert len(said) == 1 and "columns 'max_completion_tokens', 'sampling_params' are not read" in said[0]
    assert "top_k, min_p, repetition_penalty" in said[0]


def test_a_request_column_in_another_case_is_said_not_read(tmp_path, cfg, write_parquet, caplog):
    """Top_K, MAX_TOKENS: a per-row column's name in another case is not read (names are case-sensitive); said once,
    by the job and not by a Ray worker's input. A name that is also a data column's (N, Value), a column the options
    name and one --passthrough lists are not said."""
    import logging

    from overnight.pipeline.cluster.units import unit_source

    inp = write_parquet({"id": ["a"], "prompt": ["hi"], "Top_K": [1], "MAX_TOKENS": [3], "Seed": [4], "seed": [5],
                         "N": [2], "Value": [1.0], "Temperature": [0.5], "Min_P": ["p"]})
    engine = Sampled()
    with caplog.at_level(logging.WARNING, logger="overnight"):
        unit_source(cfg(inp, tmp_path / "out").input, lambda: None, lambda folder: None)
        assert not [m for m in caplog.messages if "case-sensitive" in m]  # a worker's input says nothing
        s = run_job(cfg(inp, tmp_path / "out", input={"prompt_column": "prompt", "id_column": "id"}),
                    engine_factory=given(engine), is_tty=False)
        run_job(cfg(inp, tmp_path / "out2", input={"passthrough": ["Temperature"], "id_column": "Min_P"}),
                engine_factory=given(Sampled()), is_tty=False)
    assert s.num_ok == 1 and engine.sampling[0]["seed"] == 5 and engine.sampling[0]["top_k"] == -1
    assert engine.sampling[0]["max_tokens"] != 3 and engine.sampling[0]["n"] == 1
    said = [m for m in caplog.messages if "column names are case-sensitive" in m]
    assert len(said) == 2, caplog.messages
    assert ("columns 'MAX_TOKENS', 'Min_P', 'Temperature', 'Top_K' are not read as a row's max_tokens and min_p and "
            "temperature and top_k (column names are case-sensitive): rename them to max_tokens and min_p and "
            "temperature and top_k to have them read per row. As they are, they are ordinary columns") in said[0]
    # the id column (--id-column Min_P) and a --passthrough column are the user's own: not said
    assert "columns 'MAX_TOKENS', 'Top_K' are not read as a row's max_tokens and top_k" in said[1]
