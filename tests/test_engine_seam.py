"""The seams that scale-out builds on: the engine chosen by config or passed in, its supervisor, and the one
input stage that run, plan and tune share."""

import json

import pyarrow.parquet as pq
import pytest

from fakes import FakeEngine, given
from overnight.pipeline.api import run_job
from overnight.pipeline.config import ConfigError
from overnight.pipeline.configio import env_layer
from overnight.pipeline.engine import EngineError, factory_for
from overnight.pipeline.engine.echo import EchoEngine
from overnight.pipeline.input.source import ParquetSource
from overnight.pipeline.input.stage import open_model, prepare
from overnight.pipeline.scheduling.plan import make_plan


@pytest.fixture
def data(write_parquet):
    return write_parquet({"id": [f"q{i:02d}" for i in range(12)], "prompt": [f"question {i}?" for i in range(12)]})


def test_overnight_engine_is_an_alias_for_engine_kind():
    assert env_layer({}) == {}
    assert env_layer({"OVERNIGHT_ENGINE": "echo"}) == {"engine": {"kind": "echo"}}
    assert env_layer({"OVERNIGHT_ENGINE": "echo:step_ms=20,max_num_seqs=32"}) == {
        "engine": {"kind": "echo", "echo_step_ms": 20.0, "max_num_seqs": 32}}
    with pytest.raises(ConfigError, match="OVERNIGHT_ENGINE is 'gpu'; use echo"):
        env_layer({"OVERNIGHT_ENGINE": "gpu"})
    with pytest.raises(ConfigError, match="unknown setting 'speed'"):
        env_layer({"OVERNIGHT_ENGINE": "echo:speed=3"})
    with pytest.raises(ConfigError, match="sets step_ms to 'fast', which is not a number"):
        env_layer({"OVERNIGHT_ENGINE": "echo:step_ms=fast"})


def test_a_factory_that_hands_back_the_failed_engine_cannot_restart_it(data, tmp_path, cfg):
    with pytest.raises(EngineError, match="handed back the engine that failed; it must start a new one"):
        run_job(cfg(data, tmp_path / "out", engine={"max_restarts": 1}),
                engine_factory=given(FakeEngine(max_num_seqs=2, fail_after_steps=10)), is_tty=False)


def test_engine_kind_echo_from_the_config_alone(data, tmp_path, cfg, monkeypatch):
    monkeypatch.delenv("OVERNIGHT_ENGINE", raising=False)
    c = cfg(data, tmp_path / "out", engine={"kind": "echo", "max_num_seqs": 3})
    assert isinstance(factory_for(c)(type("Job", (), {"cfg": c})()), EchoEngine)
    s = run_job(c, is_tty=False)
    assert (s.state, s.num_ok) == ("completed", 12)
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["config"]["engine"]["kind"] == "echo"
    with pytest.raises(ConfigError, match="engine.kind is 'tpu'; use one of vllm, echo"):
        cfg(data, tmp_path / "x", engine={"kind": "tpu"})


def test_the_factory_gets_the_open_job_and_a_restart_that_fails_is_reported(data, tmp_path, cfg):
    seen = []

    def factory(job):
        seen.append(job.model.path)
        if len(seen) == 1:
            return FakeEngine(max_num_seqs=2, fail_after_steps=3)
        raise RuntimeError("no room for a second engine")

    with pytest.raises(EngineError, match="failed mid-run and could not be restarted \\(no room for a second engine"):
        run_job(cfg(data, tmp_path / "out", engine={"max_restarts": 2}), engine_factory=factory, is_tty=False)
    assert len(seen) == 2 and seen[0].endswith("tiny-model0")
    status = json.loads((tmp_path / "out" / "status.json").read_text())
    assert status["exit_code"] == 69 and status["engine_restarts"] == 1


def test_restarts_stop_at_the_limit(data, tmp_path, cfg, caplog):
    engines = []

    def factory(job):  # every engine dies after 10 steps; rows take 7
        engines.append(FakeEngine(max_num_seqs=2, fail_after_steps=10))
        return engines[-1]

    with pytest.raises(EngineError, match="The vLLM engine failed mid-run \\(RuntimeError: engine died\\).* It was "
                                          "restarted 2 times already \\(--max-engine-restarts 2\\)"):
        run_job(cfg(data, tmp_path / "out", engine={"max_restarts": 2}), engine_factory=factory, is_tty=False)
    assert len(engines) == 3  # the first, and two restarts
    assert "restarting it (2 of 2)" in caplog.text
    done = pq.read_table(tmp_path / "out" / "parts").column("id").to_pylist()
    assert len(done) == len(set(done)) > 0  # what finished before each death is kept, once


def test_run_plan_and_tune_prepare_the_same_rows(write_parquet, tmp_path, cfg):
    inp = write_parquet({"id": ["a", "b", "c", "d", "e", "a"],
                         "prompt": ["short one", "", "a longer question about the weather today", None, "x " * 3000,
                                    "the same id again"]})
    c = cfg(inp, tmp_path / "out")
    model = open_model(c)
    assert (model.chat, model.max_model_len) == (True, 2048)  # the tiny model's template and config.json
    batches = list(prepare(c, ParquetSource(c.input), model))
    rows = [r.id for b in batches for r in b.rows]
    errors = {e.id: e.error for b in batches for e in b.errors}
    assert rows == ["a", "c", "a"] and sorted(errors) == ["b", "d", "e"]  # duplicates are the resume filter's
    assert "max_model_len=2048" in errors["e"]
    # plan counts the same rows, errors and duplicate ids
    p = make_plan(c)
    assert (p.num_todo, p.num_errors, p.num_duplicates) == (2, 3, 1)
    # a run admits exactly the prepared rows
    eng = FakeEngine()
    s = run_job(c, engine_factory=given(eng), is_tty=False)
    assert (s.num_ok, s.num_error, s.num_duplicates) == (2, 3, 1) and len(eng.added) == 2
    # engine.max_model_len narrows the context everywhere
    assert open_model(cfg(inp, tmp_path / "o2", engine={"max_model_len": 64})).max_model_len == 64


def test_tune_on_input_without_a_usable_row_says_why(write_parquet, tmp_path, tiny_model):
    from click.testing import CliRunner

    from overnight.jobs.cli import cli

    inp = write_parquet({"id": ["a", "b"], "prompt": ["", None]})
    res = CliRunner().invoke(cli, ["tune", str(inp), "--model", tiny_model, "--seqs", "4"])
    assert res.exit_code == 1
    assert "No usable rows to measure in the first" in res.output, res.output
    assert "in.parquet#0: prompt column 'prompt' is empty" in res.output, res.output


def test_plan_leaves_what_the_chosen_policy_would_leave(write_parquet, tmp_path, cfg):
    import numpy as np

    from overnight.pipeline.scheduling.plan import run_order

    work = np.array([30.0, 10.0, 20.0])
    assert run_order("auto", work, [0, 0, 0]).tolist() == [1, 2, 0]
    assert run_order("longest-first", work, [0, 0, 0]).tolist() == [0, 2, 1]
    assert run_order("fifo", work, [0, 0, 0]).tolist() == [0, 1, 2]
    assert run_order("priority", work, [5, 1, 5]).tolist() == [1, 0, 2]   # lower first, as the scheduler
    # short and long prompts (the heuristic predicts longer answers to longer instructions), a long one first
    prompts = ["Write a detailed essay about the history of the Roman empire, its rise and its fall."] + \
        ["Say yes."] * 9
    inp = write_parquet({"id": [f"r{i}" for i in range(10)], "prompt": prompts})
    left = {}
    for policy in ("auto", "fifo", "longest-first"):
        c = cfg(inp, tmp_path / "out", buckets={"predictor": "heuristic"}, sampling={"max_tokens": 2000},
                scheduler={"policy": policy, "time_budget": "800s", "safety_margin_s": 0})
        p = make_plan(c, throughput=1.0)   # 800 predicted tokens fit: the essay ~480, a "Say yes." ~250
        left[policy] = p.rows_left
    assert left["auto"] < left["fifo"] <= left["longest-first"], left

