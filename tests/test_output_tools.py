"""The commands that read OUT (inspect, status, report, export) on what a job leaves there: an attempt stopped
before its first part, duplicate ids, n > 1 samples, derived ids, remote and relative inputs, OpenAI
/v1/completions lines, and an OUT whose name holds glob characters. Echo engine only."""

from __future__ import annotations

import json
import os

import duckdb
import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fakes import FakeEngine, given
from overnight.pipeline.api import run_job
from overnight.pipeline.job import open_job
from overnight.pipeline.output.checkpoint import OutputError
from overnight.pipeline.tools.export import export
from overnight.pipeline.tools.inspection import open_results, summary_lines
from overnight.pipeline.tools.status import job_status, status_lines


def _started_not_flushed(cfg) -> None:
    """An attempt that opened OUT (manifest written, attempt recorded) and was killed before its first part: its
    lock's holder is gone."""
    job = open_job(cfg)
    job.lock.release()


def _ids(path) -> list:
    return [json.loads(x)["custom_id"] for x in open(path).read().splitlines()]


# -- A: an OUT with a manifest and no part yet ----------------------------------------------------------------

def test_a_job_stopped_before_its_first_part_is_inspected_reported_and_exported(tmp_path, cfg, write_parquet):
    from overnight.pipeline.tools.report import build

    inp = write_parquet({"id": ["a", "b", "c"], "prompt": ["hi", "yo", "hey"]})
    out = tmp_path / "out"
    _started_not_flushed(cfg(inp, out, sampling={"n": 2, "temperature": 0.5}))
    con, m = open_results(str(out))
    columns = {r[0] for r in con.execute("describe results").fetchall()}
    assert {"id", "sample_index", "text", "prompt_tokens", "output_tokens", "status", "engine_seconds"} <= columns
    assert "rows: 0 (0 ok, 0 error, 3 not done; 0 samples)" in summary_lines(con, m)
    assert ("rows", "0 done of 3 (0 ok, 0 error)") in build(str(out)).summary
    info = export(str(out), "openai", str(tmp_path / "o.jsonl"), str(tmp_path / "e.jsonl"))
    assert (info["ok"], info["expired"], info["in_input_order"]) == (0, 3, True)
    assert _ids(tmp_path / "e.jsonl") == ["a", "b", "c"]


# -- B: status.json from an earlier attempt ---------------------------------------------------------------

def test_status_does_not_take_an_earlier_attempts_status_for_the_latest(tmp_path, cfg, write_parquet):
    rows = {"id": [f"r{i}" for i in range(4)], "prompt": ["say hi"] * 4}
    inp = write_parquet(rows)
    out = tmp_path / "out"
    run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)     # attempt 1: completed, exit 0
    write_parquet({"id": rows["id"] + ["r4", "r5"], "prompt": ["say hi"] * 6})    # two rows more
    _started_not_flushed(cfg(inp, out))                                          # attempt 2, killed at once
    s = job_status(str(out))
    assert (s["state"], s["exit_code"], s["rows_total"], s["rows_done"], s["rows_left"]) == ("stopped", None, 6, 4, 2)
    shard = s["per_shard"][0]
    assert (shard["state"], shard["exit_code"], shard["attempts"], shard["rows_left"]) == ("stopped", None, 2, 2)
    assert "rows: 4 done of 6, 2 left; - tok/s; ETA ?; exit code -" in status_lines(s)
    # inspect tells the state as status does: the manifest still says running
    from click.testing import CliRunner
    from overnight.jobs.cli import cli

    assert json.loads((out / "manifest.json").read_text())["state"] == "running"
    r = CliRunner().invoke(cli, ["inspect", str(out)], catch_exceptions=False)
    assert r.exit_code == 0 and "state: stopped  attempts: 2" in r.output, r.output


# -- C: duplicate ids are neither done nor left --------------------------------------------------------------

def test_duplicate_ids_are_not_left(tmp_path, cfg, write_parquet):
    inp = write_parquet({"id": ["a", "b", "a", "c"], "prompt": ["hi", "yo", "hi", "hey"]})
    out = tmp_path / "out"
    run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    s = job_status(str(out))
    assert (s["rows_done"], s["rows_total"], s["rows_left"]) == (3, 4, 0)
    assert json.loads((out / "manifest.json").read_text())["counts"]["num_duplicates"] == 1
    con, m = open_results(str(out))
    assert "rows: 3 (3 ok, 0 error)" in summary_lines(con, m)
    # a job that stopped: its rows left are the input's rows less those done and the duplicates
    out2 = tmp_path / "out2"
    with pytest.raises(Exception, match="engine died"):
        run_job(cfg(inp, out2, engine={"max_restarts": 0}), engine_factory=given(FakeEngine(fail_after_steps=1)),
                is_tty=False)
    s = job_status(str(out2))
    assert s["state"] == "failed" and s["rows_done"] < 3
    assert s["rows_left"] == s["per_shard"][0]["rows_left"] == 3 - s["rows_done"]
    con, m = open_results(str(out2))
    assert f"{3 - s['rows_done']} not done" in summary_lines(con, m)[2]


# -- D: n > 1: a row counts once in the report ---------------------------------------------------------------

def test_report_counts_rows_not_samples(tmp_path, cfg, write_parquet):
    from overnight.pipeline.tools.report import build

    inp = write_parquet({"id": [f"r{i}" for i in range(5)], "prompt": ["say hi"] * 5})
    out = tmp_path / "out"
    run_job(cfg(inp, out, sampling={"n": 4, "temperature": 0.8}, output={"price_per_hour": 3600.0}),
            engine_factory=given(FakeEngine()), is_tty=False)
    summary = dict(build(str(out)).summary)
    assert summary["rows"] == "5 done of 5 (5 ok, 0 error)"
    seconds = duckdb.sql(f"select sum(engine_seconds) from read_parquet('{out}/parts/part-*.parquet')").fetchall()[0][0]
    assert summary["cost"].endswith(f", {1000 * seconds / 5:.4f} per 1,000 rows")


# -- E: input order through the run's own source ------------------------------------------------------------

def test_derived_ids_are_the_runs_in_a_folder_with_subfolders(tmp_path, cfg):
    for sub, prompts in (("a", ["say hi", "tell me about weather", "what is it"]), ("b", ["say bye", "how many"])):
        (tmp_path / "in" / sub).mkdir(parents=True)
        pq.write_table(pa.table({"prompt": prompts}), tmp_path / "in" / sub / "x.parquet")
    out = tmp_path / "out"
    run_job(cfg(tmp_path / "in", out, input={"limit": 4}), engine_factory=given(FakeEngine()), is_tty=False)
    info = export(str(out), "openai", str(tmp_path / "o.jsonl"), str(tmp_path / "e.jsonl"))
    assert (info["ok"], info["expired"], info["in_input_order"]) == (4, 0, True)   # the 5th row is past --limit
    assert _ids(tmp_path / "o.jsonl") == ["a/x.parquet#0", "a/x.parquet#1", "a/x.parquet#2", "b/x.parquet#0"]


def test_a_remote_folder_input_is_read_in_order_with_rows_not_done_expired(tmp_path, cfg):
    fs = fsspec.filesystem("memory")
    for k in range(2):
        with fs.open(f"/export-in/f{k}.parquet", "wb") as f:
            pq.write_table(pa.table({"id": [f"r{k}{i}" for i in range(5)][::-1],
                                     "prompt": ["say hi " * (i + 1) for i in range(5)]}), f)
    out = tmp_path / "out"
    try:
        run_job(cfg("memory://export-in", out, input={"limit": 7}, output={"flush_rows": 3}),
                engine_factory=given(FakeEngine()), is_tty=False)
        order = ["r04", "r03", "r02", "r01", "r00", "r14", "r13"]
        parts = sorted((out / "parts").glob("part-*.parquet"))
        parts[-1].unlink()                                     # a job killed before its last part
        done = {r[0] for r in duckdb.sql(f"select id from read_parquet('{out}/parts/part-*.parquet')").fetchall()}
        info = export(str(out), "openai", str(tmp_path / "o.jsonl"), str(tmp_path / "e.jsonl"))
        assert info["in_input_order"] and info["ok"] == len(done)
        assert _ids(tmp_path / "o.jsonl") == [i for i in order if i in done]
        assert _ids(tmp_path / "e.jsonl") == [i for i in order if i not in done]
    finally:
        fs.rm("/export-in", recursive=True)


def test_a_relative_input_is_found_from_another_folder(tmp_path, cfg, monkeypatch):
    run_dir, elsewhere = tmp_path / "night", tmp_path / "elsewhere"
    run_dir.mkdir()
    elsewhere.mkdir()
    ids = [f"r{i}" for i in range(10)][::-1]
    pq.write_table(pa.table({"id": ids, "prompt": ["say hi"] * 10}), run_dir / "in.parquet")
    pq.write_table(pa.table({"id": ["x"], "prompt": ["other"]}), elsewhere / "in.parquet")  # not the run's input
    monkeypatch.chdir(run_dir)
    run_job(cfg("in.parquet", "out", input={"limit": 8}), engine_factory=given(FakeEngine()), is_tty=False)
    monkeypatch.chdir(elsewhere)
    info = export(str(run_dir / "out"), "openai", str(tmp_path / "o.jsonl"), str(tmp_path / "e.jsonl"))
    assert (info["ok"], info["expired"], info["in_input_order"]) == (8, 0, True)
    assert _ids(tmp_path / "o.jsonl") == ids[:8]
    run_dir.rename(tmp_path / "moved")                       # OUT and its input moved together
    info = export(str(tmp_path / "moved" / "out"), "openai", str(tmp_path / "o.jsonl"), str(tmp_path / "e.jsonl"))
    assert (info["ok"], info["expired"], info["in_input_order"]) == (8, 0, True)


def test_shards_with_a_limit_export_each_shards_rows(tmp_path, cfg):
    inp = tmp_path / "in"
    inp.mkdir()
    for k in range(4):
        pq.write_table(pa.table({"prompt": [f"say hi {i}" for i in range(5)]}), inp / f"f{k}.parquet")
    out = tmp_path / "out"
    for k in range(2):   # each shard: 2 files, its own --limit of 3 rows
        run_job(cfg(inp, out, input={"limit": 3}, cluster={"shard": f"{k}/2"}), engine_factory=given(FakeEngine()),
                is_tty=False)
    info = export(str(out), "openai", str(tmp_path / "o.jsonl"), str(tmp_path / "e.jsonl"))
    assert (info["ok"], info["expired"], info["in_input_order"]) == (6, 0, True)
    got = _ids(tmp_path / "o.jsonl")
    assert got == sorted(got, key=lambda i: (i.split("#")[0], int(i.split("#")[1])))
    con, m = open_results(str(out))   # inspect: the limit is each shard's ("6 rows within --limit 3" read as a fault)
    assert any("(6 rows within --limit 3 per shard)" in line for line in summary_lines(con, m)), summary_lines(con, m)


# -- F: /v1/completions lines answer as text_completion ------------------------------------------------------

def test_completions_lines_are_written_as_text_completions(tmp_path, cfg):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    lines = [{"custom_id": "c1", "method": "POST", "url": "/v1/completions",
              "body": {"model": "x", "prompt": "say hi", "max_tokens": 4, "logprobs": 2}},
             {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}},
             {"custom_id": "c2", "method": "POST", "url": "/v1/completions",
              "body": {"model": "x", "prompt": "tell me", "max_tokens": 3}}]
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    run_job(cfg(path, out), engine_factory=given(FakeEngine()), is_tty=False)

    def bodies() -> dict:
        info = export(str(out), "openai", str(tmp_path / "o.jsonl"))
        assert info["ok"] == 3
        got = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
        for x in got:
            assert x["error"] is None and x["response"]["status_code"] == 200 and x["response"]["request_id"]
        return {x["custom_id"]: x["response"]["body"] for x in got}

    for moved in (False, True):   # the input read again; moved, the rows' passthrough columns tell
        if moved:
            path.rename(tmp_path / "moved.jsonl")
        got = bodies()
        for cid in ("c1", "c2"):
            completion = Completion.model_validate(got[cid])
            assert completion.object == "text_completion" and got[cid]["id"].startswith("cmpl-")
            assert completion.choices[0].text and completion.usage.total_tokens > 0
        logprobs = Completion.model_validate(got["c1"]).choices[0].logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) > 0
        assert all(len(top) == 2 for top in logprobs.top_logprobs)
        assert ChatCompletion.model_validate(got["q1"]).object == "chat.completion"


# -- G: an OUT whose name holds glob characters ------------------------------------------------------------

def test_an_out_named_with_glob_characters_reads_its_own_parts(tmp_path, cfg, write_parquet):
    from overnight.pipeline.tools.report import build

    mine = write_parquet({"id": ["a", "b"], "prompt": ["hi", "yo"]}, "mine.parquet")
    other = write_parquet({"id": ["x", "y", "z"], "prompt": ["hi", "yo", "hey"]}, "other.parquet")
    run_job(cfg(other, tmp_path / "run 1"), engine_factory=given(FakeEngine()), is_tty=False)  # "[1]" matches it
    out = tmp_path / "run [1]"
    run_job(cfg(mine, out), engine_factory=given(FakeEngine()), is_tty=False)
    con, _ = open_results(str(out))
    assert sorted(r[0] for r in con.execute("select id from results").fetchall()) == ["a", "b"]
    assert ("rows", "2 done of 2 (2 ok, 0 error)") in build(str(out)).summary
    info = export(str(out), "parquet", str(tmp_path / "all.parquet"))
    assert info == {"rows": 2, "in_input_order": True, "output": str(tmp_path / "all.parquet")}
    assert os.path.exists(tmp_path / "all.parquet")


def test_a_damaged_part_is_named_not_a_traceback(tmp_path, cfg, write_parquet):
    """A part damaged on its storage: inspect and export say which, and the fix; deleted, a rerun answers its rows
    again."""
    inp = write_parquet({"id": ["a", "b", "c"], "prompt": ["hi", "yo", "hey"]})
    out = tmp_path / "out"
    run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    part = sorted((out / "parts").glob("part-*.parquet"))[0]
    part.write_bytes(part.read_bytes()[:100])
    with pytest.raises(OutputError, match=f"{part}: a result part cannot be read .* Delete the damaged part and "
                                          f"rerun the job"):
        open_results(str(out))
    # a rerun over the unchanged input does not take the job for done: the parts are not as it completed them
    with pytest.raises(OutputError, match=f"{part}.* cannot be read"):
        run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    part.unlink()
    s = run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    assert s.exit_code == 0 and open_results(str(out))[0].execute("select count(*) from results").fetchall() == [(3,)]


# -- I: a run killed between writing a part and updating its manifest ------------------------------------------

@pytest.mark.parametrize("n,kill_at", [(1, 3), (3, 3), (1, 1)])  # at 1: no status.json yet
def test_status_counts_the_part_a_killed_run_wrote_before_its_manifest(tmp_path, write_parquet, tiny_model, n,
                                                                        kill_at):
    import subprocess

    from conftest import overnight_cmd

    inp = write_parquet({"id": [f"q{i}" for i in range(30)], "prompt": [f"question {i}?" for i in range(30)]})
    out = tmp_path / "out"
    args = [*overnight_cmd(), "run", inp, "--out", str(out), "--model", tiny_model, "--engine", "echo",
            "--echo-step-ms", "2", "--max-num-seqs", "4", "--flush-rows", "5", "--max-tokens", "8", "--n", str(n)]
    r = subprocess.run(args, env={**os.environ, "OVERNIGHT_FAILPOINTS": f"part.after_write=kill@{kill_at}"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, r.stderr[-2000:]
    in_parts = duckdb.connect().execute(
        f"select count(distinct id) from read_parquet('{out}/parts/part-*.parquet')").fetchone()[0]
    assert json.loads((out / "manifest.json").read_text())["counts"]["num_done"] < in_parts
    s = job_status(str(out))
    assert (s["state"], s["rows_done"], s["rows_left"]) == ("stopped", in_parts, 30 - in_parts)
    assert s["per_shard"][0]["rows_done"] == in_parts


# -- J: a manifest edited by hand into another shape ------------------------------------------------------------

@pytest.mark.parametrize("edit,why", [
    (lambda m: m.update(counts=None), "its 'counts' is a NoneType, where a dict belongs"),
    (lambda m: m.pop("attempts"), "its 'attempts' is missing, where a list belongs"),
    (lambda m: m.update(input=None), "its 'input' is a NoneType, where a dict belongs"),
    (lambda m: m.update(attempts=[1]), "an entry of its 'attempts' is not an object"),
    (lambda m: m.clear(), "its 'fingerprint_fields' is missing"),
])
def test_a_manifest_of_another_shape_is_named_with_its_fix_not_a_traceback(tmp_path, cfg, write_parquet, edit, why):
    from click.testing import CliRunner

    from overnight.jobs.cli import cli

    inp = write_parquet({"id": ["a", "b"], "prompt": ["hi", "yo"]})
    out = tmp_path / "out"
    run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    m = json.loads((out / "manifest.json").read_text())
    edit(m)
    (out / "manifest.json").write_text(json.dumps(m))
    for args in (["status", str(out)], ["inspect", str(out)], ["run", inp, "--out", str(out), "--engine", "echo"]):
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 1 and f"manifest.json is not an overnight manifest ({why}" in r.output, (args, r.output)
        assert "Restore it, or rerun with --fresh" in r.output
    (out / "manifest.json").write_text("[]")
    with pytest.raises(OutputError, match=r"not an overnight manifest \(a JSON list, not an object\)"):
        job_status(str(out))


# -- K: a sharded job with a shard not started yet ------------------------------------------------------------

def test_inspect_counts_the_started_shards_rows_not_done_beside_a_shard_not_started(tmp_path, cfg, write_parquet):
    inp = write_parquet({"id": [f"r{i}" for i in range(40)], "prompt": [f"q {i}" for i in range(40)]})
    out = tmp_path / "out"
    with pytest.raises(Exception, match="engine died"):
        run_job(cfg(inp, out, cluster={"shard": "0/2"}, engine={"max_restarts": 0}),
                engine_factory=given(FakeEngine(fail_after_steps=8)), is_tty=False)
    con, m = open_results(str(out))
    done = con.execute("select count(*) from results").fetchone()[0]
    assert 0 < done < 20
    assert f"rows: {done} ({done} ok, 0 error, {20 - done} not done, and the rows of 1 shard not started)" \
        in summary_lines(con, m)


def test_a_folder_where_the_manifest_or_status_belongs_is_named(tmp_path, cfg, write_parquet):
    from click.testing import CliRunner

    from overnight.jobs.cli import cli

    inp = write_parquet({"id": ["a"], "prompt": ["hi"]})
    for name in ("manifest.json", "status.json"):
        out = tmp_path / name.split(".")[0]
        (out / name).mkdir(parents=True)
        for args in (["status", str(out)], ["run", inp, "--out", str(out), "--engine", "echo"]):
            r = CliRunner().invoke(cli, args)
            assert r.exit_code == 1 and f"{out / name} is a folder, where overnight keeps a file of that name" \
                in r.output, (args, r.output)
    (tmp_path / "bytes").mkdir()
    (tmp_path / "bytes" / "manifest.json").write_bytes(b"\xff\xfe")
    with pytest.raises(OutputError, match="manifest.json is not valid JSON"):
        job_status(str(tmp_path / "bytes"))


def test_status_of_an_out_a_run_holds_before_it_wrote_anything_is_starting(tmp_path):
    """A Ray driver reads the input's ids and places its workers before any status is written (seconds, or
    minutes at 10M rows): `overnight status` said there was no job there (exit 1, "missing")."""
    from overnight.pipeline.output.checkpoint import OutputDir
    from overnight.pipeline.output.lock import RunLock
    from overnight.pipeline.tools.status import job_status, status_lines

    lock = RunLock(OutputDir(str(tmp_path / "out")), split="ray")
    lock.acquire()
    try:
        s = job_status(str(tmp_path / "out"))
        assert (s["state"], s["rows_done"], s["exit_code"]) == ("starting", 0, None)
        assert status_lines(s)[0].endswith(": starting")
    finally:
        lock.release()
    with pytest.raises(OutputError, match="holds no overnight job"):
        job_status(str(tmp_path / "out"))


def test_status_of_a_ray_job_rerun_with_fewer_workers_marks_the_folders_it_does_not_run(tmp_path, cfg,
                                                                                         write_parquet):
    """A rerun with 1 worker where 2 ran before: w1's folder of the earlier attempt (killed while running) showed
    "running" under the new driver's lock. Its rows count; its state is not this attempt's."""
    from overnight.pipeline.output.checkpoint import OutputDir
    from overnight.pipeline.output.layout import worker_out
    from overnight.pipeline.output.lock import RunLock

    out = tmp_path / "out"
    inp = write_parquet({"id": ["a", "b"], "prompt": ["hi", "yo"]})
    run_job(cfg(inp, worker_out(str(out), 0).root), engine_factory=given(FakeEngine()), is_tty=False)
    _started_not_flushed(cfg(inp, worker_out(str(out), 1).root))
    (out / "status.json").write_text(json.dumps({"state": "running", "exit_code": None, "workers": 1,
                                                 "rows": {"total": 2, "done": 2, "remaining": 0}}))
    lock = RunLock(OutputDir(str(out)), split="ray")
    lock.acquire()
    try:
        s = job_status(str(out))
    finally:
        lock.release()
    by = {w["shard"]: w for w in s["per_shard"]}
    assert by["w0"]["state"] == "completed" and by["w0"]["rows_done"] == 2
    assert (by["w1"]["state"], by["w1"]["exit_code"], by["w1"]["eta_s"]) == ("not in this run", None, None)
    assert any(line.startswith("w1  ") and "not in this run" in line for line in status_lines(s))
