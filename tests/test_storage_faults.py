"""Storage: a real S3 API (moto's server on loopback), transient faults, and a full output filesystem.

Jobs run on the echo engine with the tiny model (tests/fakes.py): storage is under test, not the model."""

import json
import os
import resource
import subprocess

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner

from conftest import overnight_cmd, real_prompts
from overnight.jobs.cli import cli

ECHO = {"OVERNIGHT_ENGINE": "echo"}


def put_parquet(url, table):
    fs, path = fsspec.core.url_to_fs(url)
    with fs.open(path, "wb") as f:
        pq.write_table(table, f)


def read_parts(url) -> pa.Table:
    fs, path = fsspec.core.url_to_fs(url)
    files = sorted(fs.glob(f"{path}/parts/part-*.parquet"))
    tables = []
    for f in files:
        with fs.open(f, "rb") as fh:
            tables.append(pq.read_table(fh))
    return pa.concat_tables(tables)


def test_s3_input_and_output_resume_and_inspect(s3, tiny_model):
    inp, out = "s3://overnight-test/in/prompts.parquet", "s3://overnight-test/out-echo"
    put_parquet(inp, real_prompts(30))
    runner = CliRunner(env=ECHO)
    first = runner.invoke(cli, ["run", inp, "--out", out, "--limit", "10", "--flush-rows", "4", "--model", tiny_model])
    assert first.exit_code == 0, first.output
    second = runner.invoke(cli, ["run", inp, "--out", out, "--flush-rows", "4", "--model", tiny_model])
    assert "30/30 rows (30 ok, 0 error, 10 already done)" in second.output
    ids = read_parts(out).column("id").to_pylist()
    assert len(ids) == 30 == len(set(ids))
    fs = fsspec.filesystem("s3")
    assert json.loads(fs.cat("overnight-test/out-echo/manifest.json"))["state"] == "completed"
    assert not fs.exists("overnight-test/out-echo/.overnight.lock")
    q = runner.invoke(cli, ["inspect", out, "--sql", "select count(*) as n from results", "--format", "csv"])
    assert q.exit_code == 0 and q.output.split() == ["n", "30"]


def test_s3_in_a_subprocess_configured_from_the_environment(s3, tiny_model):
    from conftest import s3_env
    inp, out = "s3://overnight-test/in2/p.parquet", "s3://overnight-test/out-sub"
    put_parquet(inp, real_prompts(8))
    r = subprocess.run([*overnight_cmd(), "run", inp, "--out", out, "--model", tiny_model], capture_output=True,
                       text=True, timeout=300, env={**os.environ, **s3_env(s3), **ECHO})
    assert r.returncode == 0, r.stderr[-2000:]
    assert read_parts(out).num_rows == 8


def test_a_full_output_filesystem_stops_cleanly_and_the_rerun_completes(tmp_path, tiny_model):
    # Rows from 60 on carry a 40 kB column, so the parts that hold them exceed a 64 kB file-size limit:
    # the first parts fit, a later one cannot be written, as on a disk that fills up. Ten rows in flight, taken
    # in input order (fifo), finish together (their prompts are as long): each part holds the next ten rows.
    import base64
    n = 120
    pad = ["" if i < 60 else base64.b64encode(os.urandom(30_000)).decode() for i in range(n)]  # incompressible
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [f"r{i:03d}" for i in range(n)], "prompt": [f"q {i}?" for i in range(n)],
                             "pad": pad}), inp)
    out = tmp_path / "out"
    args = [*overnight_cmd(), "run", str(inp), "--out", str(out), "--flush-rows", "10", "--policy", "fifo",
            "--max-num-seqs", "10", "--model", tiny_model]
    env = {**os.environ, **ECHO, "PYTHONDONTWRITEBYTECODE": "1"}

    def tiny_fs():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64_000, 64_000))

    r = subprocess.run(args, capture_output=True, text=True, env=env, preexec_fn=tiny_fs, timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"Error: Cannot write {out}/parts/part-")
    assert last.endswith(".parquet: File too large. Make --out writable or free space there (rows already in "
                         "completed parts are kept; rerun to continue), or choose another --out.")
    files = sorted((out / "parts").iterdir())
    assert files and all(f.name.startswith("part-") for f in files)  # no temporary files left behind
    done = [i for f in files for i in pq.read_table(f).column("id").to_pylist()]  # every part readable
    assert 0 < len(done) < n and len(done) == len(set(done))
    # the counts are the parts': the rows of the part that could not be written are not done
    assert json.loads((out / "manifest.json").read_text())["counts"]["num_done"] == len(done)
    assert json.loads((out / "status.json").read_text())["rows"]["done"] == len(done)

    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    ids = pq.read_table(out / "parts").column("id").to_pylist()
    assert sorted(ids) == [f"r{i:03d}" for i in range(n)]
    assert json.loads((out / "manifest.json").read_text())["counts"]["num_done"] == n
