"""The README's cluster recipes, run as written: the Slurm array script as each array task would run it, and
the Kubernetes Indexed Job's container command with its ConfigMap, as each completion index would. Only the
paths (the bucket becomes a local folder) and the engine (echo) are swapped."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import REPO, overnight_cmd

pytestmark = pytest.mark.slow

CLUSTER = REPO / "examples" / "cluster"


def write_input(folder: Path, files: int = 5, rows: int = 30) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        pq.write_table(pa.table({"id": [f"f{f}-{i}" for i in range(rows)],
                                 "prompt": [f"question {f} {i}" for i in range(rows)]}), folder / f"p{f}.parquet")
    return folder


def local_config(text: str, inp: Path, out: Path, tiny_model: str) -> dict:
    """The recipe's config with the bucket swapped for local folders and the echo engine for vLLM."""
    cfg = yaml.safe_load(text)
    cfg["input"]["path"], cfg["output"]["path"] = str(inp), str(out)
    cfg["engine"] = {"kind": "echo", "model": tiny_model}
    return cfg


def env_with_overnight() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{Path(overnight_cmd()[0]).parent}{os.pathsep}{env['PATH']}"
    return env


def assert_every_id_once(out: Path, n: int) -> None:
    ids = duckdb.sql(f"select id from read_parquet('{out}/shards/*/parts/part-*.parquet')").fetchall()
    assert len(ids) == len(set(ids)) == n
    status = json.loads(subprocess.run([*overnight_cmd(), "status", str(out), "--json"], capture_output=True,
                                       text=True, check=True).stdout)
    assert (status["state"], status["exit_code"], status["rows_done"]) == ("completed", 0, n)


def test_the_slurm_array_script(tmp_path, tiny_model):
    script = (CLUSTER / "slurm.sbatch").read_text()
    array = next(line for line in script.splitlines() if line.startswith("#SBATCH --array="))
    first, last = map(int, array.split("=")[1].split("-"))
    inp, out = write_input(tmp_path / "in"), tmp_path / "out"
    config = tmp_path / "nightly.yaml"
    config.write_text(yaml.safe_dump(local_config((CLUSTER / "nightly.yaml").read_text(), inp, out, tiny_model)))
    for task in range(first, last + 1):   # what sbatch --array runs: one task per index, in any order
        env = env_with_overnight() | {"SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_TASK_MIN": str(first),
                                      "SLURM_ARRAY_TASK_COUNT": str(last - first + 1), "CONFIG": str(config)}
        done = subprocess.run(["bash", str(CLUSTER / "slurm.sbatch")], env=env, capture_output=True, text=True,
                              cwd=REPO, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    assert len(list((out / "shards").iterdir())) == last - first + 1
    assert_every_id_once(out, 150)


def test_the_kubernetes_indexed_job(tmp_path, tiny_model):
    docs = list(yaml.safe_load_all((CLUSTER / "k8s-indexed-job.yaml").read_text()))
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    job = next(d for d in docs if d["kind"] == "Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    container = spec["template"]["spec"]["containers"][0]
    mount = container["volumeMounts"][0]["mountPath"]
    inp, out = write_input(tmp_path / "in"), tmp_path / "out"
    mounted = tmp_path / "config"
    mounted.mkdir()
    for name, text in config_map["data"].items():
        (mounted / name).write_text(yaml.safe_dump(local_config(text, inp, out, tiny_model)))
    command = [str(mounted) + c[len(mount):] if c.startswith(mount) else c for c in container["command"]]
    assert command[0] == "overnight"
    for index in range(spec["completions"]):
        env = env_with_overnight() | {"JOB_COMPLETION_INDEX": str(index)}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{shlex.join(command)}: {done.stderr[-2000:]}"
    assert_every_id_once(out, 150)


def start_slurm_task(tmp_path: Path, tiny_model: str, restarts: int) -> tuple[subprocess.Popen, Path, Path]:
    """One array task of the Slurm script, over a slow echo engine, with a `scontrol` that records its calls."""
    inp, out = tmp_path / "in", tmp_path / "out"
    if not inp.exists():
        write_input(inp, files=2, rows=200)
    cfg = local_config((CLUSTER / "nightly.yaml").read_text(), inp, out, tiny_model)
    cfg["engine"]["echo_step_ms"] = 40
    # 32 rows at a time (64 in flight): each interrupted attempt drains its rows in flight, and three of them must
    # leave rows undone of 400 unless their signals come seconds late (at 128, the default, 256 in flight each)
    cfg["engine"]["max_num_seqs"] = 32
    cfg["output"]["flush_rows"] = 8
    config = tmp_path / "nightly.yaml"
    config.write_text(yaml.safe_dump(cfg))
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol.calls"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    env = env_with_overnight() | {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_MIN": "0",
                                  "SLURM_ARRAY_TASK_COUNT": "1", "SLURM_JOB_ID": "4242",
                                  "SLURM_RESTART_COUNT": str(restarts), "CONFIG": str(config)}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    proc = subprocess.Popen(["bash", str(CLUSTER / "slurm.sbatch")], env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)   # a job's own processes
    return proc, out / "shards" / "00000-of-00001", calls


def wait_for_a_part(proc: subprocess.Popen, shard: Path, before: int = 0) -> None:
    """Until this run has written a part: its engine is running and the script's traps are set."""
    deadline = time.monotonic() + 120
    while len(list(shard.glob("parts/part-*.parquet"))) <= before:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "no part was written in 2 minutes"
        time.sleep(0.1)


def test_the_slurm_script_requeues_at_the_time_limit_only(tmp_path, tiny_model):
    """Slurm's warning before the time limit (SIGUSR1, --signal=B:USR1@120) drains overnight, which exits 75,
    and the script requeues its task; `scancel` (SIGTERM) and a requeue past OVERNIGHT_REQUEUES do not."""
    script = (CLUSTER / "slurm.sbatch").read_text()
    assert "#SBATCH --signal=B:USR1@120" in script and "#SBATCH --requeue" in script
    # 1. the time limit's warning: drained, saved, exit 75, requeued
    proc, shard, calls = start_slurm_task(tmp_path, tiny_model, restarts=0)
    wait_for_a_part(proc, shard)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-2000:]
    assert calls.read_text() == "requeue 4242\n"
    assert "requeueing job 4242 (restart 0)" in err
    status = json.loads((shard / "status.json").read_text())
    assert status["exit_code"] == 75 and 0 < status["rows"]["done"] < 400
    # 2. scancel: SIGTERM to every process of the job (the script passes it on too: one stop, twice at once):
    #    the same drain, nothing aborted, exit 75, no requeue
    calls.unlink()
    parts = len(list(shard.glob("parts/part-*.parquet")))
    proc, shard, calls = start_slurm_task(tmp_path, tiny_model, restarts=1)
    wait_for_a_part(proc, shard, parts)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-2000:]
    assert not calls.exists()
    status = json.loads((shard / "status.json").read_text())
    assert status["rows"]["aborted"] == 0 and "aborting" not in err
    # 3. the time limit again, with the requeues spent: exit 75, no requeue
    parts = len(list(shard.glob("parts/part-*.parquet")))
    proc, shard, calls = start_slurm_task(tmp_path, tiny_model, restarts=3)
    wait_for_a_part(proc, shard, parts)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75 and not calls.exists(), err[-2000:]
    # 4. the requeued task runs to the end, each row once
    proc, shard, calls = start_slurm_task(tmp_path, tiny_model, restarts=3)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and not calls.exists(), err[-2000:]
    ids = duckdb.sql(f"select id from read_parquet('{shard}/parts/part-*.parquet')").fetchall()
    assert len(ids) == len(set(ids)) == 400
