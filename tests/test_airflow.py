"""The Airflow DAG in examples/airflow, run for real with `airflow dags test` in its own virtualenv (Airflow
pins many packages, so it lives apart from vLLM's: `make test` builds .venv-airflow once and caches it).

Two shards over the echo engine, each with a first attempt too short to finish (about 60 rows of 10 steps of
60 ms, 4 at a time: 9 s of steps, whatever the machine's speed, in an 8 s budget): its deadline exit (75) leads to
a retry that resumes, the job completes, and every id appears exactly once. Each retry's budget grows with its try
number (OVERNIGHT_EXTRA_ARGS is a template): with one fixed budget a loaded machine, whose process start took 6-7 s
of the 8, made no progress in some retries and ran out of them. A bad option (exit 2) fails each shard at once,
without the retries."""

from __future__ import annotations

import json
import os
import subprocess

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import REPO, overnight_cmd

pytestmark = pytest.mark.slow

AIRFLOW = REPO / ".venv-airflow" / "bin" / "airflow"


@pytest.mark.skipif(not AIRFLOW.exists(), reason="no .venv-airflow: `make test` (or `make airflow`) builds it")
def test_the_nightly_dag_retries_deadline_exits_until_every_id_is_done(tmp_path, tiny_model):
    inp = tmp_path / "in" / "2026-11-22"   # the night's own prompts (OVERNIGHT_INPUT with {{ ds }})
    inp.mkdir(parents=True)
    for f in range(4):
        pq.write_table(pa.table({"id": [f"f{f}-{i}" for i in range(30)], "prompt": [f"q {f} {i}" for i in range(30)]}),
                       inp / f"p{f}.parquet")
    out = tmp_path / "out"
    config = tmp_path / "nightly.yaml"
    config.write_text(yaml.safe_dump({
        "input": {"path": str(tmp_path / "in" / "not-tonight")}, "output": {"path": str(out), "flush_rows": 5},
        "engine": {"kind": "echo", "echo_step_ms": 60, "max_num_seqs": 4, "model": tiny_model},
        "sampling": {"max_tokens": 10}}))
    home = tmp_path / "airflow"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PYTHON", "VIRTUAL_ENV"))}
    env.update({"AIRFLOW_HOME": str(home), "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "examples" / "airflow"),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "OVERNIGHT": overnight_cmd()[0],
                "OVERNIGHT_CONFIG": str(config), "OVERNIGHT_OUT": str(out), "OVERNIGHT_SHARDS": "2",
                "OVERNIGHT_INPUT": str(tmp_path / "in" / "{{ ds }}"),
                "OVERNIGHT_EXTRA_ARGS": "--time-budget {{ 8 * ti.try_number }}s", "OVERNIGHT_RETRY_DELAY_S": "1"})
    migrate = subprocess.run([str(AIRFLOW), "db", "migrate"], env=env, capture_output=True, text=True, timeout=300)
    assert migrate.returncode == 0, migrate.stderr[-2000:]
    run = subprocess.run([str(AIRFLOW), "dags", "test", "overnight_nightly", "2026-11-22"], env=env,
                         capture_output=True, text=True, timeout=900)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert "overnight exited 75 (resumable)" in log and "Marking task as UP_FOR_RETRY" in log  # retried, resumed
    assert "--time-budget 8s" in log and "--time-budget 16s" in log    # the template, rendered for each try
    out = out / "2026-11-22"                                     # the night's own OUT
    ids = [r[0] for r in duckdb.sql(f"select id from read_parquet('{out}/shards/*/parts/part-*.parquet')").fetchall()]
    assert len(ids) == len(set(ids)) == 120
    attempts = [json.loads((d / "manifest.json").read_text())["attempts"] for d in sorted((out / "shards").iterdir())]
    assert any(len(a) >= 2 and a[0]["state"] == "partial" and a[-1]["state"] == "completed" for a in attempts)
    assert "'state': 'completed'" in log or '"state": "completed"' in log   # the summary task's XCom
    # a bad option (exit 2) fails each shard at once: no retry would help
    env["OVERNIGHT_EXTRA_ARGS"] = "--time-budget 5x"
    run = subprocess.run([str(AIRFLOW), "dags", "test", "overnight_nightly", "2026-11-23"], env=env,
                         capture_output=True, text=True, timeout=900)
    log = run.stdout + run.stderr
    assert "overnight exited 2: bad usage" in log and "'5x' is not a duration" in log, log[-4000:]
    assert "Marking task as FAILED" in log and "UP_FOR_RETRY" not in log, log[-4000:]
