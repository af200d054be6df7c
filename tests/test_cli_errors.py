"""Job-level errors from the real command line: clear messages, no engine start-up paid."""

import os
import subprocess
import time

from conftest import overnight_cmd


def run_cli(*args, timeout=120):
    return subprocess.run([*overnight_cmd(), *map(str, args)], capture_output=True, text=True, timeout=timeout)


def test_job_level_errors_stop_before_the_engine_starts(tmp_path):
    t0 = time.monotonic()
    missing = run_cli("run", tmp_path / "nope.parquet", "--out", tmp_path / "out")
    assert missing.returncode == 1
    assert missing.stderr.strip() == (f"Error: Input {tmp_path / 'nope.parquet'} does not exist. Check the path "
                                      f"(local paths are relative to the current folder; remote ones need a scheme "
                                      f"such as s3://).")
    assert time.monotonic() - t0 < 20  # no engine start-up (~30 s) was paid


def test_hub_id_fails_clearly_when_the_hub_is_unreachable(tmp_path, write_parquet):
    inp = write_parquet({"prompt": ["hi"]})
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    r = subprocess.run([*overnight_cmd(), "run", inp, "--out", str(tmp_path / "o"), "--model",
                        "HuggingFaceTB/SmolLM2-360M-Instruct"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1
    assert r.stderr.startswith("Error: Could not load 'HuggingFaceTB/SmolLM2-360M-Instruct' from the Hugging Face Hub")
    assert "pass its local folder, or use the embedded alias 'smollm2-135m'" in r.stderr


def test_a_job_that_fails_before_its_summary_still_prints_one_json_document(tmp_path, write_parquet):
    import json

    missing = run_cli("run", tmp_path / "nope.parquet", "--out", tmp_path / "out", "--json")
    assert missing.returncode == 1 and missing.stderr.strip().startswith("Error: Input ")
    doc = json.loads(missing.stdout)
    assert doc["state"] == "failed" and doc["exit_code"] == 1 and doc["message"].startswith("Input ")
    bad = run_cli("run", write_parquet({"prompt": ["hi"]}), "--out", tmp_path / "o", "--temperature", "3", "--json")
    assert bad.returncode == 2 and json.loads(bad.stdout)["message"] == (   # an option's bad value: bad usage
        "configuration: --temperature (sampling.temperature) is 3.0; it must be 0 (greedy) to 2.")
    assert json.loads(bad.stdout)["exit_code"] == 2
