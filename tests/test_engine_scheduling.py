"""Deadlines, plans and predictors through the real vLLM engine with the embedded model."""

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from conftest import real_prompts
from overnight.jobs.cli import cli

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def warm(tmp_path_factory, model_path):
    """Start the module's engine once (a time budget should not pay for the start-up) and leave a finished run."""
    d = tmp_path_factory.mktemp("sched")
    inp = d / "in.parquet"
    # Half the rows are capped at 8 tokens and half at 96, so a short budget finishes a known share (the 8-token
    # rows first under --policy priority, which the timed test gives).
    table = real_prompts(40)
    table = table.append_column("max_tokens", pa.array([8 if i % 2 == 0 else 96 for i in range(40)], pa.int64()))
    table = table.append_column("priority", pa.array([i % 2 for i in range(40)], pa.int64()))
    pq.write_table(table, inp)
    out = d / "first"
    invoke("run", inp, "--out", out)
    yield inp, out
    from overnight.pipeline.engine.vllm import shutdown_engines
    shutdown_engines()


def invoke(*args, code=0):
    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result


def test_tight_time_budget_exits_75_and_the_rerun_completes(warm, tmp_path):
    inp, first = warm
    out = tmp_path / "out"
    args = ["run", inp, "--out", out, "--flush-rows", "5"]
    # A budget the job cannot meet, under load or not: 35% of the time the warm run's rows took (its engine's
    # start not counted), the 8-token rows first (their priority), new rows admitted until half a second before
    # it. On this machine the first 16 were done in 17% of that time, all 20 in 33%, and the 96-token ones, after
    # them, needed the whole time: a run two times slower than the warm one still has rows done, and one two
    # times faster still cannot finish. (60% of the warm run's time in the default order, longest first until at
    # risk, was met on CI: that warm run, beside another worker's engine start, took 1.7 times the second's, and
    # the second finished 40/40 in its drain.)
    took = json.loads((first / "status.json").read_text())["elapsed_s"]
    partial = invoke(*args, "--policy", "priority", "--time-budget", f"{max(1.5, 0.35 * took):.1f}s",
                     "--safety-margin", "0.5", code=75)
    line = partial.output.strip().splitlines()[-1]
    assert line.startswith("overnight: stopped early (resumable): ")
    assert "rows not done; rerun the same command to continue" in line
    done = pq.read_table(out / "parts")
    assert 1 <= done.num_rows < 40
    # a 96-token row done means every 8-token row was done before it
    done_caps = dict(zip(done.column("id").to_pylist(), done.column("max_tokens").to_pylist()))
    if 96 in done_caps.values():
        assert list(done_caps.values()).count(8) == 20, done_caps
    done = done.num_rows
    status = json.loads((out / "status.json").read_text())
    assert status["exit_code"] == 75 and status["state"] == "partial" and status["rows"]["remaining"] == 40 - done
    assert status["forecast"]["deadline"] is not None
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["state"] == "partial"

    full = invoke(*args)
    assert f"40/40 rows (40 ok, 0 error, {done} already done)" in full.output
    ids = pq.read_table(out / "parts").column("id").to_pylist()
    assert len(ids) == 40 == len(set(ids))
    assert sorted(ids) == sorted(pq.read_table(inp).column("id").to_pylist())


def test_plan_uses_measured_throughput_and_judges_the_deadline(warm):
    inp, first = warm
    p = invoke("plan", inp).output
    assert "40 rows: 40 to run, 0 already done, 0 error rows (predictor: online)" in p
    assert "predicted output tokens:" in p and "ETA: unknown" in p
    measured = json.loads((first / "status.json").read_text())["output_tokens_per_s"]
    plan = json.loads(invoke("plan", inp, "--out", first, "--json").output)
    assert plan["num_todo"] == 0 and plan["num_done"] == 40 and plan["tokens_per_s"] == measured
    assert plan["throughput_source"] == f"measured by the last run in {first}"
    # a budget half the predicted time at the measured rate: infeasible on any machine (a fixed 5 s passes where
    # the warm run measured over about 420 tok/s)
    loose = json.loads(invoke("plan", inp, "--throughput", str(measured), "--json").output)
    budget = 0.5 * loose["predicted_tokens"] / measured
    tight = json.loads(invoke("plan", inp, "--throughput", str(measured), "--time-budget", f"{budget:.2f}s",
                              "--json").output)
    assert tight["tokens_per_s"] == measured and tight["is_feasible"] is False
    assert 0 < tight["rows_left"] <= 40
    assert sum(b["num_rows"] for b in tight["buckets"]) == 40
    assert max(b["predicted_tokens"] for b in tight["buckets"]) <= 96 * 40
    assert abs(tight["eta_s"] - tight["predicted_tokens"] / measured) < 1e-6
    text = invoke("plan", inp, "--throughput", "1e9", "--time-budget", "1h").output
    assert ": feasible" in text
    # with rows left to run, the ETA counts the start-up to the first row the real run in --out measured
    grown = first.parent / "grown.parquet"
    table = pq.read_table(inp)
    more = pa.table({"id": [f"more-{i}" for i in range(10)], "prompt": table.column("prompt").slice(0, 10),
                     "max_tokens": pa.array([8] * 10, pa.int64()), "priority": pa.array([0] * 10, pa.int64())})
    pq.write_table(pa.concat_tables([table, more.cast(table.schema)]), grown)
    started = json.loads((first / "status.json").read_text())["startup"]["first_row_s"]
    p = json.loads(invoke("plan", grown, "--out", first, "--json").output)
    assert (p["num_todo"], p["num_done"], p["startup_s"]) == (10, 40, started) and started > 0
    # and the predictions scaled by the actual over predicted output tokens of the 40 rows done there
    assert p["calibration_rows"] == 40 and p["calibration"] > 0
    assert abs(p["eta_s"] - (p["predicted_tokens"] * p["calibration"] / measured + started)) < 1e-6
    # with another predictor than the run's, plan predicts those 40 rows again with it (here the online's prior)
    h = json.loads(invoke("plan", grown, "--out", first, "--predictor", "heuristic", "--json").output)
    assert h["calibration_rows"] == 40 and abs(h["calibration"] - p["calibration"]) < 1e-9


def test_a_resumed_run_learns_lengths_from_the_rows_done_before(warm, tmp_path):
    """The online predictor refits after 256 finished rows, and a resumed run started from the prior again. Now
    it learns from the rows done before: short answers the heuristic puts at the cap are predicted short."""
    asks = ["Say yes.", "Answer with one word: yes or no. Is water wet?", "Reply only with the number 7.",
            "Say hello.", "What is 2 + 2? Answer with the number only."]
    inp = tmp_path / "short.parquet"
    pq.write_table(pa.table({"id": [f"s{i}" for i in range(300)], "prompt": [asks[i % 5] for i in range(300)]}), inp)
    out = tmp_path / "out"
    invoke("run", inp, "--out", out, "--limit", "270", "--max-tokens", "64")
    resumed = invoke("run", inp, "--out", out, "--max-tokens", "64").output
    assert "the length predictor learned from 270 rows done before" in resumed
    t = pq.read_table(out / "parts").to_pydict()
    k = np.asarray([int(i[1:]) for i in t["id"]])
    actual, predicted = np.asarray(t["output_tokens"], float), np.asarray(t["predicted_tokens"], float)
    # each ask's mean answer, against its predictions: the prior's (the first 256 rows, before the first run's
    # refit) and the resumed run's (rows 270-299); on the first try 28 tokens off on average, and 3.5
    typical = np.asarray([actual[k % 5 == a].mean() for a in range(5)])
    off = {name: np.mean([abs(predicted[rows & (k % 5 == a)].mean() - typical[a]) for a in range(5)])
           for name, rows in (("prior", k < 256), ("learned", k >= 270))}
    assert off["learned"] < 0.5 * off["prior"], off


def test_predictor_train_eval_and_run_with_it(warm, tmp_path):
    inp, first = warm
    model = tmp_path / "lengths.pt"
    out = invoke("predictor", "train", first, "--save", model, "--epochs", "20", "--holdout", "0.25").output
    assert "trained on 30 rows" in out and "validation tau" in out and model.exists()
    # beside the words, the embedded model's own token embeddings (read from its weights)
    assert "and smollm2-135m's token embeddings (out-of-fold tau on 30 rows" in out, out
    ev = json.loads(invoke("predictor", "eval", first, "--predictor", model, "--json").output)
    assert ev["num_rows"] == 40 and -1 <= ev["kendall_tau"] <= 1 and ev["mae"] >= 0
    assert ev["predictor"] == f"trained, with the model's token embeddings ({model})"
    stored = invoke("predictor", "eval", first).output
    assert "predictor: stored in the run" in stored and "Kendall's tau:" in stored and "bucket hit rate:" in stored
    heur = json.loads(invoke("predictor", "eval", first, "--predictor", "heuristic", "--json").output)
    assert heur["predictor"] == "heuristic"
    run_out = tmp_path / "with-model"
    invoke("run", inp, "--out", run_out, "--limit", "10", "--predictor", model)
    status = json.loads((run_out / "status.json").read_text())
    assert status["scheduler"]["predictor"] == "trained, with the model's token embeddings"
    # the rows' stored predictions are the file's, token model included
    from overnight.buckets.features import featurize
    from overnight.buckets.trained import TrainedPredictor
    from overnight.pipeline.tools.models import load_tokenizer, resolve
    done = pq.read_table(run_out / "parts").to_pylist()
    p = TrainedPredictor.load(str(model))
    assert p.bind(load_tokenizer(resolve("smollm2-135m"))) is None and p.name == status["scheduler"]["predictor"]
    expect = p.predict(featurize([r["prompt"] for r in done], [r["prompt_tokens"] for r in done],
                                 [r["max_tokens"] for r in done])).tokens
    assert [r["predicted_tokens"] for r in done] == [int(round(x)) for x in expect]
    bad = CliRunner().invoke(cli, ["run", str(inp), "--out", str(tmp_path / "x"),
                                   "--predictor", str(tmp_path / "no.pt")])
    assert bad.exit_code == 2 and f"Predictor file {tmp_path / 'no.pt'} does not exist" in bad.output


@pytest.mark.serial  # timed: alone, after the others (tests/conftest.py)
def test_early_warning_comes_before_five_percent_of_rows(warm, tmp_path, monkeypatch):
    """A budget no CPU here meets: 200 real prompts of up to 256 tokens (about 35,000 output tokens) in 40 s. The
    warning must come before 10 rows (5%) are done, from the step cost and the rows running, and say how many
    rows will be left. It waits until the step cost's fit is trusted (DeadlineTracker.trusts: steps of the full
    engine measured), 13-19 s into the job here; a budget of 20 s, beside two busy loops, stopped the job before
    it (one row done by then). At 128 tokens a faster CPU alone (630 tok/s) nearly met the budget (8-12 rows left),
    and warned only at 94-98 rows, when it was at risk; beside the other test worker (250-340 tok/s) the warning
    expected 55 rows left where 126 were."""
    inp = tmp_path / "in.parquet"
    pq.write_table(real_prompts(200), inp)
    out = tmp_path / "out"
    # The default policy, as the warm run: an engine of another scheduling policy would start within the budget.
    # A two-row job first, so that the engine is running (the tests before may have replaced the module's).
    invoke("run", inp, "--out", tmp_path / "warm", "--limit", "2", "--max-tokens", "4")
    # The ETA shown counts the job's end after the last row (clockwork.FINISH_S); made large here to be seen.
    monkeypatch.setattr("overnight.pipeline.clockwork.FINISH_S", 1000.0)
    result = invoke("run", inp, "--out", out, "--max-tokens", "256", "--time-budget", "40s",
                    code=75)
    timeline = json.loads((out / "timeline.json").read_text())
    warned = [s for s in timeline if s["at_risk"]]
    assert warned, timeline
    assert warned[0]["rows_done"] <= 10, warned[0]
    assert warned[0]["rows_expected_left"] > 0
    ranged = [s for s in timeline if s.get("eta_low_s") is not None]
    assert ranged and all(s["eta_low_s"] >= 1000 and s["eta_s"] >= 1000 for s in ranged), ranged
    assert "deadline at risk" in result.output and "remaining rows to be left undone" in result.output
    # before 256 rows have finished: the online predictor has not learned yet, and the warning says its count may move
    assert "not yet learned from this job" in result.output and "256 rows of this run" in result.output
    done = json.loads((out / "status.json").read_text())["rows"]["done"]
    left = 200 - done
    # what the warning expected against what happened, within a factor of two: the pace at the warning holds only
    # while nothing else runs (alone here: 69-84 expected against 86-101 left in three runs). The 20% target is
    # measured in benchmarks/forecast.py, and checked with a fake clock in tests/test_forecast.py.
    assert 0.5 * left <= warned[0]["rows_expected_left"] <= 2 * left, (warned[0], done)


def forecast_lines(tmp_path, *args, rows: int = 80) -> list[str]:
    """`overnight -v run` over `rows` real prompts (max_tokens 64) into tmp_path/out; its forecasts' debug lines."""
    import logging

    inp = tmp_path / "in.parquet"
    pq.write_table(real_prompts(rows), inp)
    lines = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = Collect(logging.DEBUG)
    logger = logging.getLogger("overnight")
    logger.addHandler(handler)
    try:
        invoke("-v", "run", inp, "--out", tmp_path / "out", "--max-tokens", "64", *args)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.INFO)
    forecasts = [ln for ln in lines if ln.startswith("forecast: step")]
    assert forecasts, lines[-20:]
    return forecasts


@pytest.mark.parametrize("policy", ["longest-first", "fifo"])
def test_forecasts_say_how_they_weighed_the_length_models(warm, tmp_path, policy):
    """Real prompts. Longest predicted first: the forecast fits the square root beside the log ratio and chooses
    the drain's tail of the rows running by likelihood, and weighs nothing else (the log ratio alone). fifo: it
    weighs the log ratio, the normal and the square root, and the tail is the mixture's. Every forecast says so,
    and the run completes with an ETA and its range in the timeline. Which shape wins on 80 short rows is the
    data's (on 120 rows, the square root's tail at none of 6 forecasts in one run, at some in another);
    tests/test_lengths.py checks the choices. Longest predicted first, one admission in eight is a row drawn at
    random (status.json counts them), and the forecasts shift the rows left by what those ran (scheduling/drawn.py);
    fifo draws none. Longest-first runs 160 rows: a shift needs a drawn row finished while rows are still to be
    admitted, and of 80 rows over the engine's 64 slots the last 16 were admitted before the first drawn row finished
    on CI (every forecast said "+0.000 (se 0.000)"). The step cost has its term for the context the sequences hold
    (StepCost.rho), on a CPU on the per-sequence part at the embedded model's attention over its weights."""
    rows = 160 if policy == "longest-first" else 80
    forecasts = forecast_lines(tmp_path, "--policy", policy, rows=rows)
    tails = [ln.rsplit("tail of the rows running: ", 1)[1] for ln in forecasts]
    weights = [re.search(r"lengths weighed ([0-9.]+) normal, ([0-9.]+) square root", ln).groups() for ln in forecasts]
    normal, sqrt = (np.array([float(w[i]) for w in weights]) for i in (0, 1))
    shifts = [re.search(r"rows left shifted ([-+0-9.]+) \(se ([0-9.]+)\) by (\d+) rows drawn", ln).groups()
              for ln in forecasts]
    drawn = json.loads((tmp_path / "out" / "status.json").read_text())["scheduler"]["drawn_at_random"]
    # the tokens to come, split into the rows running, queued in the engine and still to start (what
    # benchmarks/forecast_reread.py scores part by part), add up to the forecast's
    split = [[float(x) for x in re.search(r"(\d+) tokens \(running (\d+), queued (\d+), to start (\d+)\)", ln).groups()]
             for ln in forecasts]
    assert all(abs(total - (r + q + p)) <= 2 for total, r, q, p in split), split
    assert any(r > 0 for _, r, _, _ in split) and any(p > 0 for _, _, _, p in split), split
    # the step cost's term for the context its sequences hold: on this CPU, on the per-sequence part (a step bound by
    # compute), the model's multiply-adds of a context token's attention over a token's through the weights
    # (VllmEngine.context_term, SmolLM2-135M's 2.57e-4 from its config): b0 x rho a token, b0 the per-sequence part
    # the line printed less its context now, b = b0 x (1 + rho x now); the steps to come costed at their rows'
    # context
    context = [[float(x) for x in re.search(r"step [0-9.]+ \+ ([0-9.]+)/seq.*; context ([0-9.e+-]+)/token, (\d+) a "
                                            r"sequence to come \(now (\d+)\)", ln).groups()] for ln in forecasts]
    rho = 2 * 30 * 9 * 64 / 134_479_872
    # as printed: the per-sequence part to 5 decimals (+-5e-6 s), the context cost to 3 digits
    assert all(abs(c - rho * b / (1 + rho * now)) <= rho * 5e-6 + 0.01 * c for b, c, _, now in context if b >= 5e-4), \
        context
    assert any(b >= 5e-4 for b, _, _, _ in context) and any(come > 0 and now > 0 for *_, come, now in context)
    if policy == "longest-first":
        assert set(tails) <= {"square root", "mixture"}
        assert not normal.any() and not sqrt.any()
        assert drawn == rows // 8  # the 8th, 16th, ... admission
        assert any(float(d) != 0 and float(se) > 0 and int(n) > 0 for d, se, n in shifts), shifts
    else:
        assert drawn == 0 and all(s == ("+0.000", "0.000", "0") for s in shifts)
        assert set(tails) == {"mixture"}
        # the log ratio alone (as above) would print 0.00 and 0.00 throughout; 80 rows of up to 64 tokens, beside a
        # busy loop, printed at most 0.75 and 0.21, and 0.77 and 0.19 (120 rows of 96: 0.33-0.64 and 0.11-0.26); it
        # passed twice more on a quiet machine
        assert (normal + sqrt <= 1.005).all() and (normal + sqrt).max() > 0.2 and sqrt.max() > 0, weights
    timeline = json.loads((tmp_path / "out" / "timeline.json").read_text())
    assert any(s.get("eta_low_s") is not None and s["eta_low_s"] <= s["eta_s"] <= s["eta_high_s"] for s in timeline)


def test_shortest_first_draws_rows_and_forecasts_by_them_once_eight_count(warm, tmp_path):
    """Real prompts, shortest predicted first: one admission in eight is a row drawn at random (status.json counts
    them). Until 8 drawn rows count, the forecast weighs the three length models and shifts the rows left as the
    drawn rows say, those still running as "at least" (DrawnRows.censored_shift), once 4 are in; from then on, the
    log ratio alone, shifted by what the drawn rows ran (scheduling/drawn.py), while rows are left to start."""
    rows = 200  # (the shipped example has 200)
    forecasts = forecast_lines(tmp_path, "--policy", "shortest-first", rows=rows)
    drawn = json.loads((tmp_path / "out" / "status.json").read_text())["scheduler"]["drawn_at_random"]
    assert drawn == rows // 8
    seen, early = [], []
    for ln in forecasts:
        normal, sqrt = (float(x) for x in re.search(r"weighed ([0-9.]+) normal, ([0-9.]+) square root", ln).groups())
        shift, se, n, how = re.search(r"rows left shifted ([-+0-9.]+) \(se ([0-9.]+)\) by (\d+) rows drawn at random "
                                      r"\(([^)]*)\)", ln).groups()
        if int(n) < 8:
            censored = int(re.fullmatch(r"(\d+) with those running, as at least", how).group(1))
            if censored < 4:
                assert (shift, se) == ("+0.000", "0.000"), ln
            else:
                early.append(float(se))
        else:
            assert normal == sqrt == 0.0 and how == "those alone", ln
            seen.append(float(shift))
    assert any(x != 0 for x in seen), forecasts[-5:]
    assert early and all(x > 0 for x in early), forecasts[:10]


def test_a_trained_predictor_run_longest_first_is_forecast_by_the_sqrt_ratio(warm, tmp_path):
    """A trained predictor's predictions are calibrated: run longest predicted first, every forecast takes the
    rows' lengths from the sqrt ratio alone (tests/test_lengths.py checks the model; benchmarks/forecast.py with
    benchmarks/heldout_predictor.py measures it), and the run completes with an ETA and its range."""
    _, first = warm
    model = tmp_path / "lengths.pt"
    invoke("predictor", "train", first, "--save", model, "--holdout", "0")
    forecasts = forecast_lines(tmp_path, "--policy", "longest-first", "--predictor", model)
    tails = {ln.rsplit("tail of the rows running: ", 1)[1] for ln in forecasts}
    assert tails == {"sqrt ratio (calibrated predictions)"}, tails
    timeline = json.loads((tmp_path / "out" / "timeline.json").read_text())
    assert any(s.get("eta_low_s") is not None and s["eta_low_s"] <= s["eta_s"] <= s["eta_high_s"] for s in timeline)
    status = json.loads((tmp_path / "out" / "status.json").read_text())
    assert status["rows"]["done"] == 80 and status["scheduler"]["predictor"].startswith("trained")


def test_tune_tiny_grid_writes_a_preset(warm, tmp_path):
    """Last in the module: tune starts an engine for each point of its grid, and the runs before reuse theirs
    (vLLM's priority scheduler's, for the default and priority policies, then its fcfs one, for longest-first
    and fifo) rather than start one again after it."""
    inp, _ = warm
    preset = tmp_path / "tuned.yaml"
    out = invoke("tune", inp, "--seqs", "4,8", "--batched-tokens", "2048", "--sample", "8", "--max-tokens", "16",
                 "--save", preset).output
    assert out.count("output tok/s (KV cache") == 2
    assert "best: max_num_batched_tokens=2048 max_num_seqs=" in out
    from overnight.pipeline.configio import build, load_yaml
    cfg = build(load_yaml(str(preset)), source=str(preset))
    assert cfg.engine.max_num_seqs in (4, 8) and cfg.scheduler.tokens_per_second > 0
