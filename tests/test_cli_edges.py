"""The command line and the config at their edges (found by a review, stop 40): a flag over its partner in the
config, a deadline within the safety margin, a signal while the job opens, an OUT that cannot be a folder, a busy
metrics port, a report path that cannot be written, natural YAML times, plan's OUT from the config, durations
named by their flag, --errors outside --format openai, and --limit 0 (the progress line: tests/test_progress.py)."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket

import pytest
from click.testing import CliRunner

from fakes import FakeEngine, given
from overnight.jobs.cli import cli
from overnight.pipeline.api import run_job
from overnight.pipeline.config import ConfigError
from overnight.pipeline.configio import resolve
from overnight.pipeline.output.checkpoint import OutputError


def test_a_flag_overrides_its_partner_in_the_config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("scheduler:\n  deadline: '2099-01-01T06:00'\nsampling:\n  regex: '[0-9]+'\n")
    cfg = resolve({"scheduler": {"time_budget": "1h"}, "sampling": {"choice": ["yes", "no"]}}, str(path))
    assert (cfg.scheduler.deadline, cfg.scheduler.time_budget) == (None, "1h")
    assert (cfg.sampling.regex, cfg.sampling.choice) == (None, ["yes", "no"])
    with pytest.raises(ConfigError, match="either a deadline or a time budget, not both"):   # in one layer: refused
        resolve({"scheduler": {"time_budget": "1h", "deadline": "2099-01-01T06:00"}})


def test_natural_yaml_times_are_read_as_the_flags_are(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("scheduler:\n  deadline: 2099-01-01T06:00:00\n")       # unquoted: YAML's datetime
    assert resolve({}, str(path)).scheduler.deadline == "2099-01-01T06:00:00"
    path.write_text("scheduler:\n  time_budget: 3600\n")
    assert resolve({}, str(path)).scheduler.time_budget == "3600"
    path.write_text("input:\n  prompt_column: 7\n")
    with pytest.raises(ConfigError, match=r"input.prompt_column must be a string, got 7\. Quote it in YAML"):
        resolve({}, str(path))


def test_a_deadline_within_the_safety_margin_is_refused(tmp_path, cfg, write_parquet):
    import datetime as dt

    inp = write_parquet({"id": [1], "prompt": ["a"]})
    soon = (dt.datetime.now() + dt.timedelta(seconds=60)).isoformat(timespec="seconds")
    with pytest.raises(ConfigError, match=r"--deadline .* s away, within the safety margin \(120 s"):
        run_job(cfg(inp, tmp_path / "out", scheduler={"deadline": soon, "safety_margin_s": 120.0}),
                engine_factory=given(FakeEngine()), is_tty=False)


def test_a_signal_while_the_engine_starts_is_said_at_once_and_stops_the_job_once_it_is_up(tmp_path, cfg,
                                                                                          write_parquet, caplog):
    engine = FakeEngine()

    def slow_start(job):   # vLLM's start takes a minute or more; the signal comes during it
        os.kill(os.getpid(), signal.SIGTERM)
        return engine

    inp = write_parquet({"id": [1, 2], "prompt": ["a", "b"]})
    with caplog.at_level("WARNING", logger="overnight"):
        s = run_job(cfg(inp, tmp_path / "out"), engine_factory=slow_start, is_tty=False)
    assert "SIGTERM while the engine starts: the job stops once it is up, before any row runs" in caplog.text
    assert (s.exit_code, s.state, s.num_ok, engine.added) == (75, "interrupted", 0, [])
    assert s.message.startswith("interrupted by SIGTERM while the engine started: 2 rows not done"), s.message


def test_a_signal_while_the_job_opens_stops_it_before_the_engine(tmp_path, cfg, write_parquet, monkeypatch):
    import overnight.pipeline.api as api

    opened = api.open_job

    def open_and_signal(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)       # Airflow's timeout, a pod's eviction: as the tokenizer loads
        return opened(*a, **k)

    def no_engine(*a, **k):
        raise AssertionError("the engine was started")

    def unhandled(signum, frame):  # what SIGTERM met before: the process killed (here, the test failed)
        raise AssertionError("SIGTERM while the job opened was not recorded")

    monkeypatch.setattr(api, "open_job", open_and_signal)
    before = signal.signal(signal.SIGTERM, unhandled)
    inp = write_parquet({"id": [1, 2], "prompt": ["a", "b"]})
    try:
        s = run_job(cfg(inp, tmp_path / "out"), engine_factory=no_engine, is_tty=False)
        assert signal.getsignal(signal.SIGTERM) == unhandled                 # the handler it replaced is back
    finally:
        signal.signal(signal.SIGTERM, before)
    assert (s.exit_code, s.num_ok) == (75, 0) and "interrupted by SIGTERM before the engine started" in s.message
    monkeypatch.undo()
    assert run_job(cfg(inp, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False).num_ok == 2



def test_a_deadline_that_passes_while_the_job_opens_starts_no_engine(tmp_path, cfg, write_parquet, monkeypatch):
    """The stop time came while the job opened (a tokenizer's load, a lock's wait): vLLM is not started, to be
    stopped at once minutes later. Exit 75, nothing lost; a rerun with time answers every row."""
    import time

    from overnight.pipeline import api

    opened = api.open_job

    def slow_open(*a, **k):
        job = opened(*a, **k)
        time.sleep(1.2)
        return job

    def no_engine(*a, **k):
        raise AssertionError("the engine was started")

    monkeypatch.setattr(api, "open_job", slow_open)
    inp = write_parquet({"id": [1, 2], "prompt": ["a", "b"]})
    sched = {"time_budget": "1s", "safety_margin_s": 0}
    s = run_job(cfg(inp, tmp_path / "out", scheduler=sched), engine_factory=no_engine, is_tty=False)
    assert (s.exit_code, s.num_ok) == (75, 0) and "deadline reached before the engine started" in s.message
    monkeypatch.undo()
    assert run_job(cfg(inp, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False).num_ok == 2
    # every row done (a run killed after its last part: the manifest says running), the same slow open: exit 0
    import json

    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    m["state"] = "running"
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(m))
    monkeypatch.setattr(api, "open_job", slow_open)
    s = run_job(cfg(inp, tmp_path / "out", scheduler=sched), engine_factory=no_engine, is_tty=False)
    assert (s.state, s.exit_code, s.num_done) == ("completed", 0, 2)


def test_an_out_that_cannot_be_a_folder_is_named(tmp_path, cfg, write_parquet):
    inp = write_parquet({"id": [1], "prompt": ["a"]})
    with pytest.raises(OutputError, match=r"Output folder .*in.parquet/sub cannot be used \(NotADirectoryError"):
        run_job(cfg(inp, f"{inp}/sub"), engine_factory=given(FakeEngine()), is_tty=False)


def test_a_busy_metrics_port_is_warned_about_and_the_job_goes_on(tmp_path, cfg, write_parquet, caplog):
    busy = socket.socket()
    busy.bind(("", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    inp = write_parquet({"id": [1], "prompt": ["a"]})
    try:
        with caplog.at_level(logging.WARNING, logger="overnight"):
            s = run_job(cfg(inp, tmp_path / "out", output={"metrics_port": port}), engine_factory=given(FakeEngine()),
                        is_tty=False)
    finally:
        busy.close()
    assert s.exit_code == 0 and any(f"--metrics-port {port}: cannot serve metrics" in m for m in caplog.messages)


def test_the_metrics_port_is_free_again_when_the_job_ends(tmp_path, cfg, write_parquet, caplog):
    """Two jobs in one process (a notebook, an Airflow worker) on one --metrics-port: the second serves too (the
    first held the port to the process's end)."""
    s = socket.socket()
    s.bind(("", 0))
    port = s.getsockname()[1]
    s.close()
    inp = write_parquet({"id": [1], "prompt": ["a"]})
    with caplog.at_level(logging.WARNING, logger="overnight"):
        for out in ("a", "b"):
            assert run_job(cfg(inp, tmp_path / out, output={"metrics_port": port}),
                           engine_factory=given(FakeEngine()), is_tty=False).exit_code == 0
    assert not any("cannot serve metrics" in m for m in caplog.messages), caplog.messages
    with socket.socket() as again:   # nothing serves on it now
        assert again.connect_ex(("127.0.0.1", port)) != 0


def test_report_and_export_name_the_path_or_option(tmp_path, cfg, write_parquet):
    from overnight.pipeline.tools.export import export
    from overnight.pipeline.tools.report import build, write

    inp = write_parquet({"id": [1], "prompt": ["a"]})
    out = tmp_path / "out"
    run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    with pytest.raises(OutputError, match=r"--html .*/no/r.html: cannot be written"):
        write(build(str(out)), str(tmp_path / "no" / "r.html"), None)
    with pytest.raises(OutputError, match="--errors is for --format openai"):
        export(str(out), "jsonl", str(tmp_path / "a.jsonl"), str(tmp_path / "e.jsonl"))


def test_plan_reads_out_from_the_config_and_durations_are_named_by_flag(tmp_path, cfg, write_parquet, tiny_model):
    inp = write_parquet({"id": [1, 2], "prompt": ["a", "b"]})
    out = tmp_path / "out"
    run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    path = tmp_path / "c.yaml"
    path.write_text(f"input:\n  path: {inp}\noutput:\n  path: {out}\nengine:\n  model: {tiny_model}\n")
    r = CliRunner().invoke(cli, ["plan", str(path), "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["num_done"] == 2
    r = CliRunner().invoke(cli, ["run", str(inp), "--out", str(tmp_path / "o2"), "--model", tiny_model,
                                 "--engine", "echo", "--grace", "2x"])
    assert r.exit_code != 0 and "--grace '2x' is not a duration" in r.output


def test_limit_zero_says_so(tmp_path, cfg, write_parquet):
    inp = write_parquet({"id": [1, 2], "prompt": ["a", "b"]})
    s = run_job(cfg(inp, tmp_path / "out", input={"limit": 0}), engine_factory=given(FakeEngine()), is_tty=False)
    assert s.exit_code == 0 and s.message == "nothing to do: --limit 0 takes no rows"


def test_policy_priority_without_a_priority_column_says_it_runs_as_fifo(tmp_path, cfg, write_parquet, caplog):
    inp = write_parquet({"id": [1, 2], "prompt": ["a", "b"]})
    with caplog.at_level("WARNING", logger="overnight"):
        run_job(cfg(inp, tmp_path / "out", scheduler={"policy": "priority"}), engine_factory=given(FakeEngine()),
                is_tty=False)
    assert "--policy priority: " in caplog.text and "has no 'priority' column" in caplog.text
    caplog.clear()
    inp = write_parquet({"id": [1, 2], "prompt": ["a", "b"], "priority": [2, 1]}, "p.parquet")
    with caplog.at_level("WARNING", logger="overnight"):
        run_job(cfg(inp, tmp_path / "out2", scheduler={"policy": "priority"}), engine_factory=given(FakeEngine()),
                is_tty=False)
    assert "--policy priority" not in caplog.text


def test_what_a_rerun_cannot_fix_is_bad_usage_and_exits_2(tmp_path, write_parquet, tiny_model):
    # A retry policy (Kubernetes' FailIndex, the Airflow DAG) fails at once on 2, and retries 1: a missing --out, a
    # column or model an option names that is not there, or an OUT of other settings meets the same on every retry.
    inp = write_parquet({"id": ["a", "b"], "prompt": ["x", "y"]})
    out = str(tmp_path / "out")
    base = ["run", str(inp), "--model", tiny_model, "--engine", "echo"]

    def code(*args):
        r = CliRunner().invoke(cli, [*base, *args])
        return r.exit_code, r.output

    assert code("--out", out)[0] == 0
    cases = {"--temperature 0.9": ("--out", out, "--temperature", "0.9"),      # an OUT of other settings
             "no --out": (), "--prompt-column": ("--out", out + "2", "--prompt-column", "text"),
             "--id-column": ("--out", out + "2", "--id-column", "key"),
             "--passthrough": ("--out", out + "2", "--passthrough", "nope"),
             "--model": ("--out", out + "2", "--model", str(tmp_path / "no-model")),
             "--predictor": ("--out", out + "2", "--predictor", str(tmp_path / "no.pt"))}
    for what, args in cases.items():
        rc, said = code(*args)
        assert rc == 2 and said.startswith("Error: "), (what, rc, said)
    # an input that is not there yet (an upstream task still writing it) is retried
    r = CliRunner().invoke(cli, ["run", str(tmp_path / "later.parquet"), "--out", out + "3", "--engine", "echo",
                                 "--model", tiny_model])
    assert r.exit_code == 1 and "does not exist" in r.output


def test_the_echo_engines_rows_are_not_resumed_or_planned_as_a_models(tmp_path, cfg, write_parquet, tiny_model):
    from overnight.pipeline.scheduling.plan import make_plan

    inp = write_parquet({"id": list(range(6)), "prompt": ["hi there"] * 6})
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["run", str(inp), "--out", str(out), "--model", tiny_model, "--engine", "echo",
                                 "--limit", "3"])
    assert r.exit_code == 0, r.output
    with pytest.raises(OutputError, match=r"different settings \(engine: 'echo' -> 'vllm'\)"):
        run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    with pytest.raises(OutputError, match=r"engine: 'echo' -> 'vllm'"):   # plan says so as the run does
        make_plan(cfg(inp, out), out=str(out))
    assert make_plan(cfg(inp, out, engine={"kind": "echo"}), out=str(out)).tokens_per_s > 0
    # an echo OUT written before the engine entered the fingerprint (stop 45): its config says echo
    from overnight.pipeline.output import manifest as mf
    m = json.loads((out / "manifest.json").read_text())
    del m["fingerprint_fields"]["engine"]
    m["fingerprint"] = mf.fingerprint(m["fingerprint_fields"])
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(OutputError, match=r"different settings \(engine: 'echo' -> 'vllm'\)"):
        run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    r = CliRunner().invoke(cli, ["run", str(inp), "--out", str(out), "--model", tiny_model, "--engine", "echo"])
    assert r.exit_code == 0 and "6/6 rows" in r.output, r.output                 # echo resumes echo


def test_two_config_files_and_a_config_files_bad_value_are_named(tmp_path, write_parquet, tiny_model):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("sampling:\n  temperature: 9\n")
    b.write_text("scheduler:\n  deadline: 2020-01-01T00:00\n")
    r = CliRunner().invoke(cli, ["run", str(a), "--config", str(b)])
    assert r.exit_code == 2 and f"INPUT {a} is a config file, and --config {b} is another" in r.output, r.output
    inp = write_parquet({"prompt": ["hi"]})
    r = CliRunner().invoke(cli, ["run", inp, "--out", str(tmp_path / "o"), "--config", str(a), "--model", tiny_model])
    assert r.exit_code == 2 and f"configuration ({a} and the command line): sampling.temperature is 9.0" in r.output
    # a value the command line gave is named by its flag too (plan's --throughput named only the config key), a
    # config file's wrong type is the file's, whatever the command line gave
    a.write_text("sampling:\n  temperature: abc\n")
    r = CliRunner().invoke(cli, ["run", inp, "--out", str(tmp_path / "o"), "--config", str(a), "--temperature", "0.5"])
    assert r.exit_code == 2 and f"{a}: sampling.temperature must be a number, got 'abc'" in r.output, r.output
    r = CliRunner().invoke(cli, ["plan", inp, "--model", tiny_model, "--throughput", "-5"])
    assert r.exit_code == 2 and "--throughput (scheduler.tokens_per_second) is -5.0" in r.output, r.output
    r = CliRunner().invoke(cli, ["run", inp, "--out", str(tmp_path / "o"), "--config", str(b), "--model", tiny_model,
                                 "--engine", "echo"])
    assert r.exit_code == 2 and "--deadline (scheduler.deadline) 2020-01-01T00:00 is in the past" in r.output, r.output


def test_status_json_of_an_out_with_no_job_yet_is_still_one_document(tmp_path):
    r = CliRunner().invoke(cli, ["status", str(tmp_path / "tonight"), "--json"])
    assert r.exit_code == 1 and "Error: Output folder" in r.stderr
    doc = json.loads(r.stdout)
    assert doc["state"] == "missing" and doc["exit_code"] is None and doc["message"].startswith("Output folder")


def test_plan_refuses_an_out_of_other_settings_as_the_run_does(tmp_path, cfg, write_parquet, tiny_model):
    inp = write_parquet({"id": [1, 2, 3], "prompt": ["a", "b", "c"]})
    out = tmp_path / "out"
    run_job(cfg(inp, out, sampling={"max_tokens": 256}), engine_factory=given(FakeEngine()), is_tty=False)
    base = ["plan", str(inp), "--out", str(out), "--model", tiny_model]
    r = CliRunner().invoke(cli, [*base, "--max-tokens", "100"])
    assert r.exit_code == 2 and "(sampling.max_tokens: 256 -> 100)" in r.output and "--out to plan the" in r.output
    r = CliRunner().invoke(cli, [*base, "--max-tokens", "256"])
    assert r.exit_code == 0 and "3 already done" in r.output, r.output


def test_an_unforeseen_fault_still_gives_one_json_document_and_json_log_lines(tmp_path, monkeypatch):
    """A fault no message was written for (a bug): `run --json` still prints one JSON document on stdout, and
    with --log-format json the error and its traceback are one JSON object on stderr (a raw traceback before)."""
    from click.testing import CliRunner

    import overnight.pipeline.api as api
    from overnight.jobs.cli import cli

    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(api, "run_job", boom)
    pq_path = tmp_path / "in.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"id": [1], "prompt": ["a"]}), pq_path)
    args = ["run", str(pq_path), "--out", str(tmp_path / "out"), "--json"]
    r = CliRunner().invoke(cli, ["--log-format", "json", *args])
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    assert doc == {"state": "failed", "exit_code": 1, "message": "RuntimeError: boom"}
    lines = [json.loads(ln) for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[-1]["message"] == "Error: RuntimeError: boom" and "Traceback" in lines[-1]["exception"]
    r = CliRunner().invoke(cli, args)   # as text: the traceback as Python prints it, the document all the same
    assert isinstance(r.exception, RuntimeError) and json.loads(r.stdout)["message"] == "RuntimeError: boom"
