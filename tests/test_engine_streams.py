"""Clean streams with the real engine, through the command a user runs: stdout is exactly the summary (one
JSON document with --json), stderr holds overnight's own lines and no library noise unless -v."""

from __future__ import annotations

import json
import os
import subprocess

import duckdb
import pyarrow.parquet as pq
import pytest

from conftest import overnight_cmd, real_prompts

pytestmark = pytest.mark.engine

def fresh_env() -> dict:
    """The environment of a user's shell: without the logging settings that an engine started earlier in this
    pytest process put there (vLLM's level is set where it is unset, and a child inherits it)."""
    from overnight.pipeline.streams import QUIET_ENV

    drop = {*QUIET_ENV, "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM"}
    return {k: v for k, v in os.environ.items() if k not in drop}


NOISE = ("Triton is installed", "Loading safetensors", "libtcmalloc", "Passing raw prompts", "FutureWarning",
         "WARNING", "NUMA binding")


def test_json_stdout_and_quiet_stderr_with_the_real_engine(tmp_path, model_path):
    inp = tmp_path / "in.parquet"
    pq.write_table(real_prompts(6), inp)
    args = ["run", str(inp), "--max-tokens", "8", "--kv-cache-space", "1", "--json"]
    metrics = tmp_path / "job.prom"
    quiet = subprocess.run([*overnight_cmd(), *args, "--out", str(tmp_path / "a"), "--metrics-file", str(metrics)],
                           capture_output=True, text=True, timeout=600, env=fresh_env())
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    summary = json.loads(quiet.stdout)            # stdout is one JSON document and nothing else
    assert summary["state"] == "completed" and summary["num_ok"] == 6
    lines = [ln for ln in quiet.stderr.splitlines() if ln.strip()]
    assert lines and all(" overnight " in ln for ln in lines), quiet.stderr   # only overnight's own lines
    assert not [n for n in NOISE if n in quiet.stderr]
    assert 'overnight_rows{job="' in metrics.read_text() and 'state="completed"} 1.0' in metrics.read_text()
    # the report of the real run: every plot, embedded
    report = subprocess.run([*overnight_cmd(), "report", str(tmp_path / "a"), "--html", str(tmp_path / "r.html")],
                            capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr
    assert (tmp_path / "r.html").read_text().count("data:image/png;base64,") == 6
    # each row's share of the engine's time, and the job's engine-hours and cost
    shares = [r[0] for r in duckdb.sql(f"select engine_seconds from read_parquet('{tmp_path}/a/parts/part-*.parquet')"
                                       ).fetchall()]
    assert len(shares) == 6 and all(x > 0 for x in shares) and sum(shares) <= summary["elapsed_s"]
    costed = subprocess.run([*overnight_cmd(), "inspect", str(tmp_path / "a"), "--price-per-hour", "2"],
                            capture_output=True, text=True, timeout=300)
    assert "engine time:" in costed.stdout and "at 2 per hour:" in costed.stdout
    # OpenAI Batch output lines of the real run, read with OpenAI's own types
    from openai.types.chat import ChatCompletion

    exported = subprocess.run([*overnight_cmd(), "export", str(tmp_path / "a"), "--format", "openai", "--output",
                               str(tmp_path / "openai.jsonl")], capture_output=True, text=True, timeout=300)
    assert exported.returncode == 0, exported.stderr
    lines = [json.loads(x) for x in (tmp_path / "openai.jsonl").read_text().splitlines()]
    assert len(lines) == 6
    assert all(ChatCompletion.model_validate(x["response"]["body"]).choices[0].message.content for x in lines)

    # -v, with --log-format json: vLLM's own lines are back, and each stderr line is a JSON object, the engine's
    # processes' own lines too
    loud = subprocess.run([*overnight_cmd(), "-v", "--log-format", "json", *args, "--out", str(tmp_path / "b")],
                          capture_output=True, text=True, timeout=600, env=fresh_env())
    assert loud.returncode == 0, loud.stderr[-3000:]
    assert json.loads(loud.stdout)["num_ok"] == 6  # -v changes stderr only
    logged = [json.loads(ln) for ln in loud.stderr.splitlines() if ln.strip()]
    text = "\n".join(d["message"] for d in logged)
    assert "INFO" in text and any(n in text for n in NOISE[:3])   # vLLM's own lines are back
    assert {"overnight", "engine"} <= {d["logger"] for d in logged}
