import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fakes import FakeClock
from overnight.pipeline.output import manifest as mf
from overnight.pipeline.output.checkpoint import OutputDir, OutputError
from overnight.pipeline.output.writer import CheckpointWriter
from overnight.pipeline.output.schema import OutputSchema
from overnight.pipeline.config import JobConfig
from overnight.pipeline.records import Result


def ok(i, **kw):
    return Result(id=f"r{i}", passthrough={"prompt": f"p{i}", "text": "input text"}, status="ok", text=f"t{i}",
                  finish_reason="stop", prompt_tokens=3, output_tokens=i, queued_at=1.0, first_token_at=1.5,
                  finished_at=2.0, **kw)


def schema():
    return OutputSchema("id", pa.string(), [pa.field("prompt", pa.string()), pa.field("text", pa.string())])


def test_schema_renames_clashing_passthrough_columns():
    s = schema()
    assert s.renames == {"prompt": "prompt", "text": "input_text"}
    t = s.table([ok(1), Result.failed("r2", {"prompt": None, "text": None}, "bad")], "run-1", "m")
    assert t.column_names[:4] == ["id", "prompt", "input_text", "text"]
    rows = t.to_pylist()
    assert rows[0]["input_text"] == "input text" and rows[0]["text"] == "t1" and rows[0]["run_id"] == "run-1"
    assert rows[1]["status"] == "error" and rows[1]["error"] == "bad" and rows[1]["text"] is None
    assert t.schema.field("queued_at").type == pa.timestamp("ms")


def test_writer_flushes_every_n_rows_and_every_t_seconds(tmp_path):
    clock = FakeClock()
    out = OutputDir(str(tmp_path / "out"))
    flushed = []
    w = CheckpointWriter(out, schema(), "run-1", "m", 0, flush_rows=3, flush_seconds=10, clock=clock,
                         on_flush=lambda rs, p: flushed.append((len(rs), os.path.basename(p))))
    w.add([ok(1), ok(2)])
    assert flushed == []
    w.add([ok(3)])
    assert flushed == [(3, "part-00000.parquet")]
    w.add([ok(4)])
    clock.t += 5
    w.maybe_flush()
    assert len(flushed) == 1
    clock.t += 5.5  # 10.5 s since the last flush
    w.maybe_flush()
    assert flushed[-1] == (1, "part-00001.parquet")
    w.add([ok(5)])
    w.flush()
    assert [p.rsplit("/", 1)[-1] for p in out.part_paths()] == ["part-00000.parquet", "part-00001.parquet",
                                                                 "part-00002.parquet"]
    scan = out.scan("id")
    assert scan.num_ids == 5 and all(scan.contains(["r1", "r2", "r3", "r4", "r5"]))
    assert (scan.num_ok, scan.num_error, scan.num_parts, scan.next_index) == (5, 0, 3, 3)
    assert scan.num_output_tokens == 15


def test_part_writes_leave_no_temporary_files(tmp_path):
    out = OutputDir(str(tmp_path / "out"))
    out.write_part(0, schema().table([ok(1)], "r", "m"))
    assert os.listdir(tmp_path / "out" / "parts") == ["part-00000.parquet"]
    assert pq.read_table(tmp_path / "out" / "parts" / "part-00000.parquet").num_rows == 1


def test_stray_files_in_parts_do_not_count(tmp_path):
    out = OutputDir(str(tmp_path / "out"))
    out.write_part(0, schema().table([ok(1)], "r", "m"))
    (tmp_path / "out" / "parts" / ".tmp-abc-part-00001.parquet").write_bytes(b"PAR1 half written")
    (tmp_path / "out" / "parts" / "notes.txt").write_text("hi")
    scan = out.scan("id")
    assert scan.num_ids == 1 and scan.contains(["r1"]) == [True]


def test_unreadable_part_is_named(tmp_path):
    out = OutputDir(str(tmp_path / "out"))
    os.makedirs(tmp_path / "out" / "parts")
    (tmp_path / "out" / "parts" / "part-00000.parquet").write_bytes(b"garbage")
    with pytest.raises(OutputError, match="part-00000.parquet cannot be read .* Delete it and rerun"):
        out.scan("id")


def test_out_that_is_a_file(tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(OutputError, match=f"Output {f} is a file. --out needs a folder"):
        OutputDir(str(f))


def test_memory_output(tmp_path):
    out = OutputDir("memory://ckpt/out")
    out.write_part(0, schema().table([ok(1), ok(2)], "r", "m"))
    manifest = {"hello": 1, "fingerprint_fields": {}, "input": {}, "counts": {}, "attempts": []}
    out.write_manifest(manifest)
    scan = out.scan("id")
    assert scan.num_ids == 2 and scan.contains(["r1", "r2", "r3"]) == [True, True, False]
    assert out.read_manifest() == manifest
    out.clear()
    assert out.part_paths() == [] and out.read_manifest() is None


def test_fingerprint_covers_outputs_not_engine_tuning():
    a = JobConfig()
    b = JobConfig()
    b.engine.max_num_seqs = 7
    fa = mf.fingerprint(mf.fingerprint_fields(a, "m", True))
    assert fa == mf.fingerprint(mf.fingerprint_fields(b, "m", True))
    b.sampling.temperature = 0.3
    assert fa != mf.fingerprint(mf.fingerprint_fields(b, "m", True))
    assert fa != mf.fingerprint(mf.fingerprint_fields(a, "m", False))
    assert fa != mf.fingerprint(mf.fingerprint_fields(a, "other", True))


def test_resume_check_names_the_differences():
    a = JobConfig()
    fields = mf.fingerprint_fields(a, "m", True)
    previous = mf.new_manifest(a.to_dict(), fields, {})
    mf.check_resume(previous, fields, "out/")
    a.sampling.temperature = 0.3
    with pytest.raises(OutputError) as e:
        mf.check_resume(previous, mf.fingerprint_fields(a, "m", True), "out/")
    assert str(e.value).startswith("out/ holds results of a run with different settings "
                                   "(sampling.temperature: 1.0 -> 0.3). Resuming would mix outputs.")
    assert "pass --fresh to discard those results" in str(e.value)


def test_manifest_attempts(tmp_path):
    m = mf.new_manifest({}, {}, {})
    mf.start_attempt(m, {}, {})
    mf.end_attempt(m, mf.RunState.COMPLETED)
    mf.start_attempt(m, {}, {})
    assert [a["attempt"] for a in m["attempts"]] == [1, 2]
    assert m["attempts"][0]["state"] == "completed" and m["state"] == "running"
    json.dumps(m)


def models_of(out) -> list:
    import duckdb

    query = f"select model from read_parquet('{out}/parts/part-*.parquet') order by id"
    return [m for m, in duckdb.sql(query).fetchall()]


def test_a_model_folder_is_one_setting_however_its_path_is_spelled(write_parquet, tmp_path, cfg, tiny_model,
                                                                     monkeypatch):
    import shutil

    from overnight.pipeline.api import run_job

    shutil.copytree(tiny_model, tmp_path / "a" / "m")
    shutil.copytree(tiny_model, tmp_path / "b" / "m")
    inp, out = write_parquet({"id": [f"r{i}" for i in range(6)], "prompt": [f"q{i}" for i in range(6)]}), tmp_path / "o"
    echo = {"kind": "echo", "model": "m"}
    monkeypatch.chdir(tmp_path / "a")
    assert run_job(cfg(inp, out, engine=echo, input={"limit": 3}), is_tty=False).exit_code == 0
    # the same folder by its absolute path: the same settings, so the run resumes, and its rows name it alike
    s = run_job(cfg(inp, out, engine={**echo, "model": str(tmp_path / "a" / "m")}), is_tty=False)
    assert (s.exit_code, s.num_resumed, s.num_ok) == (0, 3, 6)
    assert models_of(out) == [str(tmp_path / "a" / "m")] * 6
    # the same words from another folder: another model
    monkeypatch.chdir(tmp_path / "b")
    with pytest.raises(OutputError, match=f"different settings .*model: '{tmp_path}/a/m' -> '{tmp_path}/b/m'"):
        run_job(cfg(inp, out, engine=echo), is_tty=False)


def test_an_out_that_fingerprinted_the_model_as_typed_resumes_and_its_rows_keep_that_name(write_parquet, tmp_path,
                                                                                          cfg, tiny_model, monkeypatch):
    import shutil

    from overnight.pipeline.api import run_job

    shutil.copytree(tiny_model, tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    inp, out = write_parquet({"id": [f"r{i}" for i in range(6)], "prompt": [f"q{i}" for i in range(6)]}), tmp_path / "o"
    job = cfg(inp, out, engine={"kind": "echo", "model": "m"}, input={"limit": 3})
    assert run_job(job, is_tty=False).exit_code == 0
    # as before stop 47: the manifest's settings name the folder as typed
    o = OutputDir(str(out))
    manifest = o.read_manifest()
    assert manifest["fingerprint_fields"]["model"] == str(tmp_path / "m")
    old = {**manifest["fingerprint_fields"], "model": "m"}
    del manifest["model_keyed"]
    o.write_manifest({**manifest, "fingerprint": mf.fingerprint(old), "fingerprint_fields": old})
    s = run_job(cfg(inp, out, engine={"kind": "echo", "model": str(tmp_path / "m")}), is_tty=False)
    assert (s.exit_code, s.num_resumed, s.num_ok) == (0, 3, 6)
    assert o.read_manifest()["fingerprint_fields"]["model"] == "m"
    assert models_of(out)[3:] == ["m"] * 3


def _an_out_from_before(tmp_path, cfg, inp, out) -> None:
    """An OUT begun in the current folder with --model m, as written before stop 47: the model as typed, and no
    began_in (its input.cwd is the folder its last attempt ran in)."""
    from overnight.pipeline.api import run_job

    s = run_job(cfg(inp, out, engine={"kind": "echo", "model": "m"}, input={"limit": 3}), is_tty=False)
    assert s.exit_code == 0
    o = OutputDir(str(out))
    m = o.read_manifest()
    old = {**m["fingerprint_fields"], "model": "m"}
    del m["began_in"], m["model_keyed"]
    o.write_manifest({**m, "fingerprint": mf.fingerprint(old), "fingerprint_fields": old})


def test_an_out_from_before_keeps_the_folder_it_began_in_whatever_folder_resumes_it(write_parquet, tmp_path, cfg,
                                                                                   tiny_model, monkeypatch):
    import shutil

    from overnight.pipeline.api import run_job

    shutil.copytree(tiny_model, tmp_path / "a" / "m")
    shutil.copytree(tiny_model, tmp_path / "b" / "m")
    inp, out = write_parquet({"id": [f"r{i}" for i in range(9)], "prompt": [f"q{i}" for i in range(9)]}), tmp_path / "o"
    monkeypatch.chdir(tmp_path / "a")
    _an_out_from_before(tmp_path, cfg, inp, out)
    monkeypatch.chdir(tmp_path / "b")   # its model by its absolute path, from another folder: twice
    a = str(tmp_path / "a" / "m")
    s = run_job(cfg(inp, out, engine={"kind": "echo", "model": a}, input={"limit": 6}), is_tty=False)
    assert s.num_resumed == 3
    assert OutputDir(str(out)).read_manifest()["began_in"] == str(tmp_path / "a")
    # b/m, typed as the OUT typed its own: another model, though this attempt's folder is b
    with pytest.raises(OutputError, match=f"model: '{tmp_path}/a/m' -> '{tmp_path}/b/m'"):
        run_job(cfg(inp, out, engine={"kind": "echo", "model": "m"}), is_tty=False)
    s = run_job(cfg(inp, out, engine={"kind": "echo", "model": a}), is_tty=False)
    assert (s.exit_code, s.num_resumed, s.num_ok) == (0, 6, 9)


def test_an_out_from_before_moved_with_its_model_resumes_with_the_same_command(write_parquet, tmp_path, cfg,
                                                                                tiny_model, monkeypatch):
    import shutil

    from overnight.pipeline.api import run_job

    shutil.copytree(tiny_model, tmp_path / "p" / "m")
    inp = write_parquet({"id": [f"r{i}" for i in range(9)], "prompt": [f"q{i}" for i in range(9)]})
    monkeypatch.chdir(tmp_path / "p")
    _an_out_from_before(tmp_path, cfg, inp, "o")
    (tmp_path / "p").rename(tmp_path / "q")   # the project folder renamed, OUT and the model in it
    monkeypatch.chdir(tmp_path / "q")
    s = run_job(cfg(inp, "o", engine={"kind": "echo", "model": "m"}), is_tty=False)
    assert (s.exit_code, s.num_resumed) == (0, 3)


def test_a_new_out_of_a_hub_model_never_takes_a_folder_of_that_name(tmp_path, tiny_model, monkeypatch):
    """The fallback for an OUT begun before stop 47 (a typed name whose folder is gone is read from the folder that
    resumes it) is not for an OUT begun since, which holds the key itself: a hub id stays a hub id."""
    import shutil

    (tmp_path / "b").mkdir()
    shutil.copytree(tiny_model, tmp_path / "c" / "org" / "name")
    monkeypatch.chdir(tmp_path / "b")
    job = JobConfig()
    fields = mf.fingerprint_fields(job, "org/name", True)
    previous = mf.new_manifest({}, fields, {"cwd": str(tmp_path / "b")})
    assert fields["model"] == "org/name" and mf.same_settings(previous, mf.fingerprint_fields(job, "org/name", True))
    monkeypatch.chdir(tmp_path / "c")   # where org/name is a local folder: another model
    assert not mf.same_settings(previous, mf.fingerprint_fields(job, "org/name", True))
    del previous["model_keyed"]         # as an OUT begun before: read from this folder, as the typed name was
    assert mf.same_settings(previous, mf.fingerprint_fields(job, "org/name", True))


def test_a_folder_reached_through_a_symlink_is_one_model(tmp_path, tiny_model, monkeypatch):
    import shutil

    from overnight.pipeline.tools.models import model_key

    shutil.copytree(tiny_model, tmp_path / "real" / "m")
    (tmp_path / "home").symlink_to(tmp_path / "real")   # a home reached through a link, as on many clusters
    monkeypatch.chdir(tmp_path / "home")                  # (the process's folder is the link's target)
    assert model_key("./m") == model_key(str(tmp_path / "home" / "m")) == str(tmp_path / "real" / "m")
