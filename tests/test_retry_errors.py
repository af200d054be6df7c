"""--retry-errors: a resume answers again the rows that ended as errors, and each id stays one row in OUT."""

from __future__ import annotations

import dataclasses
import json

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fakes import FakeEngine, given
from overnight.pipeline.api import run_job
from overnight.pipeline.output.checkpoint import OutputDir


class FlakyEngine(FakeEngine):
    """Ends every third request it finishes with vLLM's finish_reason "error" (an internal error)."""

    def _step_end(self):
        out = super()._step_end()
        self.count = getattr(self, "count", 0)
        flaky = []
        for f in out:
            self.count += 1
            flaky.append(dataclasses.replace(f, finish_reason="error") if self.count % 3 == 0 else f)
        return flaky


def rows_of(out) -> list[tuple]:
    return duckdb.sql(f"select id, status from read_parquet('{out}/parts/part-*.parquet') order by id").fetchall()


def test_a_resume_with_retry_errors_answers_the_error_rows_again(tmp_path, cfg, write_parquet):
    out = tmp_path / "out"
    prompts = ["word " * (i % 7 + 1) for i in range(30)]
    prompts[4] = None                                                   # an input error: it comes back as one
    inp = write_parquet({"id": list(range(30)), "prompt": prompts})
    c = cfg(inp, out, output={"flush_rows": 4})
    first = run_job(c, engine_factory=given(FlakyEngine()), is_tty=False)
    assert first.num_error > 1 and first.num_ok + first.num_error == 30
    failed = {i for i, st in rows_of(out) if st == "error"}
    engine = FakeEngine()
    run_job(c, engine_factory=given(engine), is_tty=False)             # without the flag: nothing to do
    assert engine.num_steps == 0 and {i for i, st in rows_of(out) if st == "error"} == failed

    parts_before = len(OutputDir(str(out)).part_paths())
    retried = run_job(c, engine_factory=given(FakeEngine()), is_tty=False, retry_errors=True)
    assert (retried.num_ok, retried.num_error, retried.num_resumed) == (29, 1, 30 - len(failed))
    rows = rows_of(out)
    assert [i for i, _ in rows] == list(range(30))                      # each id once
    assert [i for i, st in rows if st == "error"] == [4]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["num_ok"] == 29 and manifest["counts"]["num_error"] == 1
    assert len(OutputDir(str(out)).part_paths()) >= parts_before - len(failed)
    status = json.loads((out / "status.json").read_text())["rows"]
    assert (status["done"], status["remaining"]) == (30, 0)


def test_retry_errors_rewrites_a_part_whole_and_removes_one_of_errors_only(tmp_path):
    from overnight.pipeline.output.checkpoint import PARTS

    out = OutputDir(str(tmp_path / "out"))
    (tmp_path / "out" / PARTS).mkdir(parents=True)
    mixed = pa.table({"id": [1, 2, 3], "status": ["ok", "error", "ok"], "output_tokens": [3, 0, 4]},
                     metadata={b"overnight": b"kept"})
    pq.write_table(mixed, out.path(PARTS, "part-00000.parquet"))
    pq.write_table(pa.table({"id": [4], "status": ["error"], "output_tokens": [0]}), out.path(PARTS, "part-00001.parquet"))
    pq.write_table(pa.table({"id": [5], "status": ["ok"], "output_tokens": [2]}), out.path(PARTS, "part-00002.parquet"))
    out.write_manifest({"counts": {"num_done": 5, "num_ok": 3, "num_error": 2, "num_parts": 3},
                        "fingerprint_fields": {}, "input": {}, "attempts": []})
    assert out.drop_errors("id") == (2, 2)
    assert [p.rsplit("/", 1)[-1] for p in out.part_paths()] == ["part-00000.parquet", "part-00002.parquet"]
    kept = pq.read_table(out.path(PARTS, "part-00000.parquet"))
    assert kept.column("id").to_pylist() == [1, 3] and kept.schema.metadata[b"overnight"] == b"kept"
    assert out.read_manifest()["counts"] == {"num_done": 3, "num_ok": 3, "num_error": 0, "num_parts": 2}
    assert out.drop_errors("id") == (0, 0)                              # nothing left to retry



@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [1, 2, 3])
def test_a_retry_killed_at_any_write_loses_no_row(tmp_path, tiny_model, kill_at):
    # the manifest's writes of a --retry-errors run: "not completed" before any part changes, the counts after,
    # and the run's own. Killed at any, the rerun finds every row (the dropped ones were lost: the manifest still
    # said completed over an unchanged input, and the rerun skipped the scan)
    import os
    import subprocess

    from conftest import overnight_cmd

    inp = tmp_path / "in.parquet"
    prompts = ["word " * (i % 5 + 1) for i in range(20)]
    prompts[3] = prompts[9] = None                                       # two error rows
    pq.write_table(pa.table({"id": list(range(20)), "prompt": prompts}), inp)
    out = tmp_path / "out"
    cmd = [*overnight_cmd(), "run", str(inp), "--out", str(out), "--engine", "echo", "--model", tiny_model,
           "--flush-rows", "4"]
    assert subprocess.run(cmd, capture_output=True).returncode == 0
    env = dict(os.environ, OVERNIGHT_FAILPOINTS=f"manifest.before_write=kill@{kill_at}")
    assert subprocess.run([*cmd, "--retry-errors"], capture_output=True, env=env).returncode == -9
    assert subprocess.run(cmd, capture_output=True).returncode == 0
    assert [i for i, _ in rows_of(out)] == list(range(20))
