"""Ray workers (--workers W) on a real local Ray cluster, with the echo engine: dynamic units, exactly once,
an actor killed mid-run, the deadline, SIGTERM to the driver."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import overnight_cmd

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # after the others, alone: see conftest.py

ray = pytest.importorskip("ray")

from overnight.pipeline.cluster.ray_job import run_on_ray  # noqa: E402
from overnight.pipeline.tools.inspection import open_results, summary_lines  # noqa: E402
from overnight.pipeline.tools.status import job_status  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def write_input(folder: Path, files: int, rows: int, row_group_size: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        t = pa.table({"id": [f"f{f}-{i}" for i in range(rows)], "prompt": [f"question {f} {i}" for i in range(rows)]})
        pq.write_table(t, folder / f"part-{f}.parquet", row_group_size=row_group_size)
    return folder


def ids_in(out: Path) -> list:
    if not list(out.glob("workers/*/parts/part-*.parquet")):
        return []
    return [r[0] for r in duckdb.sql(f"select id from read_parquet('{out}/workers/*/parts/part-*.parquet')").fetchall()]


def test_a_worker_whose_folder_completed_resumes_from_its_parts(tmp_path, cfg, local_ray):
    # one worker: no other folder's ids to resume against, so the worker's own scan is all there is
    inp = write_input(tmp_path / "in", 1, 100, 50)
    out = tmp_path / "out"
    c = cfg(inp, out, engine={"kind": "echo", "echo_step_ms": 1, "max_num_seqs": 8}, sampling={"max_tokens": 4},
            output={"flush_rows": 10})
    assert run_on_ray(c, False, 1, is_tty=False).num_done == 100
    parts = sorted(p.name for p in (out / "workers" / "w00000" / "parts").glob("part-*.parquet"))
    # the same job again (another flush size), and once more over a grown input
    c2 = cfg(inp, out, engine={"kind": "echo", "echo_step_ms": 1, "max_num_seqs": 8}, sampling={"max_tokens": 4},
             output={"flush_rows": 1000})
    again = run_on_ray(c2, False, 1, is_tty=False)
    assert (again.state, again.num_resumed, again.num_done) == ("completed", 100, 100)
    write_input(tmp_path / "in2", 1, 120, 60)
    c3 = cfg(tmp_path / "in2", out, engine={"kind": "echo", "echo_step_ms": 1, "max_num_seqs": 8},
             sampling={"max_tokens": 4}, output={"flush_rows": 1000})
    grown = run_on_ray(c3, False, 1, is_tty=False)
    assert (grown.state, grown.num_resumed, grown.num_done) == ("completed", 100, 120)
    ids = ids_in(out)
    assert len(ids) == len(set(ids)) == 120   # the earlier parts were not written over
    assert set(parts) <= {p.name for p in (out / "workers" / "w00000" / "parts").glob("part-*.parquet")}


def test_resumed_workers_predict_lengths_learned_from_the_rows_any_worker_did_before(tmp_path, cfg, local_ray):
    """Each worker's online predictor learns from the rows done before, in every worker's folder, as one engine's
    does (pipeline/input/done_rows.py). It reads the input itself for them, not unit by unit: it takes no unit
    from another worker. Before, a resumed worker went by the prior, far over the echo's answers."""
    inp = tmp_path / "in"
    inp.mkdir()
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(420)],
                             "prompt": [f"question {i} " + "word " * (i % 9) for i in range(420)]}),
                   inp / "part-0.parquet", row_group_size=30)
    out = tmp_path / "out"
    engine = {"kind": "echo", "echo_step_ms": 1, "max_num_seqs": 8}
    first = run_on_ray(cfg(inp, out, engine=engine, input={"limit": 300}), False, 2, is_tty=False)
    assert first.num_done == 300
    s = run_on_ray(cfg(inp, out, engine=engine), False, 2, is_tty=False)
    assert (s.state, s.num_resumed, s.num_done) == ("completed", 300, 420)
    ids = ids_in(out)
    assert len(ids) == len(set(ids)) == 420   # each id once: the second pass over the input took no unit
    later = duckdb.sql(f"select sum(output_tokens) / sum(predicted_tokens) from "
                       f"read_parquet('{out}/workers/*/parts/part-*.parquet') "
                       f"where cast(substr(id, 2) as int) >= 300").fetchall()[0][0]
    assert 0.5 < later < 2.0, later


def test_a_rerun_with_other_settings_is_refused_before_any_worker_starts(tmp_path, cfg, local_ray):
    from overnight.pipeline.output.checkpoint import OutputError

    inp = write_input(tmp_path / "in", 1, 40, 20)
    out = tmp_path / "out"
    engine = {"kind": "echo", "echo_step_ms": 1, "max_num_seqs": 8}
    assert run_on_ray(cfg(inp, out, engine=engine, sampling={"max_tokens": 4}), False, 2, is_tty=False).num_done == 40
    with pytest.raises(OutputError, match=r"holds results of a run with different settings \(sampling.max_tokens: "
                                          r"4 -> 2\)"):
        run_on_ray(cfg(inp, out, engine=engine, sampling={"max_tokens": 2}), False, 3, is_tty=False)
    assert not (out / "workers" / "w00002").exists()   # no new worker ran the rest with the new settings


def test_workers_get_the_json_schema_itself_and_an_edited_file_is_refused(tmp_path, cfg, local_ray):
    from overnight.pipeline.output.checkpoint import OutputError

    inp = write_input(tmp_path / "in", 1, 20, 10)
    out = tmp_path / "out"
    f = tmp_path / "schema.json"   # a path a worker on another node may not have
    f.write_text('{"type": "object"}')
    c = cfg(inp, out, engine={"kind": "echo", "echo_step_ms": 1, "max_num_seqs": 8},
            sampling={"max_tokens": 4, "json_schema": str(f)})
    assert run_on_ray(c, False, 1, is_tty=False).num_done == 20 and len(set(ids_in(out))) == 20
    manifest = out / "workers" / "w00000" / "manifest.json"
    worker = json.loads(manifest.read_text())
    assert worker["config"]["sampling"]["json_schema"] == '{"type": "object"}'
    f.write_text('{"type": "array"}')
    with pytest.raises(OutputError, match=r"sampling.json_schema.type: 'object' -> 'array'"):
        run_on_ray(c, False, 1, is_tty=False)
    # a folder written before stop 37 fingerprinted the file's path: its workers get the path, and resume
    from overnight.pipeline.output import manifest as mf
    worker["fingerprint_fields"]["sampling"]["json_schema"] = str(f)
    worker["fingerprint"] = mf.fingerprint(worker["fingerprint_fields"])
    manifest.write_text(json.dumps(worker))
    again = run_on_ray(c, False, 1, is_tty=False)
    assert (again.state, again.num_resumed) == ("completed", 20), again.message
    assert json.loads(manifest.read_text())["config"]["sampling"]["json_schema"] == str(f)


def test_a_driver_whose_lock_another_run_took_stops_every_worker(tmp_path, cfg, local_ray, monkeypatch):
    from overnight.pipeline.output import lock as lock_module

    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.2)   # the driver's: it reads its lock back every 0.2 s
    inp = write_input(tmp_path / "in", 2, 400, 50)
    out = tmp_path / "out"
    c = cfg(inp, out, engine={"kind": "echo", "echo_step_ms": 20, "max_num_seqs": 8}, sampling={"max_tokens": 6})

    done = threading.Event()

    def take_over():
        while not list(out.glob("workers/*/parts/part-*.parquet")):
            time.sleep(0.1)
        lock = json.loads((out / ".overnight.lock").read_text())
        theirs = json.dumps(dict(lock, host="other-host", pid=99, token="theirs"))
        tmp = out / ".overnight.lock.theirs"
        while not done.wait(0.05):  # as the other run's heartbeat would (a beat of the driver's thread may read
            tmp.write_text(theirs)  # the lock just before a write of ours, and write after); written whole and
            os.replace(tmp, out / ".overnight.lock")  # renamed, as a run writes its lock (a read never sees half)

    t = threading.Thread(target=take_over, daemon=True)
    t.start()
    s = run_on_ray(c, False, 2, is_tty=False)
    done.set()
    t.join(timeout=5)
    assert (s.state, s.exit_code) == ("failed", 1) and s.num_done < 800
    assert "another run took over" in s.message and "host other-host, pid 99" in s.message
    assert json.loads((out / ".overnight.lock").read_text())["token"] == "theirs"
    assert json.loads((out / "status.json").read_text())["state"] == "running"   # no end state written over theirs
    for w in out.glob("workers/*/status.json"):   # each worker stopped without its end status
        assert json.loads(w.read_text())["state"] == "running", w


def test_two_workers_share_the_units_and_answer_each_id_once(tmp_path, cfg, local_ray):
    inp = write_input(tmp_path / "in", 2, 400, 50)
    out = tmp_path / "out"
    # about 12 s of engine time for one worker, so that both are up long before the units run out
    metrics = tmp_path / "job.prom"
    c = cfg(inp, out, engine={"kind": "echo", "echo_step_ms": 20, "max_num_seqs": 8},
            sampling={"max_tokens": 6}, output={"metrics_file": str(metrics)})
    s = run_on_ray(c, False, 2, is_tty=False)
    assert (s.state, s.exit_code, s.num_done, s.num_rows) == ("completed", 0, 800, 800)
    # --metrics-file is the job's, which the driver writes (each worker wrote its own rows over the other's)
    from prometheus_client.parser import text_string_to_metric_families
    samples = {(sm.name, tuple(sorted(sm.labels.items()))): sm.value
               for fam in text_string_to_metric_families(metrics.read_text()) for sm in fam.samples}
    job = str(out)
    assert samples[("overnight_rows", (("job", job), ("state", "total")))] == 800
    assert samples[("overnight_rows", (("job", job), ("state", "done")))] == 800
    assert samples[("overnight_state", (("job", job), ("state", "completed")))] == 1.0
    assert samples[("overnight_output_tokens", (("job", job),))] == s.num_output_tokens > 0
    ids = ids_in(out)
    assert len(ids) == len(set(ids)) == 800
    per_worker = duckdb.sql(f"select count(*) from read_parquet('{out}/workers/*/parts/part-*.parquet', filename=true) "
                            f"group by regexp_extract(filename, 'w[0-9]+')").fetchall()
    assert len(per_worker) == 2 and min(n for (n,) in per_worker) >= 50   # both took units (a unit: 50 rows)
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "completed" and status["rows"]["done"] == 800 and status["units_pending"] == 0
    assert status["output_tokens_per_s"] > 0   # the rate measured, kept at the end (it said 0)
    # a rerun finds everything done
    again = run_on_ray(c, False, 2, is_tty=False)
    assert again.exit_code == 0 and again.num_resumed == 800 and len(ids_in(out)) == 800
    for w in ("w00000", "w00001"):  # nothing was left, so no worker started an engine
        st = json.loads((out / "workers" / w / "status.json").read_text())
        assert st["engine_started"] is False, (w, st)


def test_a_killed_worker_loses_nothing(tmp_path, cfg, local_ray):
    inp = write_input(tmp_path / "in", 2, 500, 50)
    out = tmp_path / "out"
    c = cfg(inp, out, engine={"kind": "echo", "echo_step_ms": 20, "max_num_seqs": 8},
            sampling={"max_tokens": 8})
    killed, ended = [], threading.Event()

    def kill_when_writing(actors):
        def go():
            while not ended.is_set():  # (on a loaded machine the workers' start alone took a minute)
                for i in range(len(actors)):  # the first worker to have written 3 parts, mid-run
                    if len(list((out / "workers" / f"w{i:05d}" / "parts").glob("part-*.parquet"))) >= 3:
                        ray.kill(actors[i], no_restart=False)  # Ray restarts it; its units go back to the queue
                        killed.append(i)
                        return
                time.sleep(0.05)
        threading.Thread(target=go, daemon=True).start()

    try:
        s = run_on_ray(c, False, 2, is_tty=False, on_started=kill_when_writing)
    finally:
        ended.set()
    assert killed, "the worker was never killed"
    assert (s.state, s.exit_code) == ("completed", 0), s.message
    assert s.extra["worker_restarts"] >= 1
    status = json.loads((out / "status.json").read_text())
    assert status["worker_restarts"] == s.extra["worker_restarts"]
    ids = ids_in(out)
    assert len(ids) == len(set(ids)) == 1000
    # the rows of a unit handed out again that the dead worker's folder held are not left "remaining" anywhere
    left = {p.parent.name: json.loads(p.read_text())["rows"] for p in (out / "workers").glob("w*/status.json")}
    assert all(r["remaining"] == 0 for r in left.values()), left


def test_the_deadline_stops_every_worker_then_a_rerun_completes(tmp_path, cfg, local_ray, caplog):
    inp = write_input(tmp_path / "in", 2, 600, 50)
    out = tmp_path / "out"
    # two workers do about 9 rows/s: 1200 rows need 135 s, and the budget (which counts Ray's and the workers'
    # start: 5-20 s on 2 quiet cores, and over 40 s beside two busy loops; it must leave the driver time to warn)
    # is 60 s
    slow = {"kind": "echo", "echo_step_ms": 45, "max_num_seqs": 4}
    with caplog.at_level("WARNING", logger="overnight"):
        s = run_on_ray(cfg(inp, out, engine=slow, sampling={"max_tokens": 20}, scheduler={"time_budget": "60s"}),
                       False, 2, is_tty=False)
    assert (s.state, s.exit_code) == ("partial", 75)
    first = ids_in(out)
    assert 0 < len(first) < 1200 and len(first) == len(set(first))
    # the driver warned, from its workers' forecasts, with the rows it expected to leave undone
    warned = [r.getMessage() for r in caplog.records if "deadline at risk: over 2 workers" in r.getMessage()]
    assert warned, [r.getMessage() for r in caplog.records]
    expected = int(re.search(r"about (\d+) of \d+ remaining rows", warned[0]).group(1))
    assert 0 < expected <= 1200
    con, m = open_results(str(out))   # workers' folders are not shards: the job's total and its rows not done
    assert f"rows: {len(first)} ({len(first)} ok, 0 error, {1200 - len(first)} not done)" in summary_lines(con, m)
    assert summary_lines(con, m)[0].startswith("job in 2 Ray worker folders  state: partial")
    # a driver killed (SIGKILL) leaves its last status, older than what its workers' folders hold
    path = out / "status.json"
    driver = json.loads(path.read_text())
    path.write_text(json.dumps({**driver, "state": "running", "rows": {**driver["rows"], "done": 10,
                                                                        "remaining": 1190}}))
    st = job_status(str(out))
    assert (st["state"], st["rows_done"], st["rows_left"]) == ("stopped", len(first), 1200 - len(first))
    # ... less the rows in those folders whose ids its id pass found gone from the input (they counted as done)
    path.write_text(json.dumps({**driver, "state": "running", "rows": {**driver["rows"], "done": 10,
                                                                        "remaining": 1190, "removed": 7}}))
    st = job_status(str(out))
    assert (st["rows_done"], st["rows_left"]) == (len(first) - 7, 1200 - len(first) + 7)
    path.write_text(json.dumps(driver))
    # the rerun on one worker: w1's folder is not run, and its rows still count in the summary
    s2 = run_on_ray(cfg(inp, out, engine={"kind": "echo", "max_num_seqs": 64}, sampling={"max_tokens": 20}),
                    False, 1, is_tty=False)
    assert (s2.state, s2.exit_code, s2.num_ok, s2.num_done) == ("completed", 0, 1200, 1200)
    ids = ids_in(out)
    assert len(ids) == len(set(ids)) == 1200
    # the rows done count every folder's rows, the first attempt's too
    st = job_status(str(out))
    assert (st["rows_done"], st["rows_left"]) == (1200, 0) and sum(w["rows_done"] for w in st["per_shard"]) == 1200
    assert json.loads((out / "status.json").read_text())["rows"]["done"] == 1200
    # and its output tokens too (they were the running folder's alone)
    assert json.loads((out / "status.json").read_text())["output_tokens"] == s2.num_output_tokens > 0


def test_sigterm_to_the_driver_drains_every_worker_and_exits_75(tmp_path, tiny_model):
    inp = write_input(tmp_path / "in", 2, 400, 50)
    out = tmp_path / "out"
    args = [*overnight_cmd(), "run", str(inp), "--out", str(out), "--workers", "2", "--engine", "echo",
            "--echo-step-ms", "30", "--max-num-seqs", "4", "--max-tokens", "20", "--model", tiny_model,
            "--flush-rows", "4", "--grace", "5s", "--json"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    status = out / "status.json"
    deadline = time.time() + 300
    while time.time() < deadline:
        if status.exists() and json.loads(status.read_text() or "{}").get("rows", {}).get("done", 0) >= 8:
            break
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    else:
        raise AssertionError("no 8 rows done in 300 s")
    running = json.loads(subprocess.run([*overnight_cmd(), "status", str(out), "--json"], capture_output=True,
                                        text=True, check=True).stdout)
    assert running["state"] == "running" and running["workers"] == 2 and running["rows_total"] == 800
    assert {w["state"] for w in running["per_shard"]} <= {"running", "not started"}
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr[-3000:]
    summary = json.loads(stdout)
    assert summary["state"] == "interrupted" and summary["message"].startswith("interrupted by SIGTERM: ")
    assert "interrupted by interrupted" not in stderr     # each worker's own message names the signal once
    ids = ids_in(out)
    assert 0 < len(ids) < 800 and len(ids) == len(set(ids))
    assert json.loads(status.read_text())["exit_code"] == 75
    after = json.loads(subprocess.run([*overnight_cmd(), "status", str(out), "--json"], capture_output=True,
                                      text=True, check=True).stdout)
    assert after["state"] == "interrupted" and after["exit_code"] == 75


def test_workers_the_cluster_has_no_room_for_are_not_waited_for(tmp_path, cfg, local_ray, caplog):
    inp = write_input(tmp_path / "in", 1, 200, 50)
    out = tmp_path / "out"
    c = cfg(inp, out, engine={"kind": "echo", "max_num_seqs": 16}, sampling={"max_tokens": 4})
    with caplog.at_level("INFO", logger="overnight"):
        s = run_on_ray(c, False, 3, is_tty=False)   # the local cluster has 2 CPUs: one worker never starts
    assert (s.state, s.exit_code) == ("completed", 0)
    assert len(ids_in(out)) == 200
    # (one, or two where the first worker took every unit before the second started)
    assert re.search(r"[12] workers never started and are not needed any more \(no work is left for them\)",
                     caplog.text)


def test_a_signal_while_a_ray_job_opens_stops_it_with_75(tmp_path, cfg, local_ray, monkeypatch):
    import os

    import overnight.pipeline.input.source as source
    from overnight.pipeline.api import run_job

    opened = source.open_source

    def open_and_signal(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)   # as the driver lists the input, before any worker exists
        return opened(*a, **k)

    def unhandled(signum, frame):
        raise AssertionError("SIGTERM while the Ray job opened was not recorded")

    monkeypatch.setattr(source, "open_source", open_and_signal)
    inp = write_input(tmp_path / "in", 1, 100, 50)
    before = signal.signal(signal.SIGTERM, unhandled)
    try:
        s = run_job(cfg(inp, tmp_path / "out", engine={"kind": "echo", "echo_step_ms": 20, "max_num_seqs": 4},
                        cluster={"workers": 2}), is_tty=False)
        assert signal.getsignal(signal.SIGTERM) == unhandled
    finally:
        signal.signal(signal.SIGTERM, before)
    assert (s.exit_code, s.state) == (75, "interrupted") and s.num_done < 100


def test_retry_errors_answers_every_worker_folders_error_rows_again(tmp_path, cfg, local_ray, write_parquet):
    out = tmp_path / "out"
    inp = write_parquet({"id": list(range(12)), "prompt": ["hi"] * 11 + [None]})
    c = cfg(inp, out, engine={"kind": "echo", "echo_step_ms": 1}, sampling={"max_tokens": 4})
    run_on_ray(c, False, 2, is_tty=False)
    errors = duckdb.sql(f"select id from read_parquet('{out}/workers/*/parts/part-*.parquet') where status = 'error'")
    assert errors.fetchall() == [(11,)]
    write_parquet({"id": list(range(12)), "prompt": ["hi"] * 12})       # the bad row fixed: it has a prompt now
    s = run_on_ray(c, False, 2, is_tty=False, retry_errors=True)
    assert (s.state, s.num_ok, s.num_error) == ("completed", 12, 0)
    assert sorted(ids_in(out)) == list(range(12))                       # each id once, every row ok
    assert duckdb.sql(f"select distinct status from read_parquet('{out}/workers/*/parts/part-*.parquet')").fetchall() \
        == [("ok",)]
