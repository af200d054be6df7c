"""The rows a deadline leaves where admission stops a margin before it and the rows in flight drain to it
(--on-deadline drain): the drain's layout, and the forecast on tests/test_forecast.py's simulated engine."""

import numpy as np
import pytest

from overnight.pipeline.scheduling.forecast import drain
from test_forecast import CPU, GPU, simulate


def test_rows_done_by_the_deadline_are_those_started_by_the_stop():
    """Admission stops at the stop (the deadline less its margin); the rows in flight drain to the deadline."""
    # 10 rows of 10 over 4 slots: they start at 0 (4), 10 (4) and 20 (2) and end at 10, 20 and 30
    d = drain(4, np.array([]), np.array([10.0]), np.array([10]), within_steps=30, start_by=15)
    assert d.rows_by == 8                              # the last 2 would start at 20, after the stop at 15
    assert drain(4, np.array([]), np.array([10.0]), np.array([10]), within_steps=30, start_by=20).rows_by == 10
    assert drain(4, np.array([]), np.array([10.0]), np.array([10]), within_steps=25).rows_by == 8
    # a partial round: 6 rows, the 2 of the second round start at 10
    assert drain(4, np.array([]), np.array([10.0]), np.array([6]), within_steps=30, start_by=9).rows_by == 4
    assert drain(4, np.array([]), np.array([10.0]), np.array([6]), within_steps=30, start_by=10).rows_by == 6
    # rows running now started long ago: by the deadline they count
    assert drain(2, np.array([25.0, 5.0]), np.array([]), np.array([]), within_steps=30, start_by=1).rows_by == 2


@pytest.mark.parametrize("cost", [CPU, GPU], ids=["cpu", "gpu"])
def test_rows_that_drain_to_the_deadline_are_not_expected_left(cost):
    """Admission stops a margin before the deadline, and the rows in flight run on to it (--on-deadline drain).
    The rows expected left count those that finish in the drain as done: at the stop, with the deadline at 90% of
    the makespan and a margin of 10%, they expected 121-134 rows left on the CPU's cost (62-72 were) and 69-81 on
    the GPU's (7-16 were). A deadline the drain meets is not warned of on a GPU's cost (12 of 12 forecasts did)."""
    full = simulate("fifo", cost)
    story = simulate("fifo", cost, deadline_share=0.9, makespan=full.end, margin=0.1 * full.end)
    t, done, f = [s for s in story.samples if s[0] <= 0.8 * full.end][-1]
    left = story.n - story.done
    assert f.will_miss and f.rows_expected_left == pytest.approx(left, rel=0.2, abs=3), (f.rows_expected_left, left)
    met = simulate("fifo", cost, deadline_share=1.02, makespan=full.end, margin=0.1 * full.end)
    assert met.done == met.n
    if cost == GPU:
        assert not any(f.will_miss for t, _, f in met.samples if t > 0.5 * full.end)
