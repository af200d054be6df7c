"""OpenAI Batch input (`overnight run requests.jsonl`), through the echo engine: request lines become rows
(custom_id as the id; messages or prompt; the body's sampling keys as per-row columns), and every kind of bad
line becomes an error row that names its file and line and the fix while the job goes on. Files, URLs, resume,
shards and Ray: test_openai_files.py."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from click.testing import CliRunner

from fakes import FakeEngine, given
from openai_lines import CHAT, chat, completion, results, rows_of, write_lines
from overnight.jobs.cli import cli
from overnight.pipeline.api import run_job
from overnight.pipeline.config import MAX_N, InputConfig
from overnight.pipeline.input.openai_batch import OpenAIBatchSource
from overnight.pipeline.input.source import INPUT_ERROR_COLUMN, open_source
from overnight.pipeline.tools.inspection import open_results


# -- good lines ----------------------------------------------------------------------------------

def test_good_lines_become_rows(tmp_path):
    path = write_lines(tmp_path / "requests.jsonl", [
        chat("a", [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}], max_completion_tokens=7,
             max_tokens=99, temperature=0.2, top_p=0.9, seed=3, stop="END", n=2, logprobs=True, top_logprobs=3,
             response_format={"type": "json_object"}, presence_penalty=0.5, frequency_penalty=-0.5),
        {**chat("b"), "body": {"messages": [{"role": "developer", "content": "Be brief."},
                                            {"role": "user", "content": "Why?"}], "max_tokens": 5,
                               "stop": ["x", "y"], "logprobs": True}},
        completion("c", ["Just one prompt"], logprobs=2, temperature=None),
    ])
    src = open_source(InputConfig(path=path))
    assert isinstance(src, OpenAIBatchSource) and src.num_rows == 3 and src.has_id_column
    a, b, c = rows_of(src)
    assert a["id"] == "a" and a["messages"] == [{"role": "user", "content": "Hello\nthere"}]
    assert (a["max_tokens"], a["temperature"], a["top_p"], a["seed"], a["stop"], a["n"], a["logprobs"]) == \
        (7, 0.2, 0.9, 3, ["END"], 2, 3)
    assert json.loads(a["response_format"]) == {"type": "json_object"}
    assert (a["presence_penalty"], a["frequency_penalty"], a[INPUT_ERROR_COLUMN]) == (0.5, -0.5, None)
    assert b["messages"][0] == {"role": "system", "content": "Be brief."}      # developer is OpenAI's system
    assert (b["max_tokens"], b["stop"], b["logprobs"], b["prompt"]) == (5, ["x", "y"], 0, None)
    assert (c["prompt"], c["messages"], c["logprobs"], c["temperature"]) == ("Just one prompt", None, 2, None)
    assert "_input_error" not in src.passthrough_columns()
    # a completions prompt is marked raw, body.model kept for the adapters (internal columns, never passed through)
    assert (a["_raw_prompt"], c["_raw_prompt"], a["_model"], c["_model"], a["lora"]) == (None, True, "gpt-4o-mini",
                                                                                           "x", None)
    assert not {"_raw_prompt", "_model"} & set(src.passthrough_columns()) and "lora" in src.passthrough_columns()


def test_a_job_over_request_lines_answers_each_custom_id(tmp_path, cfg):
    path = write_lines(tmp_path / "requests.jsonl", [chat("a", max_tokens=3), completion("b", max_tokens=4),
                                                     chat("c", seed=1, temperature=0)])
    s = run_job(cfg(path, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    assert (s.num_rows, s.num_ok, s.num_error) == (3, 3, 0)
    got = results(tmp_path / "out")
    assert sorted(got) == ["a", "b", "c"]
    assert got["a"]["output_tokens"] <= 3 and got["b"]["output_tokens"] <= 4


def test_n_and_logprobs_reach_the_engine(tmp_path, cfg):
    path = write_lines(tmp_path / "requests.jsonl", [chat("a", n=2, logprobs=True, top_logprobs=2, max_tokens=3),
                                                     completion("b", logprobs=1, max_tokens=3), chat("c", n=0)])
    s = run_job(cfg(path, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    assert (s.num_ok, s.num_error) == (2, 1)
    con, _ = open_results(str(tmp_path / "out"))
    got = con.execute("select id, sample_index, len(logprobs[1].top_logprobs), error from results order by 1, 2"
                      ).fetchall()
    assert got == [("a", 0, 2, None), ("a", 1, 2, None), ("b", 0, 1, None),
                   ("c", 0, None, f"requests.jsonl#3: n is 0; it must be 1 to {MAX_N} (completions of the row)")]


class Recording(FakeEngine):
    """The echo engine, keeping the token ids of each request it is given, by the request's max_tokens."""

    def __init__(self):
        super().__init__()
        self.ids = {}

    def add(self, request_id, prompt_token_ids, sampling, priority=0):
        self.ids[sampling["max_tokens"]] = list(prompt_token_ids)
        super().add(request_id, prompt_token_ids, sampling, priority)


def templated(tokenizer, messages) -> list:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_completions_prompts_go_raw_and_chats_through_the_template(tmp_path, cfg, tokenizer, write_parquet):
    path = write_lines(tmp_path / "requests.jsonl", [chat("c", "Say hi.", max_tokens=3),
                                                     completion("p", "Once upon a time", max_tokens=4)])
    engine = Recording()
    s = run_job(cfg(path, tmp_path / "out"), engine_factory=given(engine), is_tty=False)
    assert (s.num_ok, s.num_error) == (2, 0)
    assert engine.ids[4] == tokenizer("Once upon a time")["input_ids"]          # as OpenAI and vLLM send it
    assert engine.ids[3] == templated(tokenizer, [{"role": "user", "content": "Say hi."}])
    got = results(tmp_path / "out")
    assert got["p"]["prompt_tokens"] == len(engine.ids[4])
    assert "_raw_prompt" not in got["p"] and "_model" not in got["p"]          # internal columns stay inside
    # a --system-prompt joins the chat, and goes before a completions prompt as with --no-chat
    engine = Recording()
    run_job(cfg(path, tmp_path / "out2", prompt={"system_prompt": "Be brief."}), engine_factory=given(engine),
            is_tty=False)
    assert engine.ids[4] == tokenizer("Be brief.\n\nOnce upon a time")["input_ids"]
    assert engine.ids[3] == templated(tokenizer, [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "Say hi."}])
    # a Parquet input's columns of the internal names are ordinary columns: templated, answered, passed through
    inp = write_parquet({"id": ["q"], "prompt": ["Once upon a time"], "max_tokens": [5], "_raw_prompt": [True],
                         "_input_error": ["not an error"], "_model": ["x"]})
    engine = Recording()
    s = run_job(cfg(inp, tmp_path / "out3"), engine_factory=given(engine), is_tty=False)
    assert (s.num_ok, s.num_error) == (1, 0)
    assert engine.ids[5] == templated(tokenizer, [{"role": "user", "content": "Once upon a time"}])
    row = results(tmp_path / "out3")["q"]
    assert (row["_raw_prompt"], row["_input_error"], row["_model"]) == (True, "not an error", "x")


# -- bad lines -------------------------------------------------------------------------------------

BAD = [
    ("not json", "requests.jsonl#2: line 2 is not valid JSON (Expecting value at column 1); write each request "
                 "as one JSON object on one line"),
    ('["a list"]', "requests.jsonl#3: line 3 is a JSON list, not an object; write each request as "
                   "{\"custom_id\", \"method\", \"url\", \"body\"}"),
    ({"method": "POST", "url": CHAT, "body": {"messages": []}},
     "requests.jsonl#4: line 4 has no custom_id string; give every request a unique custom_id"),
    ({**chat("get"), "method": "GET"}, "requests.jsonl#5: line 5: method is \"GET\"; OpenAI Batch requests are "
                                       "\"method\": \"POST\""),
    ({**chat("emb"), "url": "/v1/embeddings"},
     "requests.jsonl#6: line 6: url \"/v1/embeddings\" is not supported; use /v1/chat/completions (body.messages) "
     "or /v1/completions (body.prompt)"),
    ({**chat("nobody"), "body": "hi"}, "requests.jsonl#7: line 7: body is \"hi\"; give the request's parameters as "
                                       "a JSON object"),
    ({**chat("nomsg"), "body": {"prompt": "x"}},
     "requests.jsonl#8: line 8: body has no messages; /v1/chat/completions needs body.messages, a list of "
     "{role, content}"),
    ({**completion("noprompt"), "body": {"messages": []}},
     "requests.jsonl#9: line 9: body has no prompt; /v1/completions needs body.prompt, a string"),
    (chat("image", [{"type": "image_url", "image_url": {"url": "http://x"}}]),
     "requests.jsonl#10: line 10: body.messages[0].content[0] is \"image_url\"; only text parts "
     "({\"type\": \"text\", \"text\": ...}) are supported"),
    (chat("tools", None), "requests.jsonl#11: line 11: body.messages[0].content is null; give a string or a list "
                          "of text parts (tool calls are not supported)"),
    (completion("many", ["a", "b"]), "requests.jsonl#12: line 12: body.prompt is a list of 2 prompts; give one "
                                     "prompt per line, each with its own custom_id"),
    (completion("tokens", [1, 2, 3]), "requests.jsonl#13: line 13: body.prompt is [1, 2, 3]; give the prompt as "
                                      "text (token ids are not supported)"),
    (chat("seed", seed="1"), "requests.jsonl#14: line 14: body.seed is \"1\" (str); it must be an integer"),
    (chat("temp", temperature="hot"), "requests.jsonl#15: line 15: body.temperature is \"hot\" (str); it must be "
                                      "a number"),
    (chat("stop", stop=[1]), "requests.jsonl#16: line 16: body.stop is [1]; give a string or a list of strings"),
    (chat("top", top_logprobs=2), "requests.jsonl#17: line 17: body.top_logprobs is set but body.logprobs is not "
                                  "true; add \"logprobs\": true"),
    ('{"custom_id": "lone", "method": "POST", "url": "/v1/completions", "body": {"prompt": "\\ud800"}}',
     "requests.jsonl#18: line 18 holds a value that cannot be stored ('utf-8' codec can't encode character "
     "'\\ud800' in position 0: surrogates not allowed); fix the line's text (e.g. a lone \\ud800 escape)"),
    (b'{"custom_id": "bytes", "body": "\xff"}', "requests.jsonl#19: line 19 is not valid UTF-8 (at byte 33); "
                                               "re-encode the file as UTF-8"),
    # values of the right type but out of range are validate's, as for a Parquet column
    (chat("range", temperature=-1), "requests.jsonl#20: temperature is -1.0; it must be 0 (greedy) to 2"),
    ({**chat("role"), "body": {"messages": [{"role": "wizard", "content": "x"}]}},
     "requests.jsonl#21: messages[0].role is 'wizard'; use one of system, user, assistant, tool "
     "(or developer, read as system)"),
    ({**chat("empty"), "body": {"messages": []}},
     "requests.jsonl#22: messages must be a non-empty list of {role, content}, got []"),
    # json's decoder recurses once per level: a line nested deeper than Python's limit raised RecursionError
    ('{"custom_id": "deep", "metadata": ' + "[" * 5000 + "]" * 5000 + "}",
     f"requests.jsonl#23: line 23 is nested too deeply to read (over about {sys.getrecursionlimit()} levels of "
     f"arrays and objects); flatten its values"),
    (chat("huge", max_tokens=10 ** 30), "requests.jsonl#24: line 24: body.max_tokens is 1000000000000000000000000000000 "
                                        "(int); it is out of range: give a whole number between -2**63 and 2**63-1"),
    ('{"custom_id": "ctl", "body": "a\tb"}', "requests.jsonl#25: line 25 is not valid JSON (Invalid control character "
                                           "at column 32); write each request as one JSON object on one line"),
    # an integer no float holds (OverflowError) stopped the job, and every rerun, on this line
    (chat("bigint", temperature=10 ** 400), "requests.jsonl#26: line 26: body.temperature is 1" + "0" * 56 + "... "
                                            "(int); it must be a number"),
    # a range error of a body key that fills a column of another name names the key the line gave
    (chat("toplp", logprobs=True, top_logprobs=25), "requests.jsonl#27: line 27: body.top_logprobs is 25; it must be 0 "
                                                  "to 20 (top alternatives per token), or null for none"),
    (chat("mctok", max_completion_tokens=0), "requests.jsonl#28: line 28: body.max_completion_tokens is 0; it must be "
                                           "at least 1 (or null for the job default)"),
]


def test_every_kind_of_bad_line_is_an_error_row_naming_its_line(tmp_path, tiny_model):
    lines = [chat("ok1")] + [x for x, _ in BAD] + [chat("ok2")]
    path = tmp_path / "requests.jsonl"
    path.write_bytes(b"".join((x if isinstance(x, bytes) else (x if isinstance(x, str) else json.dumps(x)).encode())
                              + b"\n" for x in lines))
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["run", str(path), "--out", str(out), "--model", tiny_model, "--engine", "echo",
                                 "--max-tokens", "4"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    got = results(out)
    assert got["ok1"]["status"] == got["ok2"]["status"] == "ok"
    errors = sorted((row["error"] for row in got.values() if row["status"] == "error"),
                    key=lambda e: int(e.split("#")[1].split(":")[0]))
    assert errors == [m for _, m in BAD]
    assert got["seed"]["status"] == "error"   # a bad line with a custom_id keeps it as its id
    assert got["requests.jsonl#2"]["id"] is None  # one without keeps none, and is matched by its origin
    assert got["bytes"]["status"] == "error"  # a line not valid UTF-8 whose custom_id reads whole keeps it too
    # ... and the OpenAI errors file answers it under that custom_id, once, as the input order reads it
    from overnight.pipeline.tools.export import export

    summary = export(str(out), "openai", str(tmp_path / "o.jsonl"), str(tmp_path / "e.jsonl"))
    assert summary["expired"] == 0 and summary["rows"] == len(lines)
    errs = [json.loads(x)["custom_id"] for x in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert errs.count("bytes") == 1


def test_a_schema_the_checks_fail_on_is_an_error_row(tmp_path, cfg):
    # jsonschema raises AttributeError on a $schema that is not a string, instead of judging the schema
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$schema": 7, "type": "object"}}}
    path = write_lines(tmp_path / "requests.jsonl", [chat("good"), chat("bad", response_format=fmt)])
    s = run_job(cfg(path, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    assert (s.exit_code, s.num_ok, s.num_error) == (0, 1, 1)
    got = results(tmp_path / "out")
    assert got["bad"]["error"] == ("requests.jsonl#2: response_format.json_schema.schema is not a valid JSON schema "
                                   "(AttributeError: 'int' object has no attribute 'decode'); check its $schema (a "
                                   "URI string) and keywords")


def test_unknown_body_keys_are_ignored_with_one_warning_each(tmp_path, caplog):
    path = write_lines(tmp_path / "requests.jsonl", [chat("a", tools=[], user="u", reasoning_effort="low"),
                                                     chat("b", tools=[], top_k=5, verbosity="low")])
    with caplog.at_level(logging.WARNING, logger="overnight"):
        rows = rows_of(open_source(InputConfig(path=path)))
    assert [r[INPUT_ERROR_COLUMN] for r in rows] == [None, None]
    warned = [m for m in caplog.messages if "is not supported and is ignored" in m]
    # (tools: [] changes nothing; top_k is vLLM's, and honoured: tests/test_openai_body_keys.py)
    assert warned == ["requests.jsonl line 1: body.reasoning_effort is not supported and is ignored (in every line; "
                      "said once per key)",
                      "requests.jsonl line 2: body.verbosity is not supported and is ignored (in every line; said "
                      "once per key)"]


def test_a_duplicate_custom_id_is_skipped_and_counted(tmp_path, cfg, caplog):
    path = write_lines(tmp_path / "requests.jsonl", [chat("a"), chat("b"), chat("a", "again")])
    with caplog.at_level(logging.WARNING, logger="overnight"):
        s = run_job(cfg(path, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    assert (s.num_ok, s.num_duplicates) == (2, 1)
    assert "duplicate id 'a' at requests.jsonl#3: the first row with this id is kept, this one is skipped" \
        in caplog.messages


def test_a_utf16_file_is_refused_naming_it(tmp_path, cfg):
    """A UTF-16 file (as PowerShell writes): json.loads of each line's bytes took some lines as UTF-16 and made
    others error rows; the file is refused at open with the fix."""
    from overnight.pipeline.input.source import InputError

    text = "".join(json.dumps(chat(f"c{i}")) + "\n" for i in range(3))
    path = tmp_path / "requests.jsonl"
    path.write_bytes(text.encode("utf-16"))
    with pytest.raises(InputError, match=r"requests.jsonl is UTF-16 or UTF-32 text .*Re-encode the file as UTF-8"):
        run_job(cfg(path, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
