"""Length prediction without an engine: metrics, buckets, the heuristic, the online and trained predictors,
and the annotator's learner thread. Lengths here follow a rule the heuristic cannot see (the topic word),
so a predictor that learns must beat it and one that does not learn cannot."""

import time

import numpy as np
import pytest

from overnight.buckets.annotate import LengthAnnotator
from overnight.buckets.bucketing import assign, log_bounds, quantile_bounds
from overnight.buckets.features import featurize
from overnight.buckets.heuristic import heuristic_tokens
from overnight.buckets.metrics import kendall_tau
from overnight.buckets.predictors import HeuristicPredictor, OnlinePredictor
from overnight.pipeline.records import Row

LONG = ["castles", "volcanoes", "submarines", "glaciers", "pyramids", "comets"]
SHORT = ["apples", "pencils", "buttons", "spoons", "socks", "bricks"]


def workload(n, seed):
    """Prompts from one template; a LONG topic gets ~400 tokens, a SHORT one ~40, with noise."""
    rng = np.random.default_rng(seed)
    texts, actual = [], []
    for i in range(n):
        is_long = bool(rng.integers(2))
        topic = (LONG if is_long else SHORT)[rng.integers(6)]
        texts.append(f"Tell me about {topic}, item {rng.integers(1000)}.")
        actual.append(float(rng.normal(400 if is_long else 40, 20 if is_long else 5)))
    fb = featurize(texts, [12] * n, [512] * n)
    return fb, np.clip(np.array(actual), 1, 512)


def test_kendall_tau_by_hand():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    # one discordant pair of six: (5 - 1) / 6
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    # tau-b with a tie in x: C=4, D=1, ties only in x: 1 -> (4-1)/sqrt(6*5)
    assert kendall_tau([1, 1, 2, 3], [1, 2, 3, 0]) == pytest.approx((2 - 3) / np.sqrt(5 * 6))


def test_buckets_log_and_quantile():
    b = log_bounds(512, 6)
    assert b[0] == 16 and b[-1] == 512 and np.all(np.diff(b) > 0)
    assert assign([1, 16, 17, 512, 5000], b).tolist() == [0, 0, 1, len(b) - 1, len(b) - 1]
    q = quantile_bounds(np.arange(1, 101), 4)
    assert q.tolist() == [26, 51, 76, 100]
    counts = np.bincount(assign(np.arange(1, 101), q))
    assert all(abs(c - 25) <= 1 for c in counts) and counts.sum() == 100  # bounds are whole tokens


def test_heuristic_reads_instructions_and_explicit_lengths():
    essay = heuristic_tokens("Write an essay about the history of Rome.", 10)
    brief = heuristic_tokens("Briefly, what is the capital of France?", 10)
    words = heuristic_tokens("Describe a sunset in 500 words.", 10)
    assert brief < 60 < essay and words == pytest.approx(700)
    assert heuristic_tokens("Write a detailed essay about Rome.", 10) > essay


def test_heuristic_cannot_rank_the_topic_rule_but_the_online_predictor_learns_it():
    train, y_train = workload(1024, seed=1)
    test, y_test = workload(400, seed=2)
    heuristic = kendall_tau(HeuristicPredictor().predict(test).score, y_test)
    online = OnlinePredictor()
    before = kendall_tau(online.predict(test).score, y_test)
    for start in range(0, 1024, 256):
        rows = np.arange(start, start + 256)
        online.observe(_subset(train, rows), y_train[rows], np.zeros(256, bool))
    after = online.predict(test)
    # one template, one guess: no ranking at all (tau is undefined when every prediction ties)
    assert abs(np.nan_to_num(heuristic)) < 0.1 and abs(np.nan_to_num(before)) < 0.1
    assert kendall_tau(after.score, y_test) > 0.4  # two classes: at most ~0.5
    is_long = y_test > 200
    assert np.median(after.tokens[is_long]) > 2 * np.median(after.tokens[~is_long])  # four steps in


def test_trained_predictor_fits_the_rule_and_round_trips_through_a_file(tmp_path):
    from overnight.buckets.trained import TrainedPredictor

    train, y_train = workload(600, seed=3)
    test, y_test = workload(300, seed=4)
    p, report = TrainedPredictor.fit(train, y_train, np.zeros(600, bool), epochs=8)
    assert report.train_tau > 0.4  # two classes: at most ~0.5
    assert kendall_tau(p.predict(test).score, y_test) > 0.4
    path = str(tmp_path / "lengths.pt")
    p.save(path)
    again = TrainedPredictor.load(path)
    np.testing.assert_allclose(again.predict(test).tokens, p.predict(test).tokens, rtol=1e-5)


def _subset(fb, rows):
    from overnight.buckets.trained import _subset as subset

    return subset(fb, rows)


class _Entry:
    """What the scheduler hands the annotator to re-predict: an object with a row."""

    def __init__(self, row):
        self.row = row


def _rows(texts):
    return [Row(id=i, prompt_token_ids=[0] * 12, sampling={"max_tokens": 512}, passthrough={}, origin=f"f#{i}",
                ) for i in range(len(texts))]


@pytest.mark.parametrize("background", [False, True])
def test_annotator_learns_from_finished_rows_and_repredicts_the_pool(background):
    a = LengthAnnotator(OnlinePredictor(), 512, background=background)
    try:
        fb, actual = workload(768, seed=5)
        rows = _rows(fb.texts)
        a.annotate(rows, fb.texts)
        first = {r.id: r.predicted_tokens for r in rows}
        assert len(set(first.values())) <= 3  # the heuristic: one template, nearly one guess
        done, waiting = rows[:512], rows[512:]
        for start in range(0, 512, 64):
            chunk = done[start:start + 64]
            a.observe(chunk, [int(actual[r.id]) for r in chunk], ["stop"] * len(chunk))
        _wait_for(lambda: a.predictor.num_observed == 512)
        assert a.wants_refresh()
        a.request_refresh([_Entry(r) for r in waiting])
        assert not a.wants_refresh()  # one re-prediction at a time
        result = _wait_for(a.take_refresh)
        entries, tokens, buckets = result
        assert len(entries) == len(tokens) == len(buckets) == 256
        assert all(r.predicted_tokens == first[r.id] for r in waiting)  # the scheduler applies them, not the annotator
        y = actual[[e.row.id for e in entries]]
        assert kendall_tau(tokens, y) > 0.4
        assert (a.background_seconds > 0) == background and (a.loop_seconds > 0) != background
    finally:
        a.close()
    assert a._thread is None or not a._thread.is_alive()


def _wait_for(fn, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = fn()
        if out:
            return out
        time.sleep(0.01)
    raise AssertionError(f"{fn} not true within {timeout} s")
