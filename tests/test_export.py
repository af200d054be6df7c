"""`overnight export`: one compacted file in input order, and OpenAI Batch output lines that OpenAI's own
types parse (ok rows), with error rows and rows never done (batch_expired) in the errors file."""

from __future__ import annotations

import decimal
import json

import duckdb
import pyarrow as pa
import pytest

from fakes import FakeEngine, given
from overnight.pipeline.api import run_job
from overnight.pipeline.tools.export import export


@pytest.fixture
def job(tmp_path, cfg, write_parquet):
    ids = [f"r{i:03d}" for i in range(40)][::-1]            # input order is not id order
    prompts = [None if i == 7 else f"question {i} " + "word " * (i % 5) for i in range(40)]
    inp = write_parquet({"id": ids, "prompt": prompts})
    out = tmp_path / "out"
    run_job(cfg(inp, out, input={"limit": 30}), engine_factory=given(FakeEngine()), is_tty=False)  # 10 not done
    return ids, out


@pytest.mark.parametrize("fmt", ["parquet", "csv", "jsonl"])
def test_one_file_in_input_order(job, tmp_path, fmt):
    ids, out = job
    path = tmp_path / f"all.{fmt}"
    info = export(str(out), fmt, str(path))
    assert info == {"rows": 30, "in_input_order": True, "output": str(path)}
    reader = {"parquet": "read_parquet", "csv": "read_csv_auto", "jsonl": "read_json_auto"}[fmt]
    got = [r[0] for r in duckdb.sql(f"select id from {reader}('{path}')").fetchall()]
    assert got == ids[:30]


def _stopped(out) -> set:
    """Remove OUT's last part, as if the job had been killed before it wrote it; the ids the other parts hold."""
    parts = sorted((out / "parts").glob("part-*.parquet"))
    parts[-1].unlink()
    return {r[0] for r in duckdb.sql(f"select id from read_parquet('{out}/parts/part-*.parquet')").fetchall()}


def test_openai_batch_output_parses_with_openai_types(job, tmp_path):
    from openai.types import BatchError
    from openai.types.chat import ChatCompletion

    ids, out = job
    done = _stopped(out)                                       # the job covers ids[:30] (--limit 30)
    left = [i for i in ids[:30] if i not in done]
    assert left and ids[7] in done
    ok_path, err_path = tmp_path / "results.jsonl", tmp_path / "errors.jsonl"
    info = export(str(out), "openai", str(ok_path), str(err_path))
    assert (info["ok"], info["errors"], info["expired"]) == (len(done) - 1, 1, len(left))
    lines = [json.loads(x) for x in ok_path.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == [i for n, i in enumerate(ids[:30]) if n != 7 and i in done]
    for x in lines:
        assert x["error"] is None and x["response"]["status_code"] == 200 and x["id"].startswith("batch_req_")
        completion = ChatCompletion.model_validate(x["response"]["body"])   # a user's parser works unchanged
        assert completion.choices[0].message.role == "assistant" and completion.usage.total_tokens > 0
    errors = [json.loads(x) for x in err_path.read_text().splitlines()]
    bad = errors[0]                                            # a bad request, as OpenAI writes one: HTTP 400
    assert bad["custom_id"] == ids[7] and bad["error"] is None and bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"] == {
        "message": "in.parquet#7: prompt column 'prompt' is null; give the row a prompt or a 'messages' chat",
        "type": "invalid_request_error", "param": None, "code": None}
    assert [e["custom_id"] for e in errors[1:]] == left        # the rows past --limit were never the job's
    for e in errors[1:]:                                       # never reached: OpenAI's batch_expired
        assert BatchError.model_validate(e["error"]).code == "batch_expired" and e["response"] is None


# -- OpenAI Batch input ----------------------------------------------------------------------------

def request(cid, words: int) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": "word " * words}]}})


def test_a_jsonl_jobs_rows_come_in_line_order(tmp_path, cfg):
    ids = [f"r{i:03d}" for i in range(40)][::-1]
    lines = [request(cid, 1 + i % 7) for i, cid in enumerate(ids)]
    lines[7] = "not json"                                               # no custom_id: an error row without an id
    lines[11] = json.dumps({"custom_id": ids[11], "method": "POST", "url": "/v1/embeddings", "body": {}})
    lines.insert(20, "")                                                # blank lines are not rows
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    run_job(cfg(path, out, input={"limit": 30}), engine_factory=given(FakeEngine()), is_tty=False)  # 30 of 40
    finished = [r[0] for r in duckdb.sql(f"select id from read_parquet('{out}/parts/part-*.parquet')").fetchall()]
    assert finished != [i for n, i in enumerate(ids[:30]) if n != 7] + [None]  # the parts hold finish order

    ok_path, err_path = tmp_path / "results.jsonl", tmp_path / "errors.jsonl"
    info = export(str(out), "openai", str(ok_path), str(err_path))
    assert (info["ok"], info["errors"], info["expired"], info["in_input_order"]) == (28, 2, 0, True)
    assert [json.loads(x)["custom_id"] for x in ok_path.read_text().splitlines()] == \
        [i for n, i in enumerate(ids[:30]) if n not in (7, 11)]
    errors = [json.loads(x) for x in err_path.read_text().splitlines()]
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == \
        [(None, 400), (ids[11], 400)]  # in line order, the line without a custom_id too; none past --limit
    info = export(str(out), "jsonl", str(tmp_path / "all.jsonl"))
    got = [json.loads(x)["id"] for x in (tmp_path / "all.jsonl").read_text().splitlines()]
    assert got == [None if n == 7 else i for n, i in enumerate(ids[:30])] and info["in_input_order"]
    # an input that moved: finish order, and said so
    path.rename(tmp_path / "moved.jsonl")
    assert export(str(out), "openai", str(ok_path), str(err_path))["in_input_order"] is False


def test_a_jsonl_folders_files_come_in_the_sources_order(tmp_path, cfg):
    import gzip

    folder = tmp_path / "reqs"
    (folder / "b").mkdir(parents=True)
    (folder / "a.jsonl").write_text("".join(request(f"a{i}", 6 - i) + "\n" for i in range(6)))
    with gzip.open(folder / "b" / "c.jsonl.gz", "wt") as f:
        f.write("".join(request(f"c{i}", 1 + i) + "\n" for i in range(5)))
    out = tmp_path / "out"
    run_job(cfg(folder, out), engine_factory=given(FakeEngine()), is_tty=False)
    info = export(str(out), "openai", str(tmp_path / "results.jsonl"))
    assert info["in_input_order"] and info["ok"] == 11
    got = [json.loads(x)["custom_id"] for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert got == [f"a{i}" for i in range(6)] + [f"c{i}" for i in range(5)]


def test_lines_without_a_custom_id_are_in_order_and_never_lost(tmp_path, cfg):
    """A line without a custom_id is tied to its error row by its origin: in line order when read, and
    batch_expired (custom_id null) when the job stopped before it; the rows a job never did are all accounted for."""
    lines = [request(f"r{i}", 2) for i in range(30)]
    lines[3] = lines[25] = '{"method": "POST", "url": "/v1/chat/completions", "body": {}}'   # no custom_id
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    run_job(cfg(path, out, input={"limit": 20}), engine_factory=given(FakeEngine()), is_tty=False)
    run_job(cfg(path, out, input={"limit": 20}), engine_factory=given(FakeEngine()), is_tty=False)  # resumed
    ok_path, err_path = tmp_path / "results.jsonl", tmp_path / "errors.jsonl"
    info = export(str(out), "openai", str(ok_path), str(err_path))   # the job's rows: the first 20 lines
    assert (info["ok"], info["errors"], info["expired"]) == (19, 1, 0)   # line 4's error row once, not expired
    assert [json.loads(x)["custom_id"] for x in err_path.read_text().splitlines()] == [None]
    # the whole file as the job, stopped when its first 20 lines were done (its manifest without the limit):
    # line 26, without a custom_id, was never read
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["config"]["input"]["limit"] = None
    (out / "manifest.json").write_text(json.dumps(manifest))
    info = export(str(out), "openai", str(ok_path), str(err_path))
    errors = [json.loads(x) for x in err_path.read_text().splitlines()]
    assert (info["ok"], info["errors"], info["expired"], info["rows"]) == (19, 1, 10, len(lines))
    assert [(e["custom_id"], (e["error"] or {}).get("code")) for e in errors] == \
        [(None, None)] + [(f"r{i}", "batch_expired") for i in range(20, 25)] + \
        [(None, "batch_expired")] + [(f"r{i}", "batch_expired") for i in range(26, 30)]


def test_export_files_and_values(job, tmp_path):
    """--errors may be --output itself; a path that cannot be written is named, and leaves the files as they
    were; a float JSON cannot hold (NaN) is null in jsonl."""
    from overnight.pipeline.output.checkpoint import OutputError

    ids, out = job
    both = tmp_path / "both.jsonl"
    info = export(str(out), "openai", str(both), str(both))
    lines = [json.loads(x) for x in both.read_text().splitlines()]
    assert len(lines) == info["rows"] == 30 and sum(x["response"]["status_code"] == 400 for x in lines) == 1
    before = both.read_bytes()
    for fmt, output, errors, named in (("openai", str(both), str(tmp_path / "no" / "e.jsonl"), "--errors"),
                                       ("openai", str(tmp_path / "no" / "o.jsonl"), None, "--output"),
                                       ("jsonl", str(tmp_path / "no" / "o.jsonl"), None, "--output"),
                                       ("csv", str(tmp_path / "no" / "o.csv"), None, "--output")):
        with pytest.raises(OutputError, match=f"{named} .*no/.*cannot be written"):
            export(str(out), fmt, output, errors)
    assert both.read_bytes() == before


def test_jsonl_export_writes_json(tmp_path, cfg, write_parquet):
    inp = write_parquet({"id": ["a", "b", "c"], "prompt": ["x", "y", "z"],
                         "score": [float("nan"), float("inf"), 0.5]})
    out = tmp_path / "out"
    run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    export(str(out), "jsonl", str(tmp_path / "all.jsonl"))
    rows = [json.loads(x, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
            for x in (tmp_path / "all.jsonl").read_text().splitlines()]
    assert [r["score"] for r in rows] == [None, None, 0.5]


def test_jsonl_and_csv_keep_nanoseconds_at_the_top_and_nested(tmp_path, cfg, write_parquet):
    """A Python datetime, as DuckDB fetches one, holds microseconds: jsonl wrote 00:00:01 for 00:00:01.000000001."""
    one = 1_000_000_001
    inp = write_parquet({"id": ["a", None], "prompt": ["x", "y"], "ts": pa.array([one, None], pa.timestamp("ns")),
                         "at": pa.array([one, one], pa.time64("ns")),
                         "ev": pa.array([{"t": one}, None], pa.struct([("t", pa.timestamp("ns", "UTC"))]))})
    out = tmp_path / "out"
    run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    export(str(out), "jsonl", str(tmp_path / "all.jsonl"))
    rows = [json.loads(x) for x in (tmp_path / "all.jsonl").read_text().splitlines()]
    assert [(r["status"], r["ts"], r["at"], r["ev"]) for r in rows] == [
        ("ok", "1970-01-01 00:00:01.000000001", "00:00:01.000000001", {"t": "1970-01-01 00:00:01.000000001+00"}),
        ("error", None, "00:00:01.000000001", None)]
    export(str(out), "csv", str(tmp_path / "all.csv"))
    row = duckdb.sql(f"select ts::varchar, ev from read_csv('{tmp_path / 'all.csv'}', all_varchar=true)").fetchall()
    assert row[0] == ("1970-01-01 00:00:01.000000001", '{"t":"1970-01-01 00:00:01.000000001+00"}')


def test_a_moved_folder_of_request_lines_still_tells_completions(tmp_path, cfg):
    folder = tmp_path / "reqs"
    folder.mkdir()
    (folder / "a.jsonl").write_text(request("chat", 2) + "\n" + json.dumps(
        {"custom_id": "text", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Once"}}) + "\n")
    out = tmp_path / "out"
    run_job(cfg(folder, out), engine_factory=given(FakeEngine()), is_tty=False)
    folder.rename(tmp_path / "moved")
    info = export(str(out), "openai", str(tmp_path / "results.jsonl"))
    assert not info["in_input_order"]
    got = {x["custom_id"]: x["response"]["body"]["object"]
           for x in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    assert got == {"chat": "chat.completion", "text": "text_completion"}


def test_error_lines_say_what_kind_of_failure(tmp_path):
    """An error row's message tells export which of OpenAI's lines it is (pipeline/records.py's phrases)."""
    from overnight.pipeline.records import DEADLINE_PASSED, ENGINE_INTERNAL_ERROR, NO_ROOM_FOR_OUTPUT
    from overnight.pipeline.tools.openai_lines import error_line

    def kind(message):
        x = error_line("q", message)
        if x["response"] is None:
            return x["error"]["code"]
        e = x["response"]["body"]["error"]
        return x["response"]["status_code"], e["type"], e["code"]

    assert kind(f"a.parquet#1: its deadline 2026-01-01T00:00:00+00:00 {DEADLINE_PASSED}") == "batch_expired"
    assert kind(f"a.parquet#1: {ENGINE_INTERNAL_ERROR} (vLLM's ...)") == (500, "server_error", None)
    assert kind(f"a.parquet#1: prompt is 9 tokens, {NO_ROOM_FOR_OUTPUT}=8; shorten") == \
        (400, "invalid_request_error", "context_length_exceeded")
    assert kind("a.parquet#1: temperature is -1.0; it must be 0 (greedy) to 2") == (400, "invalid_request_error", None)


def test_a_row_whose_own_deadline_passed_counts_as_expired(tmp_path, cfg, write_parquet):
    """Its line is OpenAI's batch_expired, and the summary counts it there, not among the errors."""
    inp = write_parquet({"id": ["a", "b", "c"], "prompt": ["hi", "yo", "hey"],
                         "deadline": [None, "2020-01-01T00:00:00Z", None]})
    out = tmp_path / "out"
    assert run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False).exit_code == 0
    info = export(str(out), "openai", str(tmp_path / "o.jsonl"), str(tmp_path / "e.jsonl"))
    assert (info["ok"], info["errors"], info["expired"]) == (2, 0, 1)
    [line] = [json.loads(x) for x in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert line["custom_id"] == "b" and line["error"]["code"] == "batch_expired"


def _rows(n):
    return {"id": [f"r{i:03d}" for i in range(n)][::-1], "prompt": [f"q {i} " + "word " * (i * 7 % 11) for i in range(n)]}


def test_a_rerun_with_a_lower_limit_keeps_every_row_in_input_order(tmp_path, cfg, write_parquet):
    """OUT holds the 60 rows of a first run; the rerun's --limit 10 covers 10 of them. Every row is exported in
    input order, and none is said to be never done (the rows past the limit were placed last, in part order)."""
    rows = _rows(60)
    inp = write_parquet(rows)
    out = tmp_path / "out"
    run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    s = run_job(cfg(inp, out, input={"limit": 10}), engine_factory=given(FakeEngine()), is_tty=False)
    # the summary and inspect say why OUT holds more rows than this run's input
    assert "10/10 rows (60 ok, 0 error, 10 already done; the output holds 50 rows beyond this input's" in s.line()
    from overnight.pipeline.tools.inspection import open_results, summary_lines

    assert "(10 rows within --limit 10)" in summary_lines(*open_results(str(out)))[1]
    info = export(str(out), "parquet", str(tmp_path / "all.parquet"))
    assert info["rows"] == 60 and info["in_input_order"]
    assert [r[0] for r in duckdb.sql(f"select id from '{tmp_path / 'all.parquet'}'").fetchall()] == rows["id"]
    info = export(str(out), "openai", str(tmp_path / "o.jsonl"), str(tmp_path / "e.jsonl"))
    assert (info["ok"], info["expired"]) == (60, 0)


def test_each_shard_keeps_its_own_limit(tmp_path, cfg, write_parquet):
    """Shard 0 of 2 ran with --limit 5, shard 1 without: export reads each shard's rows to its own limit, so the
    order holds and shard 1's rows are not taken for rows never done (or shard 0's past its limit for the job's)."""
    rows = _rows(40)
    inp = write_parquet(rows)
    out = tmp_path / "out"
    run_job(cfg(inp, out, input={"limit": 5}, cluster={"shard": "0/2"}), engine_factory=given(FakeEngine()),
            is_tty=False)
    run_job(cfg(inp, out, cluster={"shard": "1/2"}), engine_factory=given(FakeEngine()), is_tty=False)
    want = rows["id"][:5] + rows["id"][20:]
    info = export(str(out), "parquet", str(tmp_path / "all.parquet"))
    assert info["rows"] == 25 and info["in_input_order"]
    assert [r[0] for r in duckdb.sql(f"select id from '{tmp_path / 'all.parquet'}'").fetchall()] == want
    info = export(str(out), "openai", str(tmp_path / "o.jsonl"), str(tmp_path / "e.jsonl"))
    assert (info["ok"], info["expired"]) == (25, 0)
    # and the other way round: shard 1 limited, shard 0 not; shard 1's rows past its limit were never the job's
    out2 = tmp_path / "out2"
    run_job(cfg(inp, out2, cluster={"shard": "0/2"}), engine_factory=given(FakeEngine()), is_tty=False)
    run_job(cfg(inp, out2, input={"limit": 3}, cluster={"shard": "1/2"}), engine_factory=given(FakeEngine()),
            is_tty=False)
    info = export(str(out2), "openai", str(tmp_path / "o2.jsonl"), str(tmp_path / "e2.jsonl"))
    assert (info["ok"], info["expired"]) == (23, 0)


def test_an_id_in_two_shards_files_keeps_each_rows_samples_together(tmp_path, cfg):
    """One id in two shards' files is answered by each; with n > 1 each answer is one well-formed openai line
    (choices 0..n-1), and the other formats keep each row's samples together rather than interleave them."""
    import pyarrow.parquet as pq

    inp = tmp_path / "in"
    inp.mkdir()
    pq.write_table(pa.table({"id": ["x", "dup"], "prompt": ["hello one", "dup first"]}), inp / "a.parquet")
    pq.write_table(pa.table({"id": ["dup", "y"], "prompt": ["dup second", "hello two"]}), inp / "b.parquet")
    out = tmp_path / "out"
    for k in (0, 1):
        run_job(cfg(inp, out, sampling={"n": 3, "temperature": 0.7}, cluster={"shard": f"{k}/2"}),
                engine_factory=given(FakeEngine()), is_tty=False)
    export(str(out), "openai", str(tmp_path / "o.jsonl"))
    lines = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == ["x", "dup", "dup", "y"]
    assert all([c["index"] for c in x["response"]["body"]["choices"]] == [0, 1, 2] for x in lines)
    export(str(out), "jsonl", str(tmp_path / "all.jsonl"))
    rows = [json.loads(x) for x in (tmp_path / "all.jsonl").read_text().splitlines()]
    got = [(r["id"], r["sample_index"], r["prompt"]) for r in rows if r["id"] == "dup"]
    first = got[0][2]
    assert [g[2] for g in got] == [first] * 3 + [({"dup first", "dup second"} - {first}).pop()] * 3
    assert [g[1] for g in got] == [0, 1, 2, 0, 1, 2]


def test_binary_and_decimal_passthrough_columns_keep_their_values_and_json_types(tmp_path, cfg):
    """A binary passthrough column (image bytes, a hash) is carried as bytes, not read as text: bytes that are not
    UTF-8 are no error. jsonl gives bytes as base64, and a DECIMAL as a number on every line (before: a string,
    except on a line that also held a NaN)."""
    import base64
    import pyarrow.parquet as pq

    png = b"\x89PNG\r\n\x1a\n"
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["r1", "r2"], "prompt": ["hi", "there"],
                             "blob": pa.array([png, b"abc"], pa.binary()),
                             "price": pa.array([decimal.Decimal("1.25"), decimal.Decimal("2.50")], pa.decimal128(5, 2)),
                             "score": [float("nan"), 1.0]}), inp)
    out = tmp_path / "out"
    s = run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    assert (s.num_ok, s.num_error) == (2, 0)
    parts = pq.read_table(out / "parts")
    assert parts.schema.field("blob").type == pa.binary() and parts.column("blob").to_pylist() == [png, b"abc"]
    export(str(out), "jsonl", str(tmp_path / "all.jsonl"))
    rows = [json.loads(x) for x in (tmp_path / "all.jsonl").read_text().splitlines()]
    assert [base64.b64decode(r["blob"]) for r in rows] == [png, b"abc"]
    assert [r["price"] for r in rows] == [1.25, 2.5] and [r["score"] for r in rows] == [None, 1.0]


def test_openai_export_of_a_running_job_is_refused(job, tmp_path):
    """Its rows not done yet are not expired: the openai format waits for the job's end; jsonl takes the rows done
    so far."""
    from overnight.pipeline.output.checkpoint import OutputDir, OutputError
    from overnight.pipeline.output.lock import RunLock

    ids, out = job
    for name in ("manifest.json", "status.json"):   # as a run writes them while it runs
        path = out / name
        path.write_text(json.dumps({**json.loads(path.read_text()), "state": "running", "exit_code": None}))
    lock = RunLock(OutputDir(str(out)))
    lock.acquire()
    try:
        with pytest.raises(OutputError, match="is still running: --format openai would write the rows not done"):
            export(str(out), "openai", str(tmp_path / "o.jsonl"))
        assert not (tmp_path / "o.jsonl").exists()
        assert export(str(out), "jsonl", str(tmp_path / "so-far.jsonl"))["rows"] == 30
    finally:
        lock.release()


def test_openai_line_ids_are_random_hex_and_a_forked_child_draws_its_own():
    """(Ids drawn from a pool would repeat the parent's in a forked child.)"""
    import os

    from overnight.pipeline.tools.openai_lines import new_id

    ids = [new_id() for _ in range(10_000)]
    assert len(set(ids)) == len(ids) and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, new_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 64).decode() != new_id()
