"""What the forecast learns during a run: what an engine step costs, how long rows really run, how the job drains.

Pure objects, no engine, clock or I/O; the runner feeds them every step.

    InFlight     which admitted rows the engine runs and for how many steps: vLLM runs up to max_num_seqs in the
                 order they came and queues the rest, and does not say which; this emulates it
    (LengthModel, the rows' lengths against their predictions, is in scheduling/lengths.py.)
    drain()      the remaining time: the rows in run order over the engine's slots, step by step in blocks
                 (a * steps + b * tokens + c * prompt tokens), with the spread of the last rows' lengths at the end:
                 the drain's end drawn, where the rows left are a few rounds of the slots
    (StepCost, what a step costs and how much that drifts over the run, is in scheduling/step_cost.py.)
    (best_cap(), the rows in flight that finish the most rows by the deadline, is in scheduling/cap.py.)
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Optional

import numpy as np


# -- rows in the engine ----------------------------------------------------------------------------
class InFlight:
    """The engine's running set as vLLM keeps it: up to max_num_seqs sequences in admission order, the rest queued.
    A row that asks for n samples runs as n sequences (vLLM's parallel sampling), each its own slot."""

    def __init__(self, max_num_seqs: int):
        self.max_num_seqs = max_num_seqs
        self.step = 0
        self.start: dict[str, int] = {}  # running request -> the step it started at
        self.waiting: deque[str] = deque()
        self.info: dict[str, tuple[float, int, int]] = {}  # request -> (predicted tokens, prompt tokens, samples)
        self.num_seqs = 0  # sequences of the running requests
        self._held = 0  # the running sequences' prompt tokens less the step each started at, summed (context)
        self.prompt_total = 0
        self.num_admitted = 0

    def resize(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs

    def admit(self, request_id: str, predicted: Optional[int], prompt_tokens: int, n: int = 1) -> None:
        self.info[request_id] = (float(predicted or 0), prompt_tokens, max(1, int(n)))
        self.waiting.append(request_id)
        self.prompt_total += prompt_tokens
        self.num_admitted += 1

    def before_step(self) -> tuple[int, int]:
        """Rows start as slots free; returns (sequences in this step, prompt tokens it prefills)."""
        prefill = 0
        while self.waiting and self.num_seqs < self.max_num_seqs:
            rid = self.waiting.popleft()
            info = self.info.get(rid)
            if info is not None:  # else finished or dropped while waiting
                self.start[rid] = self.step
                self.num_seqs += info[2]
                self._held += info[2] * (info[1] - self.step)
                prefill += info[1]
        return self.num_seqs, prefill

    @property
    def context(self) -> int:
        """Context tokens of the sequences running (prompt and tokens so far), summed: what a step's attention
        reads."""
        return self._held + self.num_seqs * self.step

    def after_step(self, finished_ids) -> None:
        self.step += 1
        for rid in finished_ids:
            self.forget(rid)

    def forget(self, request_id: str) -> None:
        info = self.info.pop(request_id, None)
        started = self.start.pop(request_id, None)
        if started is not None:
            self.num_seqs -= info[2]
            self._held -= info[2] * (info[1] - started)

    def clear(self) -> None:
        self.start.clear()
        self.waiting.clear()
        self.info.clear()
        self.num_seqs = self._held = 0

    @property
    def mean_prompt_tokens(self) -> float:
        return self.prompt_total / self.num_admitted if self.num_admitted else 0.0

    def running(self, per_sequence: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(predicted tokens, tokens generated so far) of the sequences running (a row of n samples: n times), or
        of the rows running (per_sequence=False: what a row that is still running says of its lengths is only
        that its longest sample has run this long)."""
        if not self.start:
            return np.zeros(0), np.zeros(0)
        info = [self.info[r] for r in self.start]
        p = np.fromiter((i[0] for i in info), np.float64, len(info))
        g = np.fromiter((self.step - s for s in self.start.values()), np.float64, len(info))
        if per_sequence and self.num_seqs != len(info):
            k = np.fromiter((i[2] for i in info), np.int64, len(info))
            p, g = np.repeat(p, k), np.repeat(g, k)
        return p, g

    def contexts(self) -> np.ndarray:
        """Context tokens (prompt and tokens so far) of the sequences running, in running()'s order."""
        if not self.start:
            return np.zeros(0)
        info = [self.info[r] for r in self.start]
        c = np.fromiter((i[1] + self.step - s for i, s in zip(info, self.start.values())), np.float64, len(info))
        k = np.fromiter((i[2] for i in info), np.int64, len(info))
        return c if self.num_seqs == len(info) else np.repeat(c, k)

    def queued(self, per_sequence: bool = True) -> np.ndarray:
        """Predicted tokens of the sequences admitted but not started, in the order they will start (of the rows:
        per_sequence=False)."""
        info = [self.info[r] for r in self.waiting if r in self.info]
        p = np.fromiter((i[0] for i in info), np.float64, len(info))
        k = np.fromiter((i[2] for i in info), np.int64, len(info))
        return p if not per_sequence or not len(k) or k.max() == 1 else np.repeat(p, k)


# -- the drain -------------------------------------------------------------------------------------
# The drain's end, where the rows to start fill at most DRAWN_ROUNDS rounds of the slots (and DRAWN_ROWS rows): the
# mean of DRAWS draws of every row's length laid over the slots (_drawn_steps). Beyond, where the slots' loads even
# out, the expected layout and the spread of each slot's last row at its expected start (_tail_steps). That one
# counts every slot's last row as starting where the expected lengths put it; the engine starts the rows left as the
# rows running end, the first to end first, and a slot whose row runs long takes none. Under the embedded model's
# own lengths, known exactly (benchmarks/drain_tail.py), it came out x1.12-1.17 of the drain's mean end at 10% of a
# job with a round of the slots to start, x1.03-1.08 from 1 to 5 rounds, x1.01 from 10; the draws x0.99-1.01. They
# cost 1-7 ms over 64 slots (8 rounds), 3-20 ms over 256 (4 rounds); beyond, 1-2 ms.
DRAWS, DRAWN_ROUNDS, DRAWN_ROWS = 32, 8, 1024

@dataclass
class Drain:
    steps: float  # engine steps to finish everything
    tokens: float  # output tokens still to generate
    prefill_tokens: float  # prompt tokens still to prefill
    rows_by: int  # rows finished within `within_steps`
    tail_steps: float  # steps the spread of the last rows' lengths adds beyond their expected ends
    started_by: int = 0  # rows still to start that start in time (drain's `began`)


def drain(slots: int, running: np.ndarray, lengths: np.ndarray, counts: np.ndarray, within_steps: float = math.inf,
          tail: Optional[tuple] = None, start_by: Optional[float] = None, admitted: float = 0.0) -> Drain:
    """Rows in run order over ``slots`` engine slots, each slot running one row at a time, a token per step.
    ``rows_by``: the rows that finish within ``within_steps`` and, but for the first ``admitted`` rows to start
    (in the engine's queue already), start by ``start_by`` steps (default: the same). Admission stops before the
    deadline, and the rows in flight, the engine's queue included, drain to it.

    running: expected remaining tokens of the rows running now (each holds a slot); lengths/counts: groups of rows
    still to start, in the order they will start (expected tokens each, and how many). A group bigger than the
    slots is laid out in whole rounds at once, so the cost is O(groups * slots), not O(rows).
    tail: (model, predicted of running, generated of running, predicted of each group, shift) to add the spread
    of the rows' lengths beyond their expected ends (the draws', or the last rows' spread: DRAWN_ROUNDS above);
    None to leave it out."""
    k = max(1, int(slots))
    load = np.zeros(k)
    n = min(len(running), k)
    load[:n] = np.sort(running)[::-1][:n]
    # which row each slot runs last: its start, its prediction, tokens done at the start (for the tail)
    last_start = np.zeros(k)
    last_group = np.full(k, -1)
    last_start[:n] = 0.0
    tokens, rows_by = float(np.sum(running)), int(np.sum(running <= within_steps))
    start_by = within_steps if start_by is None else min(start_by, within_steps)
    free = np.zeros(len(lengths), bool)  # a group of rows already admitted: not bound by start_by
    origin = np.arange(len(lengths))  # each group's in the caller's groups (a group split keeps its index)
    if admitted > 0 and start_by < within_steps and len(lengths):
        lengths, counts, free, origin = _split_admitted(np.asarray(lengths, np.float64),
                                                        np.asarray(counts, np.float64), admitted)
    began = 0  # rows still to start that start by start_by (rows queued in the engine: by within_steps)
    for gi, (length, count) in enumerate(zip(lengths, counts)):
        count = int(count)
        if count <= 0:
            continue
        tokens += length * count
        rounds, rest = divmod(count, k)
        if rounds:
            if within_steps < math.inf:
                # rows of slot j start at load_j + length * (i - 1) and finish at load_j + length * i, i = 1..rounds
                span = max(length, 1e-9)
                ends = np.floor((within_steps - load) / span)
                first = np.floor(((within_steps if free[gi] else start_by) - load) / span) + 1  # rows started
                starts = ends if free[gi] else first
                rows_by += int(np.clip(np.minimum(ends, starts), 0, rounds).sum())
                began += int(np.clip(first, 0, rounds).sum())
            last_start = load + length * (rounds - 1)
            last_group[:] = origin[gi]
            load = load + length * rounds
        if rest:
            order = np.argsort(load, kind="stable")[:rest]
            last_start[order] = load[order]
            last_group[order] = origin[gi]
            started = load[order] <= (math.inf if free[gi] else start_by)
            began += int(np.sum(load[order] <= (within_steps if free[gi] else start_by)))
            load[order] += length
            rows_by += int(np.sum((load[order] <= within_steps) & started))
    steps = float(load.max()) if len(load) else 0.0
    tail_steps = 0.0
    if tail is not None and steps > 0:
        # (a tail whose spread is another model's than the lengths', LengthMixture.spread: the log ratio's beside a
        # trained predictor's sqrt ratio, a pairing measured with the last rows' spread, is left as it was)
        own = getattr(tail[0], "spread", None) is None
        if own and float(np.sum(counts)) <= min(DRAWN_ROUNDS * k, DRAWN_ROWS):
            tail_steps = max(0.0, _drawn_steps(tail, running, n, lengths, counts, origin, k) - steps)
        else:
            tail_steps = _tail_steps(tail, load, last_start, last_group, running, n, steps)
    return Drain(steps, tokens, 0.0, rows_by, tail_steps, began)


def _split_admitted(lengths: np.ndarray, counts: np.ndarray, admitted: float):
    """The groups with the first ``admitted`` rows in groups of their own (a group split where they end), which
    groups those are, and each group's index among the groups given."""
    before = np.concatenate([[0.0], np.cumsum(counts)[:-1]])
    inside = np.clip(admitted - before, 0.0, counts)  # each group's rows among the admitted
    out_l, out_c, out_f, out_o = [], [], [], []
    for i, (length, count, a) in enumerate(zip(lengths, counts, inside)):
        for n, f in ((a, True), (count - a, False)):
            if n > 0:
                out_l.append(length)
                out_c.append(n)
                out_f.append(f)
                out_o.append(i)
    return np.asarray(out_l), np.asarray(out_c), np.asarray(out_f, bool), np.asarray(out_o, int)


def _drawn_steps(tail, running, n_running, lengths, counts, origin, k: int, draws: int = DRAWS) -> float:
    """E[the drain's end] where the rows still to start fill a few rounds of the slots: every row's length drawn
    from the length model (a row running, what it has left given its tokens so far), laid over the slots as the
    engine does (the first slot free takes the next row), over ``draws`` draws of every row at once (stratified,
    from a fixed seed: the same forecast twice gives the same end). The rows running in their slots, the rows to
    start in run order; a group of rows at its prediction. Each row's draws are scaled to the mean the drain lays
    it out at (``running``, ``lengths``): the tail's model may be another than the one that expects the lengths
    (LengthMixture.quantile_cdf), and it gives the spread, not the tokens."""
    model, run_p, run_g, group_p, shift = tail
    running = np.asarray(running, np.float64)
    order = np.argsort(-running)[:n_running]
    group = np.repeat(np.arange(len(counts)), np.maximum(np.round(np.asarray(counts, np.float64)).astype(int), 0))
    rows = np.asarray(origin, int)[group]  # each row's group among the caller's, in run order
    mean = np.concatenate([running[order], np.asarray(lengths, np.float64)[group]])
    p = np.concatenate([np.asarray(run_p, np.float64)[order], np.asarray(group_p, np.float64)])
    g = np.concatenate([np.asarray(run_g, np.float64)[order], np.zeros(len(group_p))])
    col = np.concatenate([np.arange(len(order)), len(order) + rows])  # each row's (p, g)
    # each row's grid of tokens left, up to max_tokens; its last token before the cap apart, so that the rows
    # that run to the cap (an atom there) are drawn at it, not spread below it
    top = np.maximum(model.cap - g, 1.0)
    xs = np.maximum(np.geomspace(1.0 / model.cap, 1.0, 47)[:, None] * top[None, :], 1.0)
    xs = np.sort(np.concatenate([xs, np.maximum(top - 1.0, 1.0)[None, :]]), axis=0)
    cdf = np.maximum.accumulate(model.quantile_cdf(xs, p[None, :], g[None, :], shift), axis=0)[:, col]
    xs = xs[:, col]
    rng = np.random.default_rng(0)
    u = (np.argsort(rng.random((draws, len(col))), axis=0) + rng.random((draws, len(col)))) / draws
    each = np.arange(len(col))
    i = np.clip((cdf[None, :, :] < u[:, None, :]).sum(axis=1), 1, len(xs) - 1)  # the grid's step past u
    lo, hi = cdf[i - 1, each], cdf[i, each]
    frac = np.clip((u - lo) / np.maximum(hi - lo, 1e-12), 0.0, 1.0)
    x = np.where(u <= cdf[0][None, :], xs[0][None, :], xs[i - 1, each] + frac * (xs[i, each] - xs[i - 1, each]))
    # the draws that reach max_tokens stay there (rows that loop end the drain late); the others scaled so that
    # each row's draws average what the drain lays it out at
    top = xs[-1]
    cut = x >= top[None, :] - 0.5
    q = cut.mean(axis=0)
    free = np.where(cut, 0.0, x).sum(axis=0) / np.maximum((~cut).sum(axis=0), 1)
    scale = np.clip((mean - q * top) / np.maximum((1.0 - q) * free, 1e-9), 0.0, None)
    x = np.where(cut, x, np.minimum(x * scale[None, :], top[None, :]))
    load = np.zeros((draws, k))
    load[:, :len(order)] = x[:, :len(order)]
    every = np.arange(draws)
    for r in range(len(order), len(col)):
        j = load.argmin(axis=1)
        load[every, j] += x[:, r]
    return float(load.max(axis=1).mean())


def _tail_steps(tail, load, last_start, last_group, running, n_running, steps) -> float:
    """E[max over slots of (start of its last row + that row's actual remaining length)] minus the expected
    makespan, on a grid: P(max <= x) is the product of each slot's last row's CDF."""
    model, run_p, run_g, group_p, shift = tail
    busy = load > 0
    if not busy.any():
        return 0.0
    idx = np.flatnonzero(busy)
    starts = last_start[idx]
    groups = last_group[idx]
    order = np.argsort(-running)[:n_running] if n_running else np.zeros(0, int)
    p = np.empty(len(idx))
    g = np.zeros(len(idx))
    for j, (slot, grp) in enumerate(zip(idx, groups)):
        if grp >= 0:
            p[j] = group_p[grp]
        else:  # the slot's last row is one running now
            r = order[slot] if slot < len(order) else 0
            p[j], g[j] = run_p[r], run_g[r]
    near = load[idx] > steps - model.cap  # slots that may still be running at the end
    idx, starts, p, g = idx[near], starts[near], p[near], g[near]
    lo, hi = max(0.0, steps - model.cap), float(starts.max()) + model.cap
    xs = np.linspace(lo, hi, 64)
    cdf = model.quantile_cdf(xs[:, None] - starts[None, :], p[None, :], g[None, :], shift)
    cdf = np.where(xs[:, None] >= starts[None, :], cdf, 0.0)
    p_max = np.prod(cdf, axis=1)
    area = 1.0 - p_max
    expected_max = lo + float(np.sum((area[1:] + area[:-1]) / 2 * np.diff(xs)))
    return max(0.0, expected_max - steps)


def chunks(values: np.ndarray, counts: np.ndarray, k: int = 48) -> tuple[np.ndarray, np.ndarray]:
    """Groups of rows in run order, merged into at most k consecutive groups of about equal rows (each the mean
    of what it merges), so the drain costs O(k * slots) whatever the pool."""
    values = np.asarray(values, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.float64)
    if len(values) <= k:
        return values, counts
    cum = np.cumsum(counts)
    edges = np.searchsorted(cum, np.linspace(0, cum[-1], k + 1)[1:-1], side="right")
    starts = np.unique(np.concatenate([[0], edges]))
    starts = starts[starts < len(values)]
    n = np.add.reduceat(counts, starts)
    v = np.add.reduceat(values * counts, starts) / np.maximum(n, 1e-12)
    return v, n
