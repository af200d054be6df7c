"""The whole job's forecast on Ray (pipeline/cluster/eta.py): the workers' own forecasts and the rows no worker
holds yet, checked against a simulated queue of units pulled by workers of different speeds."""

import heapq

import numpy as np
import pytest

from overnight.pipeline.cluster.eta import WorkerForecast, job_forecast, worker_forecast


def test_without_unassigned_rows_the_job_ends_with_its_slowest_worker():
    ws = [WorkerForecast(10, 100, 1000, 10), WorkerForecast(20, 100, 2000, 20)]
    assert job_forecast(ws, 0, None).eta_s == 20
    assert job_forecast([], 5, None) is None


def test_unassigned_rows_go_to_whichever_worker_is_free_first():
    ws = [WorkerForecast(10, 100, 1000, 10), WorkerForecast(20, 100, 2000, 20)]
    # 20 rows of 100 tokens: w0 alone does 1000 tokens from 10 s to 20 s, then both do the rest at 200/s
    f = job_forecast(ws, 20, None)
    assert f.eta_s == pytest.approx(25)
    assert not f.will_miss and f.rows_expected_left == 0


def test_a_deadline_counts_what_each_worker_leaves_and_the_unassigned_rows_nobody_reaches():
    ws = [WorkerForecast(10, 100, 1000, 10), WorkerForecast(20, 100, 2000, 20, rows_expected_left=5)]
    f = job_forecast(ws, 20, 15)
    # w0 is free for 5 s before the stop: 500 tokens, 5 of the 20 unassigned rows; w1 leaves 5 of its own
    assert f.will_miss and f.rows_expected_left == 5 + 15


def test_a_worker_forecast_ages_with_the_time_since_it_was_made():
    st = {"rows": {"remaining": 99}, "forecast_at": 100.0,
          "forecast": {"eta_s": 50.0, "eta_range_s": [40.0, 70.0], "tokens_per_s": 200.0,
                       "remaining_tokens_predicted": 6000, "remaining_rows": 30, "rows_expected_left": 0}}
    w = worker_forecast(st, 110.0)
    assert (w.eta_s, w.eta_low_s, w.eta_high_s, w.remaining_rows) == (40.0, 30.0, 60.0, 30)
    assert worker_forecast({"rows": {}, "forecast": {"eta_s": None}}, 0.0) is None


def pull_queue(rates, in_hand, units, by=np.inf):
    """Worker i has in_hand[i] tokens, then pulls units (each an array of its rows' tokens) in order as it frees
    up, at rates[i] tokens/s, a row at a time. Returns when the last worker finishes, and the unassigned rows
    done by ``by``."""
    free = [(in_hand[i] / rates[i], i) for i in range(len(rates))]
    heapq.heapify(free)
    end = max(t for t, _ in free)
    done = 0
    for u in units:
        t, i = heapq.heappop(free)
        ends = t + np.cumsum(u) / rates[i]
        done += int(np.sum(ends <= by))
        end = max(end, ends[-1])
        heapq.heappush(free, (ends[-1], i))
    return end, done


@pytest.mark.parametrize("seed", range(5))
def test_eta_and_rows_left_are_within_ten_and_twenty_percent_of_a_simulated_pull_queue(seed):
    rng = np.random.default_rng(seed)
    n_workers = int(rng.integers(2, 9))
    rates = rng.uniform(500, 3000, n_workers)  # workers of different speeds (GPUs, models, loads)
    tokens = rng.lognormal(np.log(250), 0.8, (200 * n_workers, 50))  # 200 units of 50 rows a worker
    # a snapshot a little into the job: each worker holds some rows, partly done; the other units are unassigned
    held = rng.uniform(0.2, 2.0, n_workers) * tokens.sum(axis=1).mean()
    rows_held = (held / tokens.mean()).astype(int)
    queue = tokens[2 * n_workers:]
    actual, _ = pull_queue(rates, held, queue)
    ws = [WorkerForecast(h / r, r, h, int(n)) for h, r, n in zip(held, rates, rows_held)]
    f = job_forecast(ws, queue.size, None)
    assert f.eta_s == pytest.approx(actual, rel=0.10)
    # a deadline halfway: the rows left undone are close to what the queue leaves
    _, done = pull_queue(rates, held, queue, by=actual / 2)
    g = job_forecast(ws, queue.size, actual / 2)
    assert g.will_miss
    assert g.rows_expected_left == pytest.approx(queue.size - done, rel=0.2)
