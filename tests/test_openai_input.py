"""OpenAI Batch input (`overnight run requests.jsonl`), through the echo engine: request lines become rows
(custom_id as the id; messages or prompt; the body's sampling keys as per-row columns), every kind of bad line
becomes an error row that names its file and line and the fix while the job goes on, files stream in chunks,
fsspec URLs and .jsonl.gz, resume, shards, plan."""

from __future__ import annotations

import gzip
import json
import logging

import duckdb
import fsspec
import pytest
from click.testing import CliRunner

from fakes import FakeEngine, given
from overnight.jobs.cli import cli
from overnight.pipeline.api import run_job
from overnight.pipeline.config import MAX_N, InputConfig
from overnight.pipeline.input import openai_batch
from overnight.pipeline.input.openai_batch import OpenAIBatchSource
from overnight.pipeline.input.shards import Fragment, Shard
from overnight.pipeline.input.source import INPUT_ERROR_COLUMN, InputError, open_source
from overnight.pipeline.tools.inspection import open_results

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat(cid, content="Say hi.", **body):
    return {"custom_id": cid, "method": "POST", "url": CHAT,
            "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}], **body}}


def completion(cid, prompt="Once upon a time", **body):
    return {"custom_id": cid, "method": "POST", "url": COMPLETIONS, "body": {"model": "x", "prompt": prompt, **body}}


def write_lines(path, lines) -> str:
    text = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    if str(path).endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return str(path)


def rows_of(src) -> list[dict]:
    return [r for sb in src.batches() for r in sb.batch.to_pylist()]


def results(out) -> dict:
    con, _ = open_results(str(out))
    cur = con.execute("select * from results")
    names = [d[0] for d in cur.description]
    return {r["id"] if r["id"] is not None else r["error"].split(":")[0]: r
            for r in (dict(zip(names, x)) for x in cur.fetchall())}


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
     "requests.jsonl#21: messages[0].role is 'wizard'; use one of system, user, assistant, tool"),
    ({**chat("empty"), "body": {"messages": []}},
     "requests.jsonl#22: messages must be a non-empty list of {role, content}, got []"),
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
    path = write_lines(tmp_path / "requests.jsonl", [chat("a", tools=[], user="u"), chat("b", tools=[], top_k=5)])
    with caplog.at_level(logging.WARNING, logger="overnight"):
        rows = rows_of(open_source(InputConfig(path=path)))
    assert [r[INPUT_ERROR_COLUMN] for r in rows] == [None, None]
    warned = [m for m in caplog.messages if "is not supported and is ignored" in m]
    assert warned == ["requests.jsonl line 1: body.tools is not supported and is ignored (in every line; said once "
                      "per key)",
                      "requests.jsonl line 2: body.top_k is not supported and is ignored (in every line; said once "
                      "per key)"]


def test_a_duplicate_custom_id_is_skipped_and_counted(tmp_path, cfg, caplog):
    path = write_lines(tmp_path / "requests.jsonl", [chat("a"), chat("b"), chat("a", "again")])
    with caplog.at_level(logging.WARNING, logger="overnight"):
        s = run_job(cfg(path, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    assert (s.num_ok, s.num_duplicates) == (2, 1)
    assert "duplicate id 'a' at requests.jsonl#3: the first row with this id is kept, this one is skipped" \
        in caplog.messages


# -- streaming, files, URLs ----------------------------------------------------------------------------

def test_streams_in_chunks_and_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(openai_batch, "CHUNK_LINES", 4)
    lines = [chat(f"r{i}") for i in range(10)]
    lines.insert(5, "")   # a blank line: skipped, but counted in the line numbers
    path = write_lines(tmp_path / "requests.jsonl", lines)
    src = open_source(InputConfig(path=path, batch_rows=3))
    f = src.files[0]
    assert (f.num_rows, f.row_groups) == (10, (4, 3, 3)) and len(f.offsets) == 3
    batches = list(src.batches())
    assert [sb.batch.num_rows for sb in batches] == [3, 3, 3, 1]
    assert [sb.row_number(i) for sb in batches for i in range(sb.batch.num_rows)] == [1, 2, 3, 4, 5, 7, 8, 9, 10, 11]
    assert [r["id"] for sb in batches for r in sb.batch.to_pylist()] == [f"r{i}" for i in range(10)]
    # one chunk alone, read from its byte offset, and a slice of it (what shards and Ray units read)
    one = [r["id"] for sb in src._read(iter([Fragment(0, 1, 3)]), ["id"]) for r in sb.batch.to_pylist()]
    part = [r["id"] for sb in src._read(iter([Fragment(0, 2, 2, (1, 3))]), ["id"]) for r in sb.batch.to_pylist()]
    assert (one, part) == (["r4", "r5", "r6"], ["r8", "r9"])
    assert [sb.batch.num_rows for sb in open_source(InputConfig(path=path, limit=5, batch_rows=3)).batches()] == [3, 2]


def test_fsspec_urls_folders_globs_and_gzip(tmp_path):
    fs = fsspec.filesystem("memory")
    with fs.open("/reqs/a.jsonl", "wb") as f:
        f.write((json.dumps(chat("m1")) + "\n" + json.dumps(completion("m2")) + "\n").encode())
    assert [r["id"] for r in rows_of(open_source(InputConfig(path="memory://reqs/a.jsonl")))] == ["m1", "m2"]
    assert [r["id"] for r in rows_of(open_source(InputConfig(path="memory://reqs")))] == ["m1", "m2"]
    local = write_lines(tmp_path / "d" / "b.jsonl", [chat("l1")])
    gz = write_lines(tmp_path / "d" / "sub" / "c.jsonl.gz", [chat("g1"), chat("g2")])
    assert [r["id"] for r in rows_of(open_source(InputConfig(path=f"file://{local}")))] == ["l1"]
    src = open_source(InputConfig(path=gz))
    assert src.files[0].row_groups == (2,) and src.files[0].offsets == ()   # a .gz file is one chunk
    assert [r["id"] for r in rows_of(src)] == ["g1", "g2"]
    folder = open_source(InputConfig(path=str(tmp_path / "d")))
    assert [f.name for f in folder.files] == ["b.jsonl", "sub/c.jsonl.gz"] and folder.num_rows == 3
    assert [r["id"] for r in rows_of(open_source(InputConfig(path=f"{tmp_path}/d/*.jsonl")))] == ["l1"]


def test_a_folder_skips_files_in_hidden_and_underscore_folders(tmp_path, write_parquet):
    write_lines(tmp_path / "d" / "a.jsonl", [chat("a")])
    write_lines(tmp_path / "d" / "_temporary" / "0" / "a.jsonl", [chat("stale")])
    write_lines(tmp_path / "d" / ".snapshot" / "a.jsonl", [chat("old")])
    write_parquet({"prompt": ["x"]}, "d/_delta_log/x.parquet")   # not a Parquet file of the input either
    src = open_source(InputConfig(path=str(tmp_path / "d")))
    assert isinstance(src, OpenAIBatchSource) and [f.name for f in src.files] == ["a.jsonl"]
    assert [r["id"] for r in rows_of(src)] == ["a"]


def test_input_errors_name_the_file_and_fix(tmp_path, write_parquet):
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(InputError, match=r"bad.jsonl.gz cannot be read as JSONL \(.*\)\. Check the file"):
        open_source(InputConfig(path=str(tmp_path / "bad.jsonl.gz")))
    write_lines(tmp_path / "mixed" / "a.jsonl", [chat("a")])
    write_parquet({"prompt": ["x"]}, "mixed/b.parquet")
    with pytest.raises(InputError, match=r"holds both Parquet and JSONL files\. Point INPUT at one kind"):
        open_source(InputConfig(path=str(tmp_path / "mixed")))
    with pytest.raises(InputError, match=r"Input .*missing.jsonl does not exist"):
        open_source(InputConfig(path=str(tmp_path / "missing.jsonl")))


def test_an_empty_file_has_nothing_to_do(tmp_path, cfg):
    path = tmp_path / "requests.jsonl"
    path.write_text("\n\n")
    s = run_job(cfg(path, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    assert s.num_rows == 0 and s.exit_code == 0


# -- resume, shards, plan ----------------------------------------------------------------------------

def test_resume_after_a_partial_run_answers_each_line_once(tmp_path, cfg):
    lines = [chat(f"r{i}") if i % 4 else "broken line" for i in range(12)]
    path = write_lines(tmp_path / "requests.jsonl", lines)
    out = tmp_path / "out"
    first = run_job(cfg(path, out, input={"limit": 6}), engine_factory=given(FakeEngine()), is_tty=False)
    assert (first.num_ok, first.num_error) == (4, 2)
    second = FakeEngine()
    s = run_job(cfg(path, out), engine_factory=given(second), is_tty=False)
    assert s.state == "completed" and (s.num_ok, s.num_error, s.num_rows) == (9, 3, 12)
    con, _ = open_results(str(out))
    ids = [r[0] for r in con.execute("select id from results where id is not null").fetchall()]
    errors = [r[0] for r in con.execute("select error from results where id is null order by error").fetchall()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(12) if i % 4)            # each once
    assert [e.split(":")[0] for e in errors] == ["requests.jsonl#1", "requests.jsonl#5", "requests.jsonl#9"]
    again = run_job(cfg(path, out), engine_factory=given(FakeEngine()), is_tty=False)
    assert again.num_done == 12 and con.execute("select count(*) from results").fetchone()[0] == 12


def test_a_rewrite_of_the_same_size_is_not_taken_for_the_same_input(tmp_path, cfg):
    """memory:// tells no modification time; its creation time tells a rewrite, where the size alone did not."""
    fs = fsspec.filesystem("memory")

    def write(day):
        fs.pipe("/rewrite/requests.jsonl", "".join(json.dumps(completion(f"{day}-{i}")) + "\n"
                                                   for i in range(3)).encode())

    write("2026-11-24")
    c = cfg("memory://rewrite/requests.jsonl", "memory://rewrite/out")
    assert run_job(c, engine_factory=given(FakeEngine()), is_tty=False).num_ok == 3
    write("2026-11-25")   # the same size
    s = run_job(c, engine_factory=given(FakeEngine()), is_tty=False)
    assert (s.state, s.num_ok) == ("completed", 6)


@pytest.mark.parametrize("gz,how", [(False, "split by 3 row groups in 1 files"), (True, "split by a hash")])
def test_shards_split_the_lines_and_answer_each_once(tmp_path, cfg, monkeypatch, gz, how):
    monkeypatch.setattr(openai_batch, "CHUNK_LINES", 4)
    path = write_lines(tmp_path / ("requests.jsonl.gz" if gz else "requests.jsonl"),
                       [chat(f"r{i}") for i in range(10)] + ["bad"])
    out = tmp_path / "out"
    counts = []
    for k in range(2):
        c = cfg(path, out, cluster={"shard": f"{k}/2"})
        s = run_job(c, engine_factory=given(FakeEngine()), is_tty=False)
        counts.append(s.num_rows)
        src = open_source(c.input, Shard(k, 2))
        assert how in src.selection.how
    ids = [r[0] for r in duckdb.sql(f"select coalesce(id, error) from read_parquet('{out}/shards/*/parts/*.parquet')"
                                    ).fetchall()]
    assert sum(counts) == 11 and len(ids) == len(set(ids)) == 11 and min(counts) > 0


def test_plan_reads_request_lines(tmp_path, cfg):
    from overnight.pipeline.scheduling.plan import make_plan

    path = write_lines(tmp_path / "requests.jsonl", [chat("a"), completion("b"), "bad"])
    p = make_plan(cfg(path, tmp_path / "out"), throughput=100)
    assert (p.num_rows, p.num_errors) == (3, 1)


@pytest.mark.slow
def test_ray_workers_share_the_lines_and_answer_each_once(tmp_path, cfg, monkeypatch):
    ray = pytest.importorskip("ray")
    from overnight.pipeline.cluster.ray_job import run_on_ray

    monkeypatch.setattr(openai_batch, "CHUNK_LINES", 50)   # the driver's listing, which the workers read
    path = write_lines(tmp_path / "requests.jsonl", [chat(f"r{i}") for i in range(300)] + ["bad"])
    out = tmp_path / "out"
    c = cfg(path, out, engine={"kind": "echo", "echo_step_ms": 5, "max_num_seqs": 8}, sampling={"max_tokens": 4})
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        s = run_on_ray(c, False, 2, is_tty=False)
    finally:
        ray.shutdown()
    assert (s.state, s.num_done, s.num_rows) == ("completed", 301, 301)
    got = duckdb.sql(f"select id, error from read_parquet('{out}/workers/*/parts/*.parquet')").fetchall()
    ids = [i for i, _ in got if i is not None]
    assert len(got) == 301 and sorted(ids) == sorted(f"r{i}" for i in range(300))
    assert [e for i, e in got if i is None][0].startswith("requests.jsonl#301: line 301 is not valid JSON")
