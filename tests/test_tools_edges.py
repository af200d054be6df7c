"""The commands around a run at their edges (found by a review, stop 40): predictor train on a prompt column named
like a result column, on n > 1 runs, on too few rows or rows of one length, on an OUT with no part yet, a --save
that cannot be written; inspect --sql that returns nothing, and its JSON."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from fakes import FakeEngine, given
from overnight.jobs.cli import cli
from overnight.pipeline.api import run_job


def _texts_learned(monkeypatch, out) -> list:
    import overnight.buckets.dataset as dataset

    seen = []
    featurize = dataset.featurize

    def spy(texts, *a, **k):
        seen.extend(texts)
        return featurize(texts, *a, **k)

    monkeypatch.setattr(dataset, "featurize", spy)
    data = dataset.load_outputs([str(out)])
    return seen, data


def test_a_prompt_column_named_text_is_learned_from_not_the_answers(tmp_path, cfg, write_parquet, monkeypatch):
    prompts = [f"question {i}" for i in range(10)]
    inp = write_parquet({"id": list(range(10)), "text": prompts})
    out = tmp_path / "out"
    run_job(cfg(inp, out, input={"prompt_column": "text"}), engine_factory=given(FakeEngine()), is_tty=False)
    assert json.loads((out / "manifest.json").read_text())["input"]["renamed"] == {"text": "input_text"}
    seen, _ = _texts_learned(monkeypatch, out)
    assert sorted(seen) == sorted(prompts)                     # not "echo of N prompt tokens"


def test_n_samples_train_once_per_row(tmp_path, cfg, write_parquet, monkeypatch):
    inp = write_parquet({"id": list(range(10)), "prompt": [f"say {i}" for i in range(10)]})
    out = tmp_path / "out"
    run_job(cfg(inp, out, sampling={"n": 3, "temperature": 0.7}), engine_factory=given(FakeEngine()), is_tty=False)
    _, data = _texts_learned(monkeypatch, out)
    assert len(data) == 10                                     # its samples would sit on both sides of a split


def test_a_prompt_in_two_runs_is_trained_on_once(tmp_path, cfg, write_parquet):
    """The same prompts run again into another OUT (or one OUT given twice) would sit on both sides of the holdout
    split and of the folds: the cross-validated tau of a run and its copy was 0.77 against 0.24 for the run alone.
    Each prompt is learned from once, its latest row; the report is the run's own."""
    inp = write_parquet({"id": list(range(40)), "prompt": [f"say {i} " * (i % 9 + 1) for i in range(40)]})
    for name in ("a", "b"):
        run_job(cfg(inp, tmp_path / name), engine_factory=given(FakeEngine(length_of=lambda ids: 1 + len(ids) * 3 % 17)),
                is_tty=False)

    def train(*outs):
        r = CliRunner().invoke(cli, ["predictor", "train", *map(str, outs), "--save", str(tmp_path / "p.npz"),
                                     "--no-embeddings"])
        assert r.exit_code == 0, r.output
        return r.output

    alone = train(tmp_path / "a")
    assert alone.startswith("trained on 32 rows") and "on 8 held-out rows" in alone
    for outs in ((tmp_path / "a", tmp_path / "b"), (tmp_path / "a", tmp_path / "a")):
        twice = train(*outs)
        assert twice.startswith("40 rows left out: their prompts come again in a later row")
        assert twice.splitlines()[1].startswith("trained on 32 rows") and "on 8 held-out rows" in twice


def test_a_holdout_that_leaves_too_few_rows_to_train_on_is_refused(tmp_path, cfg, write_parquet):
    inp = write_parquet({"id": list(range(10)), "prompt": [f"say {i} " * (i + 1) for i in range(10)]})
    run_job(cfg(inp, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    r = CliRunner().invoke(cli, ["predictor", "train", str(tmp_path / "out"), "--save", str(tmp_path / "p.npz"),
                                 "--no-embeddings", "--holdout", "0.9"])
    assert r.exit_code == 1 and "--holdout 0.9 leaves 1 of 10 rows to train on, too few (at least 8)" in r.output
    assert not (tmp_path / "p.npz").exists()


def test_predictor_train_refuses_what_cannot_teach_lengths(tmp_path, cfg, write_parquet):
    few = write_parquet({"id": list(range(5)), "prompt": [f"say {i}" for i in range(5)]}, "few.parquet")
    run_job(cfg(few, tmp_path / "few"), engine_factory=given(FakeEngine()), is_tty=False)
    r = CliRunner().invoke(cli, ["predictor", "train", str(tmp_path / "few"), "--save", str(tmp_path / "p.npz"),
                                 "--no-embeddings"])
    assert r.exit_code == 1 and "5 finished ok rows are too few to train on (at least 8)" in r.output
    flat = write_parquet({"id": list(range(20)), "prompt": [f"say {i}" for i in range(20)]}, "flat.parquet")
    run_job(cfg(flat, tmp_path / "flat", sampling={"max_tokens": 1}), engine_factory=given(FakeEngine()),
            is_tty=False)
    r = CliRunner().invoke(cli, ["predictor", "train", str(tmp_path / "flat"), "--save", str(tmp_path / "p.npz"),
                                 "--no-embeddings"])
    assert r.exit_code == 1 and "every row has the same output length (1 tokens)" in r.output
    assert not (tmp_path / "p.npz").exists()


def test_predictor_train_names_a_save_path_it_cannot_write_and_an_out_without_parts(tmp_path, cfg, write_parquet):
    inp = write_parquet({"id": list(range(20)), "prompt": [f"say {i} " * (i % 7 + 1) for i in range(20)]})
    run_job(cfg(inp, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    r = CliRunner().invoke(cli, ["predictor", "train", str(tmp_path / "out"), "--save", str(tmp_path),
                                 "--no-embeddings"])
    assert r.exit_code == 2 and f"Invalid value for --save: {tmp_path} cannot be written: it is a folder" in r.output
    for part in (tmp_path / "out" / "parts").glob("*.parquet"):
        part.unlink()                                          # as if killed before its first part
    r = CliRunner().invoke(cli, ["predictor", "train", str(tmp_path / "out"), "--save", str(tmp_path / "p.npz"),
                                 "--no-embeddings"])
    assert r.exit_code == 1 and "has no finished rows yet" in r.output


def test_inspect_sql_that_returns_nothing_and_its_json(tmp_path, cfg, write_parquet):
    inp = write_parquet({"id": [1], "prompt": ["a"]})
    run_job(cfg(inp, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    r = CliRunner().invoke(cli, ["inspect", str(tmp_path / "out"), "--sql", "-- only a comment"])
    assert (r.exit_code, r.output) == (0, "")
    r = CliRunner().invoke(cli, ["inspect", str(tmp_path / "out"), "--format", "json", "--sql",
                                 "select 'nan'::double as x, 1 as a, 2 as a, 1.5 as d"])
    assert r.exit_code == 0 and json.loads(r.output) == [{"x": None, "a": 1, "a_1": 2, "d": 1.5}]
    # csv: a nested value as JSON and bytes as base64, as export --format csv writes them (not Python's repr)
    r = CliRunner().invoke(cli, ["inspect", str(tmp_path / "out"), "--format", "csv", "--sql",
                                 "select {'k': ['nan'::double, 2]} as s, ['x'] as l, '\\x00'::blob as b"])
    assert r.exit_code == 0 and r.output.splitlines() == ['s,l,b', '"{""k"": [null, 2.0]}","[""x""]",AA==']


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OVERNIGHT_HOME", str(tmp_path / "home"))


def test_predictor_eval_of_a_job_completed_with_no_rows_says_so(tmp_path, cfg, write_parquet):
    import pyarrow as pa

    inp = write_parquet({"id": pa.array([], pa.string()), "prompt": pa.array([], pa.string())})
    run_job(cfg(inp, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    r = CliRunner().invoke(cli, ["predictor", "eval", str(tmp_path / "out"), "--predictor", "heuristic"])
    assert r.exit_code == 1 and "holds no rows: its job completed with none" in r.output, r.output


def test_a_jsonl_job_with_no_part_yet_has_sample_index_and_logprobs(tmp_path, cfg):
    """A JSONL job's output always has both columns (its request lines may ask n and logprobs); so does its
    results view before the first part is written (a query naming them was a Binder Error)."""
    from openai_lines import chat, write_lines
    from overnight.pipeline.tools.inspection import open_results

    path = write_lines(tmp_path / "requests.jsonl", [chat("a"), chat("b")])
    out = tmp_path / "out"
    run_job(cfg(path, out), engine_factory=given(FakeEngine()), is_tty=False)
    for part in (out / "parts").glob("*.parquet"):   # as if the job had been stopped before its first flush
        part.unlink()
    con, _ = open_results(str(out))
    assert con.execute("select count(*), count(sample_index), count(logprobs) from results").fetchone() == (0, 0, 0)


def test_inspect_groups_errors_that_differ_only_in_their_numbers(tmp_path, cfg, write_parquet):
    from overnight.pipeline.tools.inspection import open_results, summary_lines

    inp = write_parquet({"id": [f"r{i}" for i in range(9)], "prompt": ["hi"] * 9,
                         "max_tokens": [-1, -2, -3, -4, -5, -6, 4, 4, 4],
                         "temperature": [0.5] * 6 + [9.0, 0.5, 0.5]})
    run_job(cfg(inp, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    con, m = open_results(str(tmp_path / "out"))
    lines = summary_lines(con, m)
    errors = lines[lines.index("most common errors:") + 1:]
    assert len(errors) == 2, errors
    assert errors[0].startswith("  6 x max_tokens is -") and errors[0].endswith("(and 5 like it, with other numbers)")
    assert errors[1].startswith("  1 x temperature is 9.0")


def test_inspect_tables_line_up_with_wide_characters():
    """A CJK character takes two columns of a terminal: cells are padded and cut by the columns they take."""
    from overnight.pipeline.tools.inspection import _width, render

    lines = render(["id", "text"], [("a", "plain"), ("日本", "x"), ("b", "日本語" * 40)], max_width=20).splitlines()
    header, rule, rows = lines[0], lines[1], lines[2:5]
    assert rule == "----  " + "-" * 19                       # 日本 takes 4 columns; the cut text 16 + "..."
    at = [_width(ln[:ln.index(t)]) for ln, t in zip([header, *rows], ["text", "plain", "x", "日本語"])]
    assert at == [6, 6, 6, 6]                                   # the text column starts at one place in every row
    assert rows[2].endswith("...") and _width(rows[2]) == 25
    assert render(["t"], [("abc" * 100,)], max_width=20).splitlines()[2] == "abc" * 5 + "ab..."


def test_predictor_eval_of_the_stored_predictions_needs_no_prompt_column(tmp_path, cfg, write_parquet):
    inp = write_parquet({"id": list(range(20)), "prompt": [f"say {i} " * (i % 7 + 1) for i in range(20)],
                         "tag": ["x"] * 20})
    out = tmp_path / "out"
    run_job(cfg(inp, out, input={"passthrough": ["tag"]}), engine_factory=given(FakeEngine()), is_tty=False)
    r = CliRunner().invoke(cli, ["predictor", "eval", str(out), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["num_rows"] == 20, r.output
    r = CliRunner().invoke(cli, ["predictor", "eval", str(out), "--predictor", "heuristic"])   # this one reads it
    assert r.exit_code == 1 and "holds no prompt column ('prompt')" in r.output


def test_one_model_spelled_two_ways_is_one_model_to_the_predictor(tmp_path, write_parquet, tiny_model, monkeypatch):
    import os

    from overnight.buckets.dataset import load_outputs

    inp = write_parquet({"id": list(range(10)), "prompt": [f"say {i}" for i in range(10)]})
    monkeypatch.chdir(os.path.dirname(tiny_model))
    for out, model in (("a", os.path.basename(tiny_model)), ("b", tiny_model)):
        r = CliRunner().invoke(cli, ["run", inp, "--out", str(tmp_path / out), "--model", model, "--engine", "echo"])
        assert r.exit_code == 0, r.output
    monkeypatch.chdir(tmp_path)                                  # read from elsewhere: by where each run started
    assert load_outputs([str(tmp_path / "a"), str(tmp_path / "b")]).models == [os.path.normpath(tiny_model)]
