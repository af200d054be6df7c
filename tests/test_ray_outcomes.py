"""How a Ray job ends at its edges (found by a review, stop 44): an empty input, a deadline before any worker
starts, workers that fail with rows saved, and rows whose ids left the input since the last run. Whole jobs on a
local cluster, as tests/test_ray.py."""

from __future__ import annotations

import json
import signal
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from test_ray import ids_in, local_ray, write_input  # noqa: F401 (local_ray: the module's cluster)

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # after the others, alone: see conftest.py

ray = pytest.importorskip("ray")

from overnight.pipeline.cluster.ray_job import run_on_ray  # noqa: E402
from overnight.pipeline.tools.status import job_status  # noqa: E402


def test_an_empty_input_on_ray_has_nothing_to_do(tmp_path, cfg, local_ray):
    """As on one engine: exit 0, "nothing to do", no worker started; `overnight status` reads the driver's status
    with no worker folder (it raised a TypeError)."""
    from overnight.pipeline.tools.status import status_lines

    inp = tmp_path / "in"
    inp.mkdir()
    pq.write_table(pa.table({"id": pa.array([], pa.string()), "prompt": pa.array([], pa.string())}),
                   inp / "empty.parquet")
    out = tmp_path / "out"
    metrics = tmp_path / "job.prom"
    s = run_on_ray(cfg(inp, out, engine={"kind": "echo"}, output={"metrics_file": str(metrics)}), False, 2,
                   is_tty=False)
    assert (s.state, s.exit_code, s.num_rows) == ("completed", 0, 0)
    assert s.message == f"nothing to do: {inp} has no rows"
    assert 'state="completed"} 1.0' in metrics.read_text()   # its --metrics-file says so (none was written)
    st = job_status(str(out))
    assert (st["state"], st["exit_code"], st["rows_done"], st["rows_left"]) == ("completed", 0, 0, 0)
    assert status_lines(st)[1].startswith("rows: 0 done of 0, 0 left")
    # inspect and export read it as a job on Ray workers of no rows, as one engine's (they refused it)
    from overnight.pipeline.tools.export import export
    from overnight.pipeline.tools.inspection import open_results, summary_lines

    con, m = open_results(str(out))
    assert con.execute("select count(*) from results").fetchone() == (0,) and m["state"] == "completed"
    assert summary_lines(con, m)[0].startswith("job in 1 Ray worker folders  state: completed")
    assert export(str(out), "openai", str(tmp_path / "o.jsonl"))["rows"] == 0


def test_a_deadline_that_passes_before_any_worker_starts_exits_75(tmp_path, cfg, local_ray, monkeypatch):
    """Workers the cluster cannot place (they ask for a resource no node has) when the deadline passes: the job
    stopped early and is resumable (exit 75), as on one engine; before, it said FAILED with exit 1."""
    import overnight.pipeline.cluster.ray_job as ray_job
    from overnight.pipeline.cluster.actors import NAMESPACE, Worker

    def unplaceable(self, i):
        cls = ray.remote(Worker).options(num_cpus=1, resources={"no-such-node": 1}, name=f"{self.prefix}-w{i:05d}",
                                         namespace=NAMESPACE)
        return cls.remote(self.cfg, i, self.num_workers, self.coordinator_name, self.files)

    monkeypatch.setattr(ray_job.Driver, "_actor", unplaceable)
    inp = write_input(tmp_path / "in", 1, 100, 50)
    out = tmp_path / "out"
    s = run_on_ray(cfg(inp, out, engine={"kind": "echo"}, scheduler={"time_budget": "3s"}), False, 2, is_tty=False)
    assert (s.state, s.exit_code) == ("partial", 75), s.message
    assert s.message == "deadline reached before any worker started: 100 rows not done; rerun the same command to " \
                        "continue"
    st = json.loads((out / "status.json").read_text())
    assert (st["state"], st["exit_code"], st["rows"]["remaining"]) == ("partial", 75, 100)


def test_a_failed_workers_rows_count_in_the_summary(tmp_path, cfg, local_ray):
    """An input file removed mid-run fails both workers (exit 1); the rows they saved count in the summary's ok
    and tokens, as the folders hold them (it said 0 ok)."""
    inp = write_input(tmp_path / "in", 4, 300, 50)
    out = tmp_path / "out"
    c = cfg(inp, out, engine={"kind": "echo", "echo_step_ms": 30, "max_num_seqs": 8}, sampling={"max_tokens": 4})
    moved = threading.Event()

    def remove_a_file():
        deadline = time.time() + 120
        while time.time() < deadline and len(ids_in(out)) < 40:
            time.sleep(0.2)
        (inp / "part-3.parquet").rename(tmp_path / "part-3.parquet")
        moved.set()

    t = threading.Thread(target=remove_a_file, daemon=True)
    t.start()
    s = run_on_ray(c, False, 2, is_tty=False)
    t.join()
    assert moved.is_set() and (s.state, s.exit_code) == ("failed", 1), s.message
    ids = ids_in(out)
    assert 0 < len(ids) < 1200 and len(ids) == len(set(ids))
    assert (s.num_ok, s.num_done, s.num_output_tokens) == (len(ids), len(ids), 4 * len(ids))


def test_rows_no_longer_in_the_input_do_not_count_as_done_on_a_resume(tmp_path, cfg, local_ray, monkeypatch,
                                                                       caplog):
    """A worker reads only its units: none sees an id leave the input. The driver counts the folders' rows whose
    ids are the input's at the start; before, a rerun after a file was replaced said 600/600 done, 0 left."""
    import os

    import overnight.pipeline.input.source as source
    from overnight.pipeline.api import run_job

    inp = tmp_path / "in"
    inp.mkdir()
    for name in "AB":
        rows = {"id": [f"{name}{i}" for i in range(300)], "prompt": [f"q {name} {i}" for i in range(300)]}
        pq.write_table(pa.table(rows), inp / f"{name}.parquet", row_group_size=50)
    out = tmp_path / "out"
    engine = {"kind": "echo", "max_num_seqs": 16}
    assert run_on_ray(cfg(inp, out, engine=engine, sampling={"max_tokens": 4}), False, 2, is_tty=False).num_done == 600
    (inp / "B.parquet").unlink()
    pq.write_table(pa.table({"id": [f"C{i}" for i in range(300)], "prompt": [f"q C {i}" for i in range(300)]}),
                   inp / "C.parquet", row_group_size=50)
    opened = source.open_source

    def open_and_signal(*a, **k):   # stopped as it opens: the rows done are those at its start
        os.kill(os.getpid(), signal.SIGTERM)
        return opened(*a, **k)

    monkeypatch.setattr(source, "open_source", open_and_signal)
    with caplog.at_level("WARNING", logger="overnight"):
        s = run_job(cfg(inp, out, engine=engine, sampling={"max_tokens": 4}, cluster={"workers": 2}), is_tty=False)
    assert (s.exit_code, s.num_rows, s.num_done, s.num_removed) == (75, 600, 300, 300), s.line()
    assert s.message.endswith("300 rows not done; rerun the same command to continue")
    assert "300 rows in " in caplog.text and "are no longer in the input (e.g. ids 'B" in caplog.text
    assert json.loads((out / "status.json").read_text())["rows"]["remaining"] == 300
    # inspect says so too (the workers do not count it; the driver does), with the rows not done
    from overnight.pipeline.tools.inspection import open_results, summary_lines
    con, m = open_results(str(out))
    lines = summary_lines(con, m, None, job_status(str(out))["state"])   # as `overnight inspect` calls it
    assert "rows: 600 (600 ok, 0 error, 300 not done; 300 no longer in the input, not counted as done)" in lines, \
        lines


def test_an_id_in_two_workers_units_is_answered_once(tmp_path, cfg, local_ray):
    """Each file's rows repeat the other's ids: one engine answers each id once and counts the rest duplicates;
    so do Ray workers now, whatever units they take (the driver reads the ids first). Before, both copies of an
    id in units two workers held were answered."""
    inp = tmp_path / "in"
    inp.mkdir()
    for f in range(2):
        pq.write_table(pa.table({"id": [f"x{i}" for i in range(200)], "prompt": [f"q {f} {i}" for i in range(200)]}),
                       inp / f"part-{f}.parquet", row_group_size=25)
    out = tmp_path / "out"
    c = cfg(inp, out, engine={"kind": "echo", "echo_step_ms": 5, "max_num_seqs": 8}, sampling={"max_tokens": 4})
    s = run_on_ray(c, False, 2, is_tty=False)
    assert (s.state, s.exit_code, s.num_rows, s.num_done, s.num_duplicates) == ("completed", 0, 400, 200, 200)
    ids = ids_in(out)
    assert len(ids) == len(set(ids)) == 200
    prompts = {p for (p,) in __import__("duckdb").sql(
        f"select prompt from read_parquet('{out}/workers/*/parts/*.parquet')").fetchall()}
    assert prompts == {f"q 0 {i}" for i in range(200)}          # the first of each id, in input order
    st = json.loads((out / "status.json").read_text())   # the input's rows, as one engine counts them
    assert st["rows"] == {"total": 400, "done": 200, "remaining": 0, "duplicates": 200, "removed": 0}
    # request lines: a worker numbers a JSONL file's rows by line (blank lines too), and so does the driver's pass
    from openai_lines import completion

    lines = tmp_path / "requests.jsonl"
    lines.write_text("".join(json.dumps(completion(f"c{i % 32}")) + ("\n\n" if i % 4 == 3 else "\n")
                             for i in range(64)))
    out2 = tmp_path / "out2"
    s = run_on_ray(cfg(lines, out2, engine={"kind": "echo", "echo_step_ms": 5, "max_num_seqs": 4},
                       sampling={"max_tokens": 4}), False, 2, is_tty=False)
    assert (s.exit_code, s.num_rows, s.num_done, s.num_duplicates) == (0, 64, 32, 32), s.line()
    ids = ids_in(out2)
    assert len(ids) == len(set(ids)) == 32


def test_a_worker_that_fails_while_the_others_answer_every_row_leaves_the_job_complete(tmp_path, cfg, local_ray,
                                                                                        monkeypatch):
    """One worker's engine fails (a bad GPU on one node); the other takes its units and answers every row. The
    job is complete, exit 0, with a warning (it said failed, exit 69, "0 rows not done")."""
    s, out = run_with_a_bad_node(tmp_path, cfg, monkeypatch, 2)
    assert (s.state, s.exit_code, s.num_done, s.message) == ("completed", 0, 400, None)
    assert s.extra["failures"] == {"w1": "CUDA out of memory on this node"}
    ids = ids_in(out)
    assert len(ids) == len(set(ids)) == 400
    st = json.loads((out / "status.json").read_text())
    assert (st["state"], st["exit_code"], st["rows"]["remaining"]) == ("completed", 0, 0)


def test_a_worker_still_starting_when_the_only_other_fails_is_waited_for(tmp_path, cfg, local_ray, monkeypatch):
    """One worker fails at once while the other's process is still starting (a node that pulls its environment
    first). Before, the driver took the starting one for a worker the cluster had no room for (none placed was
    left) and killed it: the job failed with every row left. Now one not started is waited for a minute."""
    s, out = run_with_a_bad_node(tmp_path, cfg, monkeypatch, 1, slow_start_s=6)   # (its hello after that)
    assert (s.state, s.exit_code, s.num_done) == ("completed", 0, 200), s.message
    assert s.extra["failures"] == {"w1": "CUDA out of memory on this node"}
    ids = ids_in(out)
    assert len(ids) == len(set(ids)) == 200


def run_with_a_bad_node(tmp_path, cfg, monkeypatch, files: int, slow_start_s: float = 0.0):
    """A Ray job of two workers over ``files`` files of 200 rows, whose worker 1's engine fails at once (a bad GPU
    on one node); worker 0's process takes ``slow_start_s`` more to start. Returns the summary and OUT."""
    import overnight.pipeline.cluster.ray_job as ray_job
    from overnight.pipeline.cluster.actors import Worker

    class OneBadNode(Worker):   # (a local class: Ray pickles it by value to its worker processes)
        def __init__(self, cfg, index, *args):
            if index == 0:
                time.sleep(slow_start_s)
            super().__init__(cfg, index, *args)

        def run(self):
            if self.index == 1:
                from overnight.pipeline.engine import EngineError
                raise EngineError("CUDA out of memory on this node")
            return super().run()

    monkeypatch.setattr(ray_job, "Worker", OneBadNode)
    inp = write_input(tmp_path / "in", files, 200, 50)
    out = tmp_path / "out"
    return run_on_ray(cfg(inp, out, engine={"kind": "echo", "echo_step_ms": 5, "max_num_seqs": 8},
                          sampling={"max_tokens": 4}), False, 2, is_tty=False), out
