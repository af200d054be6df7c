"""A resumed run's online predictor learns from the rows done before (pipeline/input/done_rows.py)."""

import logging

import pyarrow.parquet as pq

from fakes import FakeEngine, given
from overnight.pipeline.api import run_job


def resumed_ratio(out, first: int) -> float:
    """Actual over predicted output tokens of the rows the resumed run answered."""
    t = pq.read_table(out / "parts").to_pydict()
    later = [i for i, row_id in enumerate(t["id"]) if row_id >= first]
    return sum(t["output_tokens"][i] for i in later) / sum(t["predicted_tokens"][i] for i in later)


def test_a_resumed_runs_online_predictor_learns_from_the_rows_done_before(tmp_path, cfg, write_parquet, caplog):
    """The echo's answers run 3-7 tokens, far under the heuristic's predictions; the online predictor learns
    their level after 256 finished rows. A run resumed after 300 rows started from the prior again: its rows
    went in at the prior's predictions until 256 more had finished."""
    inp = write_parquet({"id": list(range(420)), "prompt": [f"question {i} " + "word " * (i % 9) for i in range(420)]})
    caplog.set_level(logging.INFO, logger="overnight")
    ratios = {}
    for done in (100, 300):  # under the 256 rows it refits at, and over
        out = tmp_path / f"out{done}"
        run_job(cfg(inp, out, input={"limit": done}), engine_factory=given(FakeEngine()), is_tty=False)
        caplog.clear()
        s = run_job(cfg(inp, out, input={"limit": done + 60}), engine_factory=given(FakeEngine()), is_tty=False)
        assert s.num_resumed == done and s.num_ok == done + 60
        ratios[done] = resumed_ratio(out, done)
        learned = f"the length predictor learned from {done} rows done before"
        assert learned in caplog.text
    assert ratios[100] < 0.3            # the prior's predictions: no model to go by
    assert 0.5 < ratios[300] < 2.0      # the model learned from the 300 rows done before


def test_a_run_that_cannot_learn_from_the_rows_done_goes_on_from_the_prior(tmp_path, cfg, write_parquet, caplog,
                                                                           monkeypatch):
    from overnight.pipeline.input import done_rows

    def broken(*args, **kwargs):
        raise OSError("the parts cannot be read")

    monkeypatch.setattr(done_rows, "done_lengths", broken)
    inp = write_parquet({"id": list(range(40)), "prompt": [f"question {i}" for i in range(40)]})
    out = tmp_path / "out"
    run_job(cfg(inp, out, input={"limit": 20}), engine_factory=given(FakeEngine()), is_tty=False)
    caplog.set_level(logging.WARNING, logger="overnight")
    s = run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    assert s.num_ok == 40 and s.num_resumed == 20
    assert ("the length predictor could not learn from the rows done before (OSError: the parts cannot be read); "
            "it starts from its prior") in caplog.text


def test_a_rerun_that_finds_every_row_done_does_not_learn(tmp_path, cfg, write_parquet, caplog, monkeypatch):
    """The rows done are learned from only once a row is left to answer: at 10M rows done, the query over their
    parts would slow a rerun that has nothing to do."""
    import os

    from overnight.pipeline.input import done_rows

    inp = write_parquet({"id": list(range(30)), "prompt": [f"question {i}" for i in range(30)]})
    out = tmp_path / "out"
    run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    asked = []
    monkeypatch.setattr(done_rows, "warm_start", lambda *args, **kwargs: asked.append(1) or 0)
    os.utime(inp, (1, 1))  # not the stamp it ran on: the rerun reads the parts and the input
    s = run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    assert s.num_resumed == 30 and not asked
    run_job(cfg(write_parquet({"id": list(range(31)), "prompt": [f"question {i}" for i in range(31)]}), out),
            engine_factory=given(FakeEngine()), is_tty=False)
    assert asked == [1]  # one row left: now it learns


def test_the_engine_starts_while_the_predictor_learns(tmp_path, cfg, write_parquet, monkeypatch):
    """The learning (at 10M rows done, a query over all their parts) runs in the reader's thread beside the
    engine's start, not before it: here it holds on until the engine has started, and would wait in vain if the
    engine started only after it."""
    import threading

    from overnight.pipeline.input import done_rows

    inp = write_parquet({"id": list(range(40)), "prompt": [f"question {i}" for i in range(40)]})
    out = tmp_path / "out"
    run_job(cfg(inp, out, input={"limit": 20}), engine_factory=given(FakeEngine()), is_tty=False)
    started, overlapped = threading.Event(), []
    learn = done_rows.warm_start
    monkeypatch.setattr(done_rows, "warm_start",
                        lambda *a, **k: overlapped.append(started.wait(timeout=120)) or learn(*a, **k))

    def factory(job):
        started.set()
        return FakeEngine()

    s = run_job(cfg(inp, out), engine_factory=factory, is_tty=False)
    assert s.num_ok == 40 and s.num_resumed == 20
    assert overlapped == [True]
