"""`overnight run` as a real subprocess, as cron or Airflow runs it: SIGKILL partway, rerun, count."""

import json
import os
import signal
import subprocess
import time

import pyarrow.parquet as pq
import pytest

from conftest import overnight_cmd, real_prompts

pytestmark = pytest.mark.engine


def run_cli(*args, timeout=600):
    return subprocess.run([*overnight_cmd(), *map(str, args)], capture_output=True, text=True, timeout=timeout)


def count_parts(out) -> int:
    return len(list((out / "parts").glob("part-*.parquet"))) if (out / "parts").exists() else 0


def test_sigkill_partway_then_rerun_gives_every_id_exactly_once(tmp_path, model_path):
    inp = tmp_path / "in.parquet"
    table = real_prompts(60)
    pq.write_table(table, inp)
    out = tmp_path / "out"
    args = ["run", inp, "--out", out, "--max-tokens", "64", "--flush-rows", "4", "--log-every", "1"]

    proc = subprocess.Popen([*overnight_cmd(), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while count_parts(out) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, f"the job ended before it could be killed: {proc.communicate()}"
    os.kill(proc.pid, signal.SIGKILL)  # the main process only, as an OOM killer would
    proc.wait()
    time.sleep(2)
    try:  # the engine's own processes exit when their parent dies; clean up any straggler
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _, stderr = proc.communicate()

    killed_at = pq.read_table(out / "parts").num_rows
    assert 0 < killed_at < 60
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["state"] == "running"  # it never got to say otherwise

    rerun = run_cli(*args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"60/60 rows (60 ok, 0 error, {killed_at} already done)" in rerun.stdout
    # Plain log lines, not a progress bar, when stderr is not a terminal.
    assert "rows (" in rerun.stderr and "output tok/s, ETA" in rerun.stderr and "\r" not in rerun.stderr

    files = sorted((out / "parts").glob("part-*.parquet"))
    ids = []
    for f in files:
        ids += pq.read_table(f).column("id").to_pylist()  # every part readable on its own
    assert sorted(ids) == sorted(table.column("id").to_pylist())
    assert len(ids) == len(set(ids)) == 60
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["state"] == "completed" and len(manifest["attempts"]) == 2
    assert manifest["counts"]["num_done"] == 60 and manifest["counts"]["num_parts"] == len(files)
    status = json.loads((out / "status.json").read_text())
    assert status["exit_code"] == 0 and status["rows"]["resumed"] == killed_at
