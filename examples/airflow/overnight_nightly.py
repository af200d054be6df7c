"""A nightly overnight job in Airflow: one mapped task per shard, retried until each shard is done.

Each shard runs `overnight run nightly.yaml --shard K/N` from a task of its own (dynamic task mapping fans out the
N shards). Its exit code decides whether Airflow retries it:

- 0: the shard is done.
- 75: stopped early at the deadline or by SIGTERM; resumable. The task fails, and its retry reruns the same
  command, which continues where the shard stopped. Airflow's own timeout (``execution_timeout``) and a task
  stopped by hand reach overnight as SIGTERM: it drains, saves what finished and exits 75.
- 69: the engine failed to start or died (a busy or broken GPU); rows are saved. The retry waits
  ``retry_delay``, doubling each time (``retry_exponential_backoff``).
- 2: bad usage (an option's or the config's value, or one the input, model or OUT does not fit: a column it
  lacks, a missing model, an OUT of other settings): the task fails at once, without the retries, which would
  not help (AirflowFailException); the message says why.
- 1: a failure, which the message names: bad input, but also storage that stayed unreachable through
  overnight's own retries, or a lock another run holds. It is retried like 69, and a retry that meets the same
  bad input fails the same way.

Each night (each DAG run's logical date, ``ds``) writes to a folder of its own, OVERNIGHT_OUT/<ds>/: a retry of
that night's run resumes it, and the next night starts a job of its own (the same folder again would find the
last night's job done, or, with new input files, refuse: a sharded job's input must not change under it). Set
OVERNIGHT_INPUT to read each night's own prompts; it may use Airflow's templates, e.g.
``s3://my-bucket/prompts/{{ ds }}/``, as may OVERNIGHT_EXTRA_ARGS (``--time-budget {{ [2 * ti.try_number, 7] | min }}h``
gives each retry more time than the last, up to 7 h within the task's 8 h execution_timeout). Without it, the
config's input.path is read.

The last task reads every shard's status with `overnight status OUT/<ds> --json` and returns it as the XCom
summary.

Set OVERNIGHT (the `overnight` command), OVERNIGHT_CONFIG, OVERNIGHT_OUT, OVERNIGHT_INPUT and OVERNIGHT_SHARDS in
the environment, or edit the defaults below.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
from datetime import datetime, timedelta

from airflow import DAG
from airflow.decorators import task
from airflow.exceptions import AirflowException, AirflowFailException

OVERNIGHT = os.environ.get("OVERNIGHT", "overnight")
CONFIG = os.environ.get("OVERNIGHT_CONFIG", "/etc/overnight/nightly.yaml")
OUT = os.environ.get("OVERNIGHT_OUT", "s3://my-bucket/answers").rstrip("/")
INPUT = os.environ.get("OVERNIGHT_INPUT", "")
SHARDS = int(os.environ.get("OVERNIGHT_SHARDS", "4"))
EXTRA = os.environ.get("OVERNIGHT_EXTRA_ARGS", "")
RETRY_DELAY = timedelta(seconds=float(os.environ.get("OVERNIGHT_RETRY_DELAY_S", "120")))
NOT_RETRIED = (2,)  # bad usage (an option's or the config's value, or one the input does not fit): a retry fails alike

with DAG(
    dag_id="overnight_nightly",
    start_date=datetime(2026, 1, 1),
    schedule="0 22 * * *",
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 6, "retry_delay": RETRY_DELAY, "retry_exponential_backoff": True,
                  "max_retry_delay": timedelta(minutes=30)},
) as dag:

    @task(execution_timeout=timedelta(hours=8))
    def shard(k: int, input_path: str, extra: str, ds=None) -> None:
        """input_path and extra arrive rendered: a task's arguments are Airflow templates ({{ ds }})."""
        inputs = [input_path, "--config"] if input_path else []
        command = [OVERNIGHT, "run", *inputs, CONFIG, "--out", f"{OUT}/{ds}", "--shard", f"{k}/{SHARDS}",
                   *shlex.split(extra)]
        print("running:", shlex.join(command), flush=True)
        proc = subprocess.Popen(command)
        try:
            code = proc.wait()
        except BaseException:  # Airflow's timeout, or the task stopped: overnight drains, saves and exits 75
            proc.send_signal(signal.SIGTERM)
            proc.wait()
            raise
        if code in NOT_RETRIED:
            raise AirflowFailException(f"overnight exited {code}: bad usage (its message above says why); not "
                                       f"retried")
        if code:
            why = {75: "resumable", 69: "engine"}.get(code, "failed: its message above says why")
            raise AirflowException(f"overnight exited {code} ({why}); the retry continues where the shard stopped")

    @task(retries=0)
    def summary(ds=None) -> dict:
        out = f"{OUT}/{ds}"
        done = subprocess.run([OVERNIGHT, "status", out, "--json"], capture_output=True, text=True, check=True)
        status = json.loads(done.stdout)
        if status["state"] != "completed":
            raise RuntimeError(f"overnight job in {out} is {status['state']}: {status['rows_left']} rows left")
        return {k: status[k] for k in ("state", "rows_done", "rows_total", "exit_code", "shards")}

    shard.partial(input_path=INPUT, extra=EXTRA).expand(k=list(range(SHARDS))) >> summary()
