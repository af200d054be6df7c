"""The progress line and what it counts (pipeline/progress.py), on a fake clock: the plain line while no row
finishes, the deadline and the ETA counted down between forecasts, the rates over their window, and the rows done
recounted as this input's."""

import logging

import pytest

from overnight.pipeline.progress import Progress


def test_the_plain_progress_line_comes_while_no_row_finishes(caplog):
    now = [0.0]
    p = Progress(10, 0, log_every=30.0, is_tty=False, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="overnight"):
        for t in (10.0, 31.0, 40.0, 62.0):   # the loop's ticks; no row finished
            now[0] = t
            p.tick()
    assert [m.split(",")[0] for m in caplog.messages] == ["0/10 rows (0%)"] * 2


def test_the_deadline_and_the_eta_count_down_between_forecasts_and_a_finished_job_has_no_eta():
    """Forecasts may be far apart (over a pool of 10k rows, 5-20 s); what they said counts down meanwhile, in
    the progress line, its JSON counters and the timeline's samples (a 20k-row job's ETA at 10% of its rows was
    its first seconds' forecast, 3.3 times the time left)."""
    now = [0.0]
    p = Progress(10, 0, log_every=30.0, is_tty=False, clock=lambda: now[0])
    p.set_forecast(40.0, 100.0, False, {"eta_low_s": 35.0, "eta_high_s": 50.0})
    now[0] = 30.0                                    # no forecast since: the deadline came 30 s nearer all the same
    assert p.deadline_left == 70.0 and "deadline in 1m10s" in p.line()
    assert p.eta_seconds() == 10.0 and "ETA 10s (5s-20s)" in p.line() and p.counters()["eta_range_s"] == [5.0, 20.0]
    p.sample()
    assert p.samples[-1]["eta_s"] == 10.0 and p.samples[0]["eta_s"] == 40.0 and p.samples[0]["eta_low_s"] == 35.0
    now[0] = 45.0
    assert p.eta_seconds() == 0.0 and p.counters()["eta_range_s"] == [0.0, 5.0]  # late: 0, not less
    p.set_forecast(12.0, 55.0, False, {"eta_low_s": 10.0, "eta_high_s": 20.0})  # a new forecast: from it
    assert p.eta_seconds() == 12.0 and p.eta_range_now == (10.0, 20.0)
    now[0] = 47.0
    assert p.deadline_left == 53.0
    p.update(10, 100)                                # every row done: no ETA left, and no range ("ETA 0s (8s-9s)")
    assert p.eta_seconds() == 0.0 and p.counters()["eta_s"] == 0.0 and p.counters()["eta_range_s"] is None
    assert p.line().endswith("ETA 0s, deadline in 53s")
    p = Progress(10, 0, log_every=30.0, is_tty=False, clock=lambda: now[0])
    p.set_forecast(12.0, None, False, {"eta_low_s": 10.0, "eta_high_s": 20.0})
    p.skipped = 2                                    # duplicate ids: neither done nor left
    p.update(8, 80)
    assert p.eta_seconds() == 0.0 and p.eta_range_now is None and p.line().endswith("ETA 0s")
    p.set_forecast(5.0, None, False)                 # a forecast without a range clears the last one's
    assert p.eta_range is None


def test_the_progress_rates_fall_when_rows_stop_finishing_and_count_a_burst_over_the_window():
    now = [0.0]
    p = Progress(100, 0, log_every=30.0, is_tty=False, clock=lambda: now[0])
    now[0] = 20.0
    p.rates_from(now[0])                             # the engine is ready: the rates count from here
    now[0] = 30.0
    p.update(5, 500)
    now[0] = 30.01
    p.update(5, 500)                                 # a burst: 10 rows in 10 ms, after 10 s of generating
    assert p.token_rate.per_second(now[0]) == pytest.approx(1000 / 10.01) and "100 output tok/s" in p.line()
    now[0] = 45.0
    assert p.token_rate.per_second(now[0]) == pytest.approx(1000 / 25)  # none since: it falls
    now[0] = 330.0                                   # five minutes and nothing more finished: none in the window
    assert p.counters()["output_tokens_per_s"] == 0 and p.eta_seconds() is None
    # fed by the loop, tokens as the engine generates them: the engine's rate, whatever rows finish
    p.rates_from(now[0])
    for t in range(1, 41):
        now[0] = 330.0 + t
        p.generated(50 * t)
    assert p.counters()["output_tokens_per_s"] == pytest.approx(50) and "50 output tok/s" in p.line()


def test_the_progress_recounts_rows_done_as_those_of_this_input():
    now = [0.0]
    p = Progress(100, 100, log_every=30.0, is_tty=False, clock=lambda: now[0])  # OUT holds 100 rows
    assert p.eta_seconds() == 0.0
    p.recount(50)                                    # a pass over the input: 50 of them left it
    now[0] = 10.0
    p.update(10, 1000)
    assert p.line().startswith("60/100 rows (60%)") and p.eta_seconds() == pytest.approx(40 / (10 / 10.0))
