"""`overnight run` as a real subprocess on the real engine, as cron or Airflow runs it, through its faults.

One job, one output folder, one fault after another, each followed by a rerun:
SIGKILL partway, SIGTERM (drain, exit 75), the engine's own process killed
(exit 69), and killed again with --max-engine-restarts (restart in-process and
finish). At the end every id is there exactly once and every part is readable.
"""

import json
import os
import signal
import subprocess
import time

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import overnight_cmd, real_prompts

pytestmark = pytest.mark.engine


def count_parts(out) -> int:
    return len(list((out / "parts").glob("part-*.parquet"))) if (out / "parts").exists() else 0


def done_rows(out) -> int:
    return pq.read_table(out / "parts").num_rows if count_parts(out) else 0


def start(args):
    return subprocess.Popen([*overnight_cmd(), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def wait_for_new_parts(proc, out, n_before, n_new=1, timeout=300):
    deadline = time.monotonic() + timeout
    while count_parts(out) < n_before + n_new and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, f"the job ended before the fault: {proc.communicate()[1][-3000:]}"


def engine_core(proc) -> psutil.Process:
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError("no EngineCore process found")


def engine_processes(proc) -> list:
    """vLLM's processes below the job `proc` (not those of another engine on the machine, such as one this
    pytest process started in-process for an earlier module)."""
    found = []
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "VLLM" in p.name() or "VLLM" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            continue
    return found


def running(p: psutil.Process) -> bool:
    """Alive: not gone, not a pid reused by another process, and not a zombie (a zombie has exited and
    holds no memory; only its parent's wait() is missing, and after a SIGKILLed job that parent is init)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def still_running(procs) -> set:
    return {p.pid for p in procs if running(p)}


def figure(fault: str, since: float, rows_done: int) -> None:
    # for docs/RELIABILITY.md: pytest -s tests/test_engine_subprocess.py
    print(f"\n{fault}: {time.monotonic() - since:.1f} s from the fault to the end of the process; "
          f"{rows_done} rows done")


def finish(proc, timeout=600):
    proc.wait(timeout=timeout)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


def test_one_job_through_kill_sigterm_and_engine_death(tmp_path, model_path):
    inp = tmp_path / "in.parquet"
    # Staggered caps, so rows finish one after another and every fault lands mid-job.
    table = real_prompts(120)
    table = table.append_column("max_tokens", pa.array([8 + (i * 7) % 57 for i in range(120)], pa.int64()))
    pq.write_table(table, inp)
    out = tmp_path / "out"
    args = ["run", inp, "--out", out, "--flush-rows", "4", "--log-every", "1"]

    # 1. SIGKILL to the main process, as an OOM killer would
    proc = start(args)
    wait_for_new_parts(proc, out, 0, 2)
    before = engine_processes(proc)  # taken while the job is alive: its descendants can be found only now
    assert any("EngineCor" in p.name() for p in before), f"the engine core is running: {before}"
    t = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    finish(proc)
    # vLLM's processes would outlive their killed parent; the job's reaper takes them down
    deadline = time.monotonic() + 30
    while still_running(before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not still_running(before), [p for p in before if running(p)]
    after_kill = done_rows(out)
    figure("SIGKILL: engine processes reaped", t, after_kill)
    assert 0 < after_kill < 120
    assert json.loads((out / "manifest.json").read_text())["state"] == "running"  # it never got to say otherwise

    # 2. SIGTERM, as Airflow or Kubernetes sends: stop admitting, drain for the grace period, abort the rest,
    #    save, exit 75
    # a short grace: the rows in flight at the signal (as few as 16 while the step cost is probed, of 8 to 64
    # tokens) must not all drain within it
    proc = start([*args, "--grace", "1s"])
    wait_for_new_parts(proc, out, count_parts(out))
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code, stdout, stderr = finish(proc)
    assert code == 75, stderr[-3000:]
    assert "interrupted by SIGTERM: stopped admitting rows;" in stderr and "draining them until" in stderr
    assert "rows in flight; they are not done and a rerun will redo them" in stderr
    assert "overnight: interrupted (resumable): " in stdout and "rerun the same command to continue" in stdout
    assert f"{after_kill} already done" in stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["state"] == "interrupted"
    status = json.loads((out / "status.json").read_text())
    assert status["exit_code"] == 75 and status["rows"]["aborted"] > 0
    after_term = done_rows(out)
    figure("SIGTERM --grace 1s: drained, aborted, exit 75", t, after_term)
    assert after_kill < after_term < 120

    # 3. the engine's own process dies: finished rows are saved, exit 69 says so
    proc = start(args)
    wait_for_new_parts(proc, out, count_parts(out))
    t = time.monotonic()
    engine_core(proc).kill()
    code, stdout, stderr = finish(proc)
    assert code == 69, stderr[-3000:]
    assert "Error: The vLLM engine failed mid-run" in stderr and "rerun the same command to continue" in stderr
    assert json.loads((out / "status.json").read_text())["exit_code"] == 69
    after_death = done_rows(out)
    figure("engine core killed: saved, exit 69", t, after_death)
    assert after_term < after_death < 120

    # 4. again, with --max-engine-restarts: it restarts in-process and finishes the job
    proc = start([*args, "--max-engine-restarts", "1"])
    wait_for_new_parts(proc, out, count_parts(out))
    t = time.monotonic()
    engine_core(proc).kill()
    code, stdout, stderr = finish(proc)
    figure("engine core killed, --max-engine-restarts 1: restarted and completed", t, 120)
    assert code == 0, stderr[-3000:]
    assert "restarting it (1 of 1)" in stderr
    assert "120/120 rows (120 ok, 0 error" in stdout
    # plain log lines, not a progress bar, when stderr is not a terminal
    assert "output tok/s, ETA" in stderr and "\r" not in stderr

    ids = []
    files = sorted((out / "parts").glob("part-*.parquet"))
    for f in files:
        ids += pq.read_table(f).column("id").to_pylist()  # every part readable on its own
    assert sorted(ids) == sorted(table.column("id").to_pylist())
    assert len(ids) == len(set(ids)) == 120
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["state"] == "completed" and len(manifest["attempts"]) == 4
    assert [a["state"] for a in manifest["attempts"]] == ["running", "interrupted", "failed", "completed"]
    assert manifest["counts"]["num_done"] == 120 and manifest["counts"]["num_parts"] == len(files)
    assert json.loads((out / "status.json").read_text())["engine_restarts"] == 1
