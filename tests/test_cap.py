"""The cap on rows in flight near a deadline (scheduling.cap.best_cap), and the step cost's flags that decide
where it applies: no engine, no clock."""

from overnight.pipeline.scheduling.cap import best_cap
from test_forecast import CPU, GPU


def test_cap_shrinks_less_the_less_the_lengths_are_known():
    """A slot's rows finished in S steps: S / mean + E[L^2] / (2 mean^2) - 1 (renewal). Lengths known exactly
    lose the row running at the stop; uncertain ones often end with a short row that still finishes."""
    known = best_cap(64, *CPU, time_left_s=40, mean_tokens=270, spread=1.0)
    vague = best_cap(64, *CPU, time_left_s=40, mean_tokens=270, spread=1.6)
    assert known < vague < 64
    assert best_cap(64, *CPU, time_left_s=40, mean_tokens=270, spread=2.0) == 64


def test_cap_shrinks_near_the_deadline_on_a_cpu_and_stays_full_on_a_gpu():
    assert best_cap(64, *CPU, time_left_s=3600, mean_tokens=270) == 64
    near = best_cap(64, *CPU, time_left_s=120, mean_tokens=270)
    nearer = best_cap(64, *CPU, time_left_s=40, mean_tokens=270)
    assert 1 <= nearer < near < 64
    assert best_cap(64, *GPU, time_left_s=60, mean_tokens=270) == 64
    assert best_cap(64, *GPU, time_left_s=2, mean_tokens=270) == 1  # nothing admitted now can finish
    # less time than a mean row, lengths not known exactly: a slot may still finish one of the short rows, and on
    # a GPU every slot may (the cap was 1, and finished half the rows fifo did with steps of a fixed 0.4 s)
    assert best_cap(64, *GPU, time_left_s=1, mean_tokens=270, spread=1.5) == 64
    assert best_cap(16, 0.4, 8e-6, time_left_s=20, mean_tokens=270, spread=1.3) == 16
    assert best_cap(64, *CPU, time_left_s=2, mean_tokens=270, spread=1.5) == 1   # on a CPU, one runs fastest
    # a step cost not yet known to be flat (per_seq not measured: 0 given) keeps the single slot
    assert best_cap(64, 0.4, 0.0, time_left_s=20, mean_tokens=270, spread=1.3, per_seq_known=False) == 1


def test_the_trust_in_a_warning_is_a_python_bool_for_json():
    from overnight.pipeline.scheduling.step_cost import StepCost

    cost = StepCost()
    for n, s in ((8, 0.05), (32, 0.12)):
        for _ in range(30):
            cost.observe(n, 0, s)
    assert cost.knows_per_seq is True and cost.spans(32) is True and cost.spans(256) is False
