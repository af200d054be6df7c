"""The cap on rows in flight near a deadline: the number of sequences that finish the most rows by the stop. Fewer
sequences run faster per sequence where a step's cost grows with them (a CPU), and a row still running at the stop
is lost. Pure arithmetic on the step cost and the rows' lengths as the forecast knows them (forecast.py,
lengths.py); estimate.py calls it at each forecast."""

from __future__ import annotations

import numpy as np


def renewal_rows(m: int, fixed_s: float, per_seq_s: float, time_left_s: float, mean_tokens: float,
                 prefill_s_per_row: float, spread: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(c = 1 .. m, a step's seconds with c rows running, the rows c slots finish by renewal theory): best_cap's."""
    c = np.arange(1, m + 1, dtype=np.float64)
    step = fixed_s + per_seq_s * c + prefill_s_per_row * c / max(mean_tokens, 1.0)
    return c, step, c * (time_left_s / np.maximum(step, 1e-9) / mean_tokens + max(spread, 1.0) / 2 - 1)


def best_cap(max_seqs: int, fixed_s: float, per_seq_s: float, time_left_s: float, mean_tokens: float,
             prefill_s_per_row: float = 0.0, spread: float = 1.0, per_seq_known: bool = True,
             fallback=None) -> int:
    """Rows in flight that finish the most rows in ``time_left_s``: with c rows running, a step takes
    fixed + per_seq * c (plus their share of prefill), and each of the c slots runs rows one after another, a
    token per step. A slot's rows finished within S steps are, by renewal theory,

        S / mean + E[L^2] / (2 mean^2) - 1,      rows(c) = c * (steps(c) / mean + spread / 2 - 1)

    with steps(c) = time_left / step(c) and spread = E[L^2] / mean^2 of the rows' lengths as the forecast knows
    them. Lengths known exactly (spread 1) lose the row still running at the stop, half done on average; the less
    the predictions tell, the more often a slot's last row is a short one that finishes, and from spread 2 on
    more slots always finish more. Where a step's cost barely grows with c (a GPU) this is the full engine until
    the last half row's worth of steps; where it grows (a CPU) and lengths are well predicted, fewer rows near
    the stop finish more."""
    m = max(1, int(max_seqs))
    if mean_tokens <= 0 or time_left_s <= 0:
        return m
    c, step, rows = renewal_rows(m, fixed_s, per_seq_s, time_left_s, mean_tokens, prefill_s_per_row, spread)
    if rows.max() > 0:
        return int(c[int(np.argmax(rows))])
    if fallback is not None:  # another rule for this case, to measure against it (benchmarks/cap_fallback.py)
        return fallback(c, step)
    # Less time left than a slot needs for its first row on average: only the short rows still finish. Where a
    # step's cost barely grows with c (a GPU), every slot may finish one as soon as one slot can, so the engine
    # stays full (a cap of 1 finished half the rows fifo did with steps of a fixed 0.4 s); where it grows (a CPU),
    # one slot, stepping fastest, finishes the most (benchmarks/cap_fallback.py: scoring c slots by
    # c * P(L <= steps(c)) instead finished 2.42x fifo's rows where 1 slot finished 3.58x). Lengths known exactly
    # (spread 1) finish nothing now. per_seq_known: whether per_seq_s was measured (the caller passes 0 until it
    # is): a cost not yet known to be flat keeps the last stretch's single slot.
    flat = per_seq_known and step[-1] <= 1.25 * step[0]
    return m if flat and spread > 1.0 else 1
