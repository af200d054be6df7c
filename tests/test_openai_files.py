"""OpenAI Batch input's files, through the echo engine: request files stream in chunks, fsspec URLs, folders,
globs and .jsonl.gz, input errors, resume, shards, plan and Ray workers. The lines themselves:
test_openai_input.py."""

from __future__ import annotations

import json

import duckdb
import fsspec
import pytest
import pyarrow as pa
import pyarrow.parquet as pq

from fakes import FakeEngine, given
from openai_lines import chat, completion, rows_of, write_lines
from overnight.pipeline.api import run_job
from overnight.pipeline.config import InputConfig
from overnight.pipeline.input import openai_batch
from overnight.pipeline.input.openai_batch import OpenAIBatchSource
from overnight.pipeline.input.shards import FRAGMENTS, ROWS, Fragment, Shard
from overnight.pipeline.input.source import InputError, open_source
from overnight.pipeline.tools.inspection import open_results


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
    # a glob whose matches are JSONL files is JSONL, though it ends otherwise (both kinds: .jsonl and .jsonl.gz)
    write_lines(tmp_path / "d" / "e.jsonl.gz", [chat("g3")])
    for glob in (f"{tmp_path}/d/*.jsonl*", f"{tmp_path}/d/*"):
        assert [r["id"] for r in rows_of(open_source(InputConfig(path=glob)))] == ["l1", "g3"], glob
    (tmp_path / "d" / "notes.txt").write_text("not a request\n")   # a glob reads all it matches: refused, named
    with pytest.raises(InputError, match=r"matches JSONL files and .*notes.txt, which is not one .* Narrow the glob"):
        open_source(InputConfig(path=f"{tmp_path}/d/*"))
    (tmp_path / "d" / "notes.txt").unlink()
    pq.write_table(pa.table({"id": ["p"], "prompt": ["x"]}), tmp_path / "d" / "f.parquet")
    with pytest.raises(InputError, match=f"The glob {tmp_path}/d/\\* matches both Parquet and JSONL files. Point "
                                         f"INPUT at one kind, with a glob such as {tmp_path}/d/\\*.jsonl"):
        open_source(InputConfig(path=f"{tmp_path}/d/*"))


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


@pytest.mark.parametrize("gz,rule,how", [(False, ROWS, "rows 0 to 4"), (True, ROWS, "rows 0 to 4"),
                                         (False, FRAGMENTS, "split by 3 row groups in 1 files"),
                                         (True, FRAGMENTS, "split by a hash")])
def test_shards_split_the_lines_and_answer_each_once(tmp_path, cfg, monkeypatch, gz, rule, how):
    """Equal ranges of lines (a .gz file, one chunk read from its start, too); and the rule of OUTs begun before
    stop 42, which they keep."""
    import overnight.pipeline.job as job

    monkeypatch.setattr(openai_batch, "CHUNK_LINES", 4)
    monkeypatch.setattr(job, "recorded_split", lambda url, shard, fresh: rule)
    path = write_lines(tmp_path / ("requests.jsonl.gz" if gz else "requests.jsonl"),
                       [chat(f"r{i}") for i in range(10)] + ["bad"])
    out = tmp_path / "out"
    counts = []
    for k in range(2):
        c = cfg(path, out, cluster={"shard": f"{k}/2"})
        s = run_job(c, engine_factory=given(FakeEngine()), is_tty=False)
        counts.append(s.num_rows)
    assert how in open_source(c.input, Shard(0, 2), rule).selection.how
    parts = f"{out}/shards/*/parts/part-*.parquet"
    ids = [r[0] for r in duckdb.sql(f"select coalesce(id, error) from read_parquet('{parts}')").fetchall()]
    assert sum(counts) == 11 and len(ids) == len(set(ids)) == 11 and min(counts) > 0
    if rule == ROWS:
        assert counts == [5, 6]


def test_plan_reads_request_lines(tmp_path, cfg):
    from overnight.pipeline.scheduling.plan import make_plan

    path = write_lines(tmp_path / "requests.jsonl", [chat("a"), completion("b"), "bad"])
    p = make_plan(cfg(path, tmp_path / "out"), throughput=100)
    assert (p.num_rows, p.num_errors) == (3, 1)


@pytest.mark.slow
@pytest.mark.serial  # a Ray cluster: after the others, alone (tests/conftest.py)
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
    got = duckdb.sql(f"select id, error from read_parquet('{out}/workers/*/parts/part-*.parquet')").fetchall()
    ids = [i for i, _ in got if i is not None]
    assert len(got) == 301 and sorted(ids) == sorted(f"r{i}" for i in range(300))
    assert [e for i, e in got if i is None][0].startswith("requests.jsonl#301: line 301 is not valid JSON")
