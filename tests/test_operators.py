"""For the people who run it: JSON log lines, Prometheus metrics, `overnight report` (its HTML rendered in
headless Chromium where the machine has it), through the command a user runs, with the echo engine."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import overnight_cmd

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def write_input(folder: Path, files: int = 3, rows: int = 60) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        ids = [f"f{f}-{i}" for i in range(rows)]
        prompts = [("word " * (i % 9 + 1)) + f"{f} {i}" if i % 17 else None for i in range(rows)]  # some errors
        pq.write_table(pa.table({"id": ids, "prompt": prompts}), folder / f"p{f}.parquet")
    return folder


def overnight(*args, check=True, **kw):
    done = subprocess.run([*overnight_cmd(), *args], capture_output=True, text=True, timeout=300, **kw)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_log_format_json_puts_one_object_on_each_stderr_line(tmp_path, tiny_model):
    inp = write_input(tmp_path / "in")
    done = overnight("--log-format", "json", "run", str(inp), "--out", str(tmp_path / "out"), "--engine", "echo",
                     "--echo-step-ms", "20", "--max-num-seqs", "8", "--log-every", "0.5", "--model", tiny_model)
    lines = [json.loads(ln) for ln in done.stderr.splitlines() if ln.strip()]
    assert lines and all({"time", "level", "message"} <= set(d) for d in lines)
    progress = [d for d in lines if "counters" in d]
    assert progress and progress[-1]["counters"]["rows_total"] == 180
    assert done.stdout.startswith("overnight: done:")   # stdout keeps the summary
    failed = overnight("--log-format", "json", "run", str(inp), "--out", str(tmp_path / "out2"), "--engine", "echo",
                       "--temperature", "9", "--model", tiny_model, check=False)   # its error line too
    assert failed.returncode == 2   # a bad option's value: bad usage
    assert [json.loads(ln)["message"] for ln in failed.stderr.splitlines() if ln.strip()] == [
        "Error: configuration: --temperature (sampling.temperature) is 9.0; it must be 0 (greedy) to 2."]
    for args, code, message in [(("status", str(tmp_path / "nope")), 1, "Error: Output folder "),
                                (("bogus",), 2, "Error: No such command 'bogus'.")]:  # other commands' errors too
        other = overnight("--log-format", "json", *args, check=False)
        lines = [json.loads(ln) for ln in other.stderr.splitlines() if ln.strip()]
        assert other.returncode == code and len(lines) == 1 and lines[0]["message"].startswith(message), other.stderr
    usage = overnight("--log-format", "json", "run", str(inp), "--out", str(tmp_path / "out3"), "--policy", "soon",
                      "--json", check=False)   # a usage error: a JSON line on stderr, and run --json's document
    assert usage.returncode == 2
    assert [json.loads(ln)["message"] for ln in usage.stderr.splitlines() if ln.strip()] == [
        "Error: Invalid value for '--policy': 'soon' is not one of 'auto', 'fifo', 'longest-first', "
        "'shortest-first', 'priority'."]
    assert json.loads(usage.stdout) == {"state": "failed", "exit_code": 2,
                                        "message": json.loads(usage.stderr)["message"][len("Error: "):]}


def test_metrics_file_in_prometheus_text_format(tmp_path, tiny_model):
    from prometheus_client.parser import text_string_to_metric_families

    metrics = tmp_path / "overnight.prom"
    inp = write_input(tmp_path / "in")
    overnight("run", str(inp), "--out", str(tmp_path / "out"), "--engine", "echo", "--model", tiny_model,
              "--metrics-file", str(metrics), "--time-budget", "1h", "--flush-rows", "20")
    samples = {(s.name, s.labels.get("state")): s.value
               for fam in text_string_to_metric_families(metrics.read_text()) for s in fam.samples}
    assert samples[("overnight_rows", "done")] == 180 and samples[("overnight_rows", "remaining")] == 0
    assert samples[("overnight_rows", "error")] == 12   # rows 0, 17, 34, 51 of each file have no prompt
    assert samples[("overnight_state", "completed")] == 1 and samples[("overnight_exit_code", None)] == 0
    assert samples[("overnight_engine_restarts", None)] == 0
    assert 0 < samples[("overnight_deadline_slack_seconds", None)] <= 3600
    assert samples[("overnight_output_tokens_per_second", None)] > 0
    # a rerun with nothing to do writes the file too (an earlier attempt's stayed as it was)
    metrics.write_text("stale\n")
    overnight("run", str(inp), "--out", str(tmp_path / "out"), "--engine", "echo", "--model", tiny_model,
              "--metrics-file", str(metrics))
    samples = {(s.name, s.labels.get("state")): s.value
               for fam in text_string_to_metric_families(metrics.read_text()) for s in fam.samples}
    assert samples[("overnight_rows", "done")] == 180 and samples[("overnight_state", "completed")] == 1
    # a run that fails before its job opens says so there too (the file said the last run's "completed, exit 0")
    for extra, code in ((["--temperature", "0.3"], 2), (["--prompt-column", "nope"], 2)):
        done = overnight("run", str(inp), "--out", str(tmp_path / "out"), "--engine", "echo", "--model", tiny_model,
                         "--metrics-file", str(metrics), *extra, check=False)
        samples = {(s.name, s.labels.get("state")): s.value
                   for fam in text_string_to_metric_families(metrics.read_text()) for s in fam.samples}
        assert done.returncode == code and samples[("overnight_state", "failed")] == 1, done.stderr[-2000:]
        assert samples[("overnight_exit_code", None)] == code and samples[("overnight_state", "completed")] == 0
        metrics.write_text("stale\n")
    done = overnight("run", str(tmp_path / "missing.parquet"), "--out", str(tmp_path / "out"), "--engine", "echo",
                     "--model", tiny_model, "--metrics-file", str(metrics), check=False)
    assert done.returncode == 1 and "overnight_exit_code" in metrics.read_text()


def test_report_of_a_sharded_job_with_every_plot(tmp_path, tiny_model):
    inp = write_input(tmp_path / "in")
    out = tmp_path / "out"
    for k in range(3):
        overnight("run", str(inp), "--out", str(out), "--engine", "echo", "--echo-step-ms", "10", "--model",
                  tiny_model, "--shard", f"{k}/3", "--time-budget", "10m")
    html_path, png_dir = tmp_path / "report.html", tmp_path / "png"
    overnight("report", str(out), "--html", str(html_path), "--png", str(png_dir))
    text = html_path.read_text()
    images = re.findall(r"src='data:image/png;base64,([^']+)'", text)
    names = sorted(p.stem for p in png_dir.glob("*.png"))
    assert names == sorted(["progress", "forecast", "lengths", "buckets", "latency", "errors"])
    assert len(images) == len(names)
    for data in images:
        png = base64.b64decode(data)
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000
    assert "http" not in text.replace("http-equiv", "")      # nothing to fetch: it opens offline
    assert "Kendall&#x27;s tau" in text or "Kendall's tau" in text
    assert "<th>cost</th><td>" in text and "engine-hours" in text
    assert "empty prompt" in text or "error" in text
    for lane in ("0/3", "1/3", "2/3"):   # one lane per shard in the progress plot's legend is drawn from these
        assert (out / "shards" / f"0000{lane[0]}-of-00003" / "timeline.json").exists()
    if CHROMIUM:
        _renders_in_chromium(html_path, len(images), tmp_path)


def _renders_in_chromium(html_path: Path, n: int, tmp_path: Path) -> None:
    """Every plot decodes and lays out in a real browser: the page reports its loaded images in its title."""
    probe = tmp_path / "probe.html"
    probe.write_text(html_path.read_text().replace(
        "</body>", "<script>window.onload=()=>{document.title='loaded '+[...document.images].filter("
                   "i=>i.complete&&i.naturalWidth>100).length}</script></body>"))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'chromium'}", "--virtual-time-budget=5000"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", probe.as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    assert f"<title>loaded {n}</title>" in dom


def test_metrics_port_serves_while_the_job_runs(tmp_path, tiny_model):
    import socket
    import time
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    inp = write_input(tmp_path / "in")
    proc = subprocess.Popen([*overnight_cmd(), "run", str(inp), "--out", str(tmp_path / "out"), "--engine", "echo",
                             "--echo-step-ms", "50", "--max-num-seqs", "4", "--flush-rows", "4", "--model",
                             tiny_model, "--metrics-port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    body, deadline = "", time.time() + 120
    while time.time() < deadline and 'state="done"' not in body:
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        except OSError:
            time.sleep(0.3)
    proc.terminate()
    proc.communicate(timeout=120)
    assert 'overnight_rows{job=' in body and 'overnight_state{job="' in body
    assert 'state="running"} 1.0' in body    # scraped mid-run


def test_a_failure_after_the_job_wrote_its_metrics_leaves_them(tmp_path):
    """A job that failed mid-run wrote its metrics (its rows and tokens, state failed): the command's own failed
    metrics are for a run that wrote none (they replaced that file with two lines and 0 rows)."""
    import time

    from overnight.jobs.run import failed_metrics
    from overnight.pipeline.configio import resolve
    from overnight.pipeline.input.source import InputError
    from overnight.pipeline.output.metrics import Metrics

    metrics = tmp_path / "job.prom"
    cfg = resolve({"input": {"path": str(tmp_path / "in.parquet")},
                   "output": {"path": str(tmp_path / "out"), "metrics_file": str(metrics)}})
    began = time.time()
    Metrics(str(metrics), None, "job").update({"state": "failed", "exit_code": 1, "rows": {"done": 3000}})
    failed_metrics(cfg, InputError("row group 6 cannot be read"), 1, began)
    assert 'state="done"} 3000.0' in metrics.read_text()
    failed_metrics(cfg, InputError("gone"), 1, time.time() + 1)   # written by an earlier run: replaced
    assert 'state="done"' not in metrics.read_text() and 'state="failed"} 1.0' in metrics.read_text()
