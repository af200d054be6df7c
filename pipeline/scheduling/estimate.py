"""The deadline tracker's forecasts (scheduling/deadline.py keeps the bookkeeping and acts on them).

    rate_forecast   before a few engine steps are measured: the token rate, rows in flight half done, the
                    pending rows in run order and the rows not read yet at the mean prediction
    model_forecast  after: the step cost (scheduling/forecast.StepCost), the lengths (scheduling/lengths.py)
                    and the drain of what is left in the order the scheduler runs it (scheduling/forecast.drain);
                    where rows run by predicted length, the rows left as the rows drawn at random say (drawn.py);
                    under auto near a deadline, also the cap on rows in flight that finishes the most rows

Both take the DeadlineTracker (``t``) for what it has measured and return a Forecast.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from overnight.pipeline.config import Policy
from overnight.pipeline.scheduling.cap import best_cap
from overnight.pipeline.scheduling.drawn import DrawnRows
from overnight.pipeline.scheduling.forecast import chunks, drain
from overnight.pipeline.scheduling.scheduler import Mode

log = logging.getLogger("overnight")

Z80 = 1.2816  # the normal quantile of a two-sided 80% range
FIXED_POINT_ROUNDS = 1  # the prefills of the rows started by the deadline: a round is a drain (~1.5 ms)


def samples_per_row(scheduler) -> float:
    """Sequences per row of the rows still to start (a row asking for n samples runs as n), else of those running."""
    if scheduler.num_pending:
        return scheduler.pending_samples / scheduler.num_pending
    if scheduler.num_running:
        return scheduler.running_samples / scheduler.num_running
    return 1.0


@dataclass
class Forecast:
    # The output rate: the measured one, then the engine's while full, prefills included (not the tail's).
    tokens_per_s: float
    # Predicted output tokens still to generate (in flight, pending, not yet read).
    remaining_tokens: float
    remaining_rows: int
    # Seconds to finish everything at the measured rate, with the engine full (also under auto's cap: what a rerun
    # needs); None until a rate is known.
    eta_s: Optional[float]
    # Seconds until admission stops (deadline minus safety margin); inf without a deadline.
    time_left_s: float
    will_miss: bool
    rows_expected_left: int
    # The ETA's range (80%: the calibration's uncertainty and the rows' own spread), once rows have finished.
    eta_low_s: Optional[float] = None
    eta_high_s: Optional[float] = None
    # What the model learned: actual / predicted output tokens on average, and the step cost.
    calibration: Optional[float] = None
    step_cost: Optional[tuple] = None
    # Rows in flight allowed (auto near a deadline), None for the engine's capacity.
    cap: Optional[int] = None


def rate_forecast(t, in_flight_tokens, num_in_flight, pending_tokens, num_unread, mean_tokens_per_row,
                  pending_counts) -> Forecast:
    """The forecast from a token rate (the tracker's measured one, else the configured one): pending_tokens are
    the predicted output tokens of pending rows in scheduling order, or, with pending_counts, distinct lengths in
    that order and how many rows have each. The rows done by the deadline are those whose tokens fit in it."""
    tps = t.tokens_per_s or 0.0
    values = np.asarray(pending_tokens, dtype=np.float64)
    counts = np.ones(len(values)) if pending_counts is None else np.asarray(pending_counts, dtype=np.float64)
    pending_sum = float(values @ counts) if len(values) else 0.0
    num_pending = int(counts.sum())
    unread_tokens = num_unread * mean_tokens_per_row
    remaining = in_flight_tokens + pending_sum + unread_tokens
    rows = num_in_flight + num_pending + num_unread
    eta = remaining / tps if tps > 0 else None
    left = t.time_left()
    if t.stop_at is None or eta is None:
        return Forecast(tps, remaining, rows, eta, left, False, 0)
    budget = tps * left - in_flight_tokens
    done = num_in_flight if budget >= 0 else 0
    if budget > 0:
        cum = np.cumsum(values * counts)
        k = int(np.searchsorted(cum, budget, side="right"))  # lengths whose rows all fit
        done += int(counts[:k].sum())
        spare = budget - (float(cum[k - 1]) if k else 0.0)
        if k < len(values):  # some of the next length's rows fit
            done += int(min(counts[k], spare // values[k]))
        elif mean_tokens_per_row > 0:
            done += min(num_unread, int(spare // mean_tokens_per_row))
    return Forecast(tps, remaining, rows, eta, left, eta > left, max(0, rows - done))


def model_forecast(t, scheduler, lengths, counts, unread: int, mean_predicted: float,
                   max_num_seqs: int) -> Forecast:
    """The forecast from the learned models: the step cost's fit, the length models refitted on the rows finished
    and running, and the drain of the rows running, queued, pending (``lengths`` and ``counts`` in run order) and
    not read yet (``unread``, at the mean prediction), over max_num_seqs slots."""
    a, b, c = t.step_cost.fit()
    run_p, run_g = t.inflight.running()
    t.learn()
    queued_p = t.inflight.queued()
    # Everything below counts sequences (a row of n samples is n of them, each a slot); rows come last.
    k = samples_per_row(scheduler)
    pend_p = np.asarray(lengths, dtype=np.float64)
    pend_n = np.asarray(counts, dtype=np.float64) * k
    model = t.lengths
    # the predictions of the rows still to start, per row as the rows seen are (the normal's prior); none: 0
    queued_rows_p = t.inflight.queued(per_sequence=False)
    qm, pm = queued_rows_p > 0, pend_p > 0
    pend_rows = np.asarray(counts, dtype=np.float64)
    rest = (float(queued_rows_p[qm].sum() + pend_p[pm] @ pend_rows[pm]), float(qm.sum() + pend_rows[pm].sum()))
    by_length, censored = scheduler.runs_by_length, False
    if by_length:  # the drawn rows counted by now (scheduling/drawn.py)
        t.drawn.release(min((r.drawn for r in scheduler.running.values() if r.drawn), default=None))
        # Under shortest-first the drawn rows finish after many of the short rows do: until as many count as their
        # line's prior weighs (DrawnRows.PRIOR_ROWS), the three models weighed, as in any order blind to the drawn
        # rows, and the rows left shifted as the drawn rows within their predictions say, those still running
        # counted as "at least" (censored_shift). The log ratio's mu, fitted on the rows predicted shortest, would
        # be the line's prior: on tests/test_forecast_drawn.py's rows spread 1.8 times too wide, that took the ETA
        # at 10% of rows from -13% to -19% (weighed) to +86% to +104%. The weighed models alone were 30% and 48%
        # short there on average where the predictions spread 0.6 and 0.15 times as wide as they know.
        if not scheduler.runs_longest_first and t.drawn.num_rows < DrawnRows.PRIOR_ROWS:
            by_length, censored = False, True
    model.fit(*t.inflight.running(per_sequence=False), left_shortest=scheduler.runs_longest_first, rest=rest,
              by_length=by_length)
    # auto near a deadline runs at most `cap` rows at once; every other case keeps the engine full
    cap = None
    left = t.time_left()
    if scheduler.policy == Policy.AUTO and t.stop_at is not None and scheduler.mode == Mode.DEADLINE:
        cap = _cap(t, a, b, c, left, model, queued_p, pend_p, pend_n, max_num_seqs)
    fill = np.concatenate([queued_p, pend_p])
    fill_n = np.concatenate([np.ones(len(queued_p)), pend_n])
    # Rows taken as one group at their mean prediction (a policy blind to length; the rows not read yet) are
    # expected to run the mean of what each prediction expects, not what the mean prediction expects: with
    # lengths cut at max_tokens that is less (Jensen), and the mean's would over-count them.
    hist_p, hist_n = (np.asarray(x, dtype=np.float64) for x in scheduler.pending_lengths())
    hist_p = hist_p * scheduler.forecast_scale
    blind = [len(queued_p)] if len(pend_p) == 1 and len(hist_p) > 1 else []
    mean_p = float(fill @ fill_n / fill_n.sum()) if fill_n.sum() else (mean_predicted or 1.0)
    left_shift = drawn_se = 0.0  # the rows left's log ratio, shifted by the rows drawn at random (below)
    fill_shift = blind_shift = 0.0  # the models' shift of the rows to start and of those not read yet (censored:
    # the weighed models', which do not all scale with the prediction)
    if censored:  # and the drawn rows running, as "at least this long" (DrawnRows.censored_shift)
        among = pend_p[pm] if pm.any() else fill
        rows_in = [scheduler.running.get(r) for r in t.inflight.start]
        drawn = np.fromiter((r is not None and bool(r.drawn) for r in rows_in), bool, len(rows_in))
        ratio = getattr(model, "ratio", model)
        seen = (ratio.mu, ratio.sigma, tuple(v[drawn] for v in t.inflight.running(per_sequence=False)))
        expects = (lambda p, s: model.expected(p, None, s), model.mu_stderr)
        if unread and len(hist_p):  # every row read, as every drawn row says
            mean_p, hist_p = _every_row(t, pend_p, pend_rows, pm, mean_p, hist_p, hist_n)
            blind_shift, drawn_se = t.drawn.censored_shift(*seen, None, model.cap, (hist_p, hist_n), *expects)
        bounds = (float(among.min()), float(among.max())) if len(among) else None
        left_shift, se = t.drawn.censored_shift(*seen, bounds, model.cap, (fill, fill_n), *expects)
        fill_shift, drawn_se = left_shift, max(drawn_se, se)
    elif by_length and getattr(model, "only", None) is None:
        # The rows left are the ones predicted shortest (longest under shortest-first): they run as the rows drawn
        # at random among them do, the rows not read yet as every drawn row (scheduling/drawn.py); those are
        # predicted as every row read is, not as the pool left (whose longest went first), in the pool's shape.
        among = pend_p[pm] if pm.any() else fill  # the pool's rows left; queued ones may be drawn, from anywhere
        left_shift, drawn_se = t.drawn.shift(model.mu, model.sigma, fill, fill_n,
                                             (float(among.min()), float(among.max())) if len(among) else None,
                                             lambda p, s: model.expected(p, None, s))
        fill = fill * math.exp(left_shift)
        run_p = _running_shifted(t, scheduler, model, run_p)
        if unread:
            mean_all, hist_p = _every_row(t, pend_p, pend_rows, pm, mean_p, hist_p, hist_n)
            d_all, se_all = t.drawn.shift(model.mu, model.sigma, hist_p, hist_n) if len(hist_p) else (0, 0)
            drawn_se = max(drawn_se, se_all)
            mean_p, hist_p = mean_all * math.exp(d_all), hist_p * math.exp(d_all)
    if unread:
        fill, fill_n = np.append(fill, mean_p), np.append(fill_n, unread * k)
        if len(hist_p):
            blind.append(len(fill) - 1)
    sequences = float(len(run_p) + fill_n.sum())
    queued_rows = len(t.inflight.info) - len(t.inflight.start)
    rows = len(t.inflight.info) + int(round(float(np.sum(counts)))) + unread
    per_row = sequences / rows if rows else 1.0
    prefill = (queued_rows + float(np.sum(counts)) + unread) * t.inflight.mean_prompt_tokens

    def expected_fill(shift: float) -> np.ndarray:
        e = model.expected(fill, None, shift + fill_shift)
        if blind:
            e[blind] = float(model.expected(hist_p, None, shift + blind_shift) @ hist_n) / float(hist_n.sum())
        return e

    context = _context_to_come(t, model, run_p, run_g, fill * math.exp(fill_shift), fill_n, expected_fill(0.0))
    if context is not None:  # a sequence-step costs as the context of the steps to come says (StepCost.rho)
        b = t.step_cost.per_seq_at(context)
    step_full = a + b * max_num_seqs

    # The rows done by the deadline: those that start by the stop (admission ends there) and finish by the
    # deadline, where the rows in flight drain to it (--on-deadline drain); by the stop, where they are aborted.
    until = max(left, t.deadline - t.clock()) if t.drains and t.stop_at is not None else left

    def eta(shift: float, tail: bool, slots: int = max_num_seqs, prefill_s: float = 0.0):
        # prefill_s: of the time to the deadline, what the prefills of the rows that start in it take from the steps
        step = a + b * slots
        within, start_by = ((max(0.0, until - prefill_s) / step, max(0.0, left - prefill_s) / step)
                            if step > 0 and left < math.inf else (math.inf, math.inf))
        run_e = model.expected(run_p, run_g, shift)
        fill_e, fill_k = chunks(expected_fill(shift), fill_n)
        group_p = chunks(fill * math.exp(fill_shift), fill_n)[0] if tail else None  # (the normal's: unshifted)
        d = drain(slots, run_e, fill_e, fill_k, within, (model, run_p, run_g, group_p, shift) if tail else None,
                  start_by, admitted=len(queued_p))
        return a * (d.steps + d.tail_steps) + b * d.tokens + c * prefill, d

    # The ETA is the rest's with the engine full: under auto's cap near a deadline the job stops at the
    # deadline, and the rest at the cap (a few rows at once) would read as an hour where a rerun takes minutes;
    # it is also what tells auto the deadline is safe again. The rows done by the deadline are the cap's.
    eta_s, d = eta(0.0, True)
    capped = None if cap is None else eta(0.0, False, cap)
    rows_by = d.rows_by if capped is None else capped[1].rows_by
    if t.stop_at is not None and c * prefill > 0:
        # The rows that start before the deadline spend part of it in their prefills: on a GPU the step cost's
        # fit gave those half of the time, and a deadline counted as all steps said "297 of 873 rows left" where
        # 503 were. The prefills of the rows that start by then, which start sooner the shorter they run
        # (shortest first): from their share of the whole rest's, a round halfway to those of the rows it starts
        # (a fixed point; a second round moved the counts by about 1%).
        slots = max_num_seqs if cap is None else cap
        whole = eta_s - a * d.tail_steps if capped is None else capped[0]  # the rest's, without the tail
        pre = c * prefill * min(1.0, left / whole) if whole > 0 else 0.0
        for _ in range(FIXED_POINT_ROUNDS):
            started = eta(0.0, False, slots, pre)[1].started_by
            pre = 0.5 * (pre + c * t.inflight.mean_prompt_tokens * started / per_row)
        rows_by = eta(0.0, False, slots, pre)[1].rows_by
    spread = Z80 * math.hypot(model.mu_stderr, drawn_se)
    low, _ = eta(-spread, False)
    high, _ = eta(spread, False)
    # the rows' own spread: the sum of many rows' lengths varies less than each
    var = (math.exp(model.sigma ** 2) - 1.0)
    rel = Z80 * math.sqrt(var * float(np.sum(expected_fill(0.0) ** 2 * fill_n)) +
                          var * float(np.sum(model.expected(run_p, run_g) ** 2))) / max(d.tokens, 1.0)
    tail = eta_s - (a * d.steps + b * d.tokens + c * prefill)
    low = max(0.0, low * (1 - rel))
    high = high * (1 + rel) + tail
    # the step cost's own drift over the run, which no fit foresees (StepCost.drift), beside the lengths' spread
    drift = Z80 * t.step_cost.drift
    if drift > 0:
        low = max(0.0, eta_s - math.hypot(max(0.0, eta_s - low), eta_s * -math.expm1(-drift)))
        high = eta_s + math.hypot(max(0.0, high - eta_s), eta_s * math.expm1(drift))
    # the engine's rate while full, with the prefills of the rows that start as others end (a step's alone was
    # 24k tok/s on a GPU whose runs went at 12k): what the Ray driver gives a worker's spare time
    seconds = step_full
    if c > 0 and fill_n.sum() > 0:
        mean_len = float(expected_fill(0.0) @ fill_n / fill_n.sum())
        seconds += c * t.inflight.mean_prompt_tokens * max_num_seqs / max(per_row * mean_len, 1.0)
    tokens_per_s = max_num_seqs / seconds if seconds > 0 else 0.0
    left_rows = max(0, round(rows - rows_by / per_row)) if t.stop_at is not None else 0
    # past the stop, and rows left: rows that would start after it, or an ETA past the deadline itself (every row
    # started by the stop, and the last still running at the deadline); an ETA within the drain, every row started
    # by the stop, leaves none (the job ends in the drain: it warned "7 of 7 rows left", and none was)
    will_miss = t.stop_at is not None and eta_s > left and (left_rows > 0 or eta_s > until)
    if will_miss:  # the rows' ends by the deadline leave out the drain's tail and the prefills the ETA has: a miss
        left_rows = max(1, left_rows)  # by a few seconds still leaves a row ("expect about 0 of 375 rows" it said)
    if cap is not None:
        cap = max(1, int(cap / per_row))  # the scheduler caps rows
    # actual over the pool's predictions as they are now (the models' are the first ones: forecast_scale), before
    # max_tokens cuts the longest
    calibration = math.exp(model.mu + model.sigma ** 2 / 2) * scheduler.forecast_scale
    split = (0.0, 0.0, 0.0)  # the tokens expected of the rows running, queued in the engine and still to start
    if log.isEnabledFor(logging.DEBUG):
        parts = expected_fill(0.0) * fill_n
        split = (float(model.expected(run_p, run_g).sum()), float(parts[:len(queued_p)].sum()),
                 float(parts[len(queued_p):].sum()))
    log.debug("forecast: step %.4f + %.5f/seq + %.2e/prompt token; context %.2e/token, %.0f a sequence to come "
              "(now %.0f); %d steps + %.0f tail, %.0f tokens (running %.0f, "
              "queued %.0f, to start %.0f), %.0f "
              "prompt tokens over %d slots (rows capped at %s); lengths mu %.3f sigma %.3f from %.1f rows; "
              "step cost drift %.3f; ETA %.1f s (%.1f-%.1f); lengths weighed %.2f normal, %.2f square root; "
              "rows left shifted %+.3f (se %.3f) by %d rows drawn at random (%s); tail of the rows running: %s",
              a, b, c, t.step_cost.context_cost, context or 0.0, t.step_cost.context_now, d.steps, d.tail_steps,
              d.tokens, *split, prefill, max_num_seqs, cap, model.mu, model.sigma, model.num_events, t.step_cost.drift,
              eta_s, low, high, model.weight, model.sqrt_weight,
              left_shift, drawn_se, t.drawn.num_rows,
              f"{t.drawn.censored_rows} with those running, as at least" if censored else "those alone",
              "sqrt ratio (calibrated predictions)" if getattr(model, "only", None) is not None else
              "square root" if model.tail is not None else "mixture")
    return Forecast(float(tokens_per_s), float(d.tokens), rows, float(eta_s), left, bool(will_miss),
                    int(left_rows) if will_miss else 0, float(min(low, eta_s)), float(max(high, eta_s)),
                    calibration, (a, b, c), cap)


def _context_to_come(t, model, run_p, run_g, fill_p, fill_n, fill_e) -> Optional[float]:
    """The mean context (prompt and tokens so far) a sequence holds over the steps still to come, each sequence-step
    weighed alike; None where the step cost has no term for it. A row of length L after a prompt of P tokens holds
    P + j at its j-th step: L * P + L^2 / 2 in all (E[L^2] from the length model's moments at its prediction, in
    the ratio to E[L]^2; the rows still to start at the mean prompt of the rows admitted), and a row running from g
    tokens on, r more to come, r * (P + g) + r^2 / 2."""
    if not t.step_cost.rho:
        return None
    run_e = model.expected(run_p, run_g)
    held = float(run_e @ t.inflight.contexts() + run_e @ run_e / 2) if len(run_p) else 0.0
    tokens = float(run_e.sum()) + float(fill_e @ fill_n)
    if len(fill_p):
        m1, m2 = model.moments(fill_p)
        ratio = np.clip(m2 / np.maximum(m1 * m1, 1e-9), 1.0, 4.0)  # E[L^2] / E[L]^2
        held += float(fill_n @ (fill_e * t.inflight.mean_prompt_tokens + ratio * fill_e * fill_e / 2))
    return held / tokens if tokens > 0 else None


def _every_row(t, pend_p, pend_rows, pm, mean_p: float, hist_p: np.ndarray, hist_n: np.ndarray):
    """The mean prediction of every row read (those admitted and those pending), and the pool's shape of
    predictions (hist_p, hist_n of each) moved to it: the rows not read yet, where the pool runs by predicted length
    and its rows left are the ones predicted shortest or longest, are predicted as every row read is."""
    n_all = t.admitted_rows + float(pend_rows[pm].sum())
    mean_all = (t.admitted_tokens + float(pend_p[pm] @ pend_rows[pm])) / n_all if n_all else mean_p
    hist_mean = float(hist_p @ hist_n / hist_n.sum()) if len(hist_p) else 0.0
    return mean_all, hist_p * (mean_all / hist_mean if hist_mean > 0 else 1.0)


def _running_shifted(t, scheduler, model, run_p: np.ndarray) -> np.ndarray:
    """The running sequences' predictions, those the policy picked shifted as the rows drawn at random among
    their predictions say (scheduling/drawn.py): under longest predicted first they are the pool's last head, and the
    log ratio fitted on the rows done (predicted longer) is not theirs. On tests/test_forecast_drawn.py's rows with
    predictions spread 0.15 times as wide as they know, the ETA at 75% of rows went from +16% to +6% on average when
    it was added (stop 66)."""
    rows = [scheduler.running.get(r) for r in t.inflight.start]
    picked = np.repeat(np.fromiter((r is not None and not r.drawn for r in rows), bool, len(rows)),
                       [t.inflight.info[r][2] for r in t.inflight.start] if len(rows) != len(run_p) else 1)
    if len(picked) != len(run_p) or not picked.any():
        return run_p
    shift, _ = t.drawn.shift(model.mu, model.sigma, run_p[picked], np.ones(int(picked.sum())),
                             (float(run_p[picked].min()), float(run_p[picked].max())),
                             lambda p, s: model.expected(p, None, s))
    return np.where(picked, run_p * math.exp(shift), run_p)


def _cap(t, a, b, c, left, model, queued_p, pend_p, pend_n, max_num_seqs) -> int:
    """The rows in flight that finish the most rows by the stop (cap.best_cap), from the next rows in
    run order. Until the step cost is known to grow with the sequences, the engine stays full but for the
    last stretch (as on a GPU, where it barely grows)."""
    nxt = np.concatenate([queued_p, np.repeat(pend_p[:max_num_seqs], pend_n[:max_num_seqs].astype(int))])
    nxt = nxt[:2 * max_num_seqs]
    if not len(nxt):
        return max_num_seqs
    m1, m2 = model.moments(nxt)
    mean = float(m1.mean())
    spread = float(m2.mean()) / max(mean * mean, 1e-9)  # E[L^2] / E[L]^2 over the next rows, as one pool
    per_seq = b if t.step_cost.knows_per_seq else 0.0
    fixed = a if t.step_cost.knows_per_seq else a + b * max_num_seqs
    prefill_per_row = c * t.inflight.mean_prompt_tokens
    return best_cap(max_num_seqs, fixed, per_seq, left, mean, prefill_per_row, spread, t.step_cost.knows_per_seq)
