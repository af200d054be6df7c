"""How long rows really run, against their predictions, fitted during a run.

    LengthModel        log(actual / predicted) ~ Normal(mu, sigma), fitted on finished rows and on rows still
                       running, which count as "at least this long" (censored), so the long rows still running
                       early in a job are not missed; a row that hit max_tokens is censored at it too
    NormalLengthModel  the length itself ~ Normal(m, s), censored the same way, blind to the predictions
    SqrtLengthModel    sqrt(length) ~ Normal(a + b log(predicted), s), censored the same way: the shape of what a
                       row that has run long has left, where lengths are skewed to the left in log
    SqrtRatioModel     sqrt(actual / predicted) ~ Normal(a + b log(predicted), s), censored the same way: the log
                       ratio's scale with the square root's shape, and a slope for predictions spread wider than
                       they know
    LengthMixture      the forecast's: the three first, weighed by how likely each makes what the run has seen; the
                       log ratio alone where the rows run longest predicted first, and there the drain's tail of the
                       rows running from the square root where the run makes it likelier; the sqrt ratio alone there
                       where the predictions are a trained predictor's (calibrated)

NormalLengthModel and SqrtLengthModel are in length_shapes.py, SqrtRatioModel in sqrt_ratio.py; the censored
normal's pieces that the models share are in censored.py.
Pure numpy; the deadline tracker (scheduling/deadline.py) feeds it finished rows, and its forecast
(scheduling/estimate.py) asks it what the rows left will generate. The drain that uses it is in scheduling/forecast.py.
"""

from __future__ import annotations

import math

import numpy as np

from overnight.pipeline.scheduling.censored import (censored_normal_fit, censored_normal_loglik, censored_points,
                                                   count_into, finished_rows, norm_cdf, norm_pdf,  # noqa: F401
                                                   remaining_cdf)
from overnight.pipeline.scheduling.length_shapes import NormalLengthModel, SqrtLengthModel
from overnight.pipeline.scheduling.sqrt_ratio import SqrtRatioModel


# -- lengths -----------------------------------------------------------------------------------------
class LengthModel:
    """Actual output lengths against predicted ones: r = log(actual / predicted) ~ Normal(mu, sigma).

    Finished rows give r exactly; rows that hit max_tokens and rows still running give "r is at least this"
    (censored), which an EM fit of a censored normal uses. A prior (mu 0, sigma prior_sigma, worth
    prior_weight rows) holds the fit until rows finish."""

    BIN = 0.02  # censored points at the cap are kept as a histogram of r, in bins this wide

    def __init__(self, max_tokens: int, prior_sigma: float = 0.8, prior_weight: float = 3.0):
        self.cap = float(max_tokens)
        self.prior_sigma, self.prior_weight = prior_sigma, prior_weight
        self.n = 0
        self.s1 = 0.0
        self.s2 = 0.0
        self.log_a = 0.0  # sum of log(actual) of those rows, for the likelihood (the density of L, not of r)
        self.capped: dict[int, int] = {}
        self.mu, self.sigma = 0.0, prior_sigma
        self.num_events = 0.0  # rows whose r is known exactly, for the fit's standard error

    def observe(self, predicted, actual, hit_cap) -> None:
        p, a, cut = finished_rows(predicted, actual, hit_cap, self.cap)
        if not len(p):
            return
        r = np.log(a / p)
        count_into(self.capped, r[cut], self.BIN)
        free = r[~cut]
        self.n += len(free)
        self.s1 += float(free.sum())
        self.s2 += float(free @ free)
        self.log_a += float(np.log(a[~cut]).sum())

    def _censored(self, running_p: np.ndarray, running_g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        keep = (running_p > 0) & (running_g > 0)
        return censored_points(np.log(running_g[keep] / running_p[keep]), self.capped, self.BIN)

    def fit(self, running_p: np.ndarray, running_g: np.ndarray, iterations: int = 25) -> tuple[float, float]:
        """Refit on the finished rows and the rows running now (predicted p, g tokens so far)."""
        c, w = self._censored(running_p, running_g)
        start = (self.mu, self.sigma) if self.n else (0.0, self.prior_sigma)
        self.mu, self.sigma, self.num_events = censored_normal_fit(
            self.n, self.s1, self.s2, c, w, (0.0, self.prior_sigma, self.prior_weight), start, 0.05, iterations, 1e-4)
        return self.mu, self.sigma

    @property
    def mu_stderr(self) -> float:
        return self.sigma / math.sqrt(self.num_events + self.prior_weight)

    def loglik(self, running_p: np.ndarray, running_g: np.ndarray) -> float:
        """Log-likelihood of the lengths seen (as densities of the length itself) and of the censored rows."""
        c, w = self._censored(running_p, running_g)
        return censored_normal_loglik(self.n, self.s1, self.s2, -self.log_a, c, w, self.mu, self.sigma)

    def expected(self, predicted, generated=None, shift: float = 0.0) -> np.ndarray:
        """Expected tokens still to come for rows with these predictions that have generated ``generated`` so far
        (0: not started): E[min(L, cap) - g | L > g]."""
        p = np.maximum(np.asarray(predicted, dtype=np.float64), 1.0)
        g = np.zeros_like(p) if generated is None else np.minimum(np.asarray(generated, dtype=np.float64),
                                                                    self.cap - 1)
        m = np.log(p) + self.mu + shift
        s = self.sigma
        lc = math.log(self.cap)
        lg = np.log(np.maximum(g, 1e-9))
        above_cap = 1.0 - norm_cdf((lc - m) / s)
        # E[min(L, cap) * 1{L > g}]
        part = np.exp(m + s * s / 2) * (norm_cdf((lc - m - s * s) / s) - norm_cdf((lg - m - s * s) / s))
        part = np.maximum(part, 0.0) + self.cap * above_cap
        survive = np.clip(1.0 - norm_cdf((lg - m) / s), 1e-12, None)
        cond = np.where(g > 0, part / survive, part)
        return np.clip(cond - g, 1.0, self.cap - g)

    def moments(self, predicted, shift: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """E[min(L, cap)] and E[min(L, cap)^2] of rows with these predictions, not started."""
        p = np.maximum(np.asarray(predicted, dtype=np.float64), 1.0)
        m = np.log(p) + self.mu + shift
        s = self.sigma
        lc = math.log(self.cap)
        above = 1.0 - norm_cdf((lc - m) / s)
        m1 = np.exp(m + s * s / 2) * norm_cdf((lc - m - s * s) / s) + self.cap * above
        m2 = np.exp(2 * m + 2 * s * s) * norm_cdf((lc - m - 2 * s * s) / s) + self.cap ** 2 * above
        return m1, m2

    def quantile_cdf(self, x, predicted, generated, shift: float = 0.0) -> np.ndarray:
        """P(remaining <= x) for rows (predicted, generated) at remaining lengths x (broadcast)."""
        p = np.maximum(np.asarray(predicted, dtype=np.float64), 1.0)
        g = np.asarray(generated, dtype=np.float64)
        m = np.log(p) + self.mu + shift
        s = self.sigma
        f_g = np.where(g > 0, norm_cdf((np.log(np.maximum(g, 1e-9)) - m) / s), 0.0)
        total = g + np.maximum(x, 0.0)
        f_x = np.where(total >= self.cap, 1.0, norm_cdf((np.log(np.maximum(total, 1e-9)) - m) / s))
        return remaining_cdf(f_x, f_g, x, total, self.cap)


class LengthMixture:
    """The log ratio, the normal and the square root fitted on the same rows, weighed by how likely each makes what
    the run has seen (finished lengths, and rows still running or cut at max_tokens as "at least"): the posterior
    of three models, equal a priori, the square root's third parameter (its slope on the prediction) priced at one
    nat (``SQRT_PRICE``). The forecast's expected lengths, moments and tail are the mixture (but for the rows run
    longest predicted first, below);
    its summaries (mu, sigma, their standard error) the weightiest model's. Early on, when the evidence is thin,
    the models are averaged rather than chosen between: from the first step, not only once a few rows have finished,
    because the first rows to finish are few under any order and the log ratio alone errs with the order. Under
    shortest predicted first, auto's near a deadline, the rows running are the ones predicted shortest, and their
    lengths, which the predictions barely tell apart, make the log ratio's scale high for every row to come (x0.80-1.45,
    mostly high, of the tokens to come at 1-3 finished rows in benchmarks/length_early.py's emulation of 8 runs;
    x0.81-1.05 with the log ratio and the normal weighed, before the square root was weighed in too).

    The square root is there because the embedded model's lengths are between the two shapes (in hindsight, a
    power of the length is likeliest between the 1/4 and the 3/4 power: SqrtLengthModel): the log ratio's one spread
    gives a row that has run long a tail too long, and the normal's too short, and the weight swung between the two
    early in a run (x0.77-1.27 of the tokens to come at 2-30 rows done in
    benchmarks/length_replay.py --trace on open-workload fifo runs). Replayed on 16 full runs in every order but
    longest predicted first (fifo on both workloads, one shortest-first), the tokens to come at 10-50% of rows were off
    by 0.054 in mean |log|, and by 0.066 with the log ratio and the normal alone; at 5%, 0.129 and 0.144
    (docs/BENCHMARKS.md, "The square root of the length weighed in").

    Where the rows run longest predicted first (``left_shortest``), LengthModel alone. The rows left are then the
    ones predicted shortest, and the rows seen cannot say what the normal, blind to the predictions, would need to
    know: that those run shorter. It takes the mean of the rows seen for them, and the likelihood of the rows seen
    cannot tell it wrong. Replayed on 10 full runs (docs/BENCHMARKS.md), the weighing said x1.13-1.31 at 10-50% of
    rows under longest-first and auto on the mixed workload, the log ratio x0.89-1.03.

    Under that order the end of the drain is the rows running, and the log ratio's one spread, widened by the few
    very short answers, expects a row that has run long to run on 15-39% longer than such rows do (hindsight over
    six full runs, benchmarks/length_shape.py): the drain's tail came out 15-34% long from 58% of rows on
    (benchmarks/drain_steps.py). There the tail's CDF of the rows running (``quantile_cdf`` where generated > 0)
    comes from SqrtLengthModel when the run makes it likelier than the log ratio by more than a nat (its third
    parameter's price). The drain's steps still come from the log ratio's expected lengths, so its end is then the
    larger of those steps and the expected latest end under the square root. The token sums, and the tail of the rows
    not started, stay the log ratio's: replayed on five longest-first and auto runs, the square root weighed in for
    them made the tokens to come x0.84-1.30 at 25-50% of rows, the log ratio x0.83-1.08 (benchmarks/length_replay.py
    --variants, "ratio or sqrt"). Where lengths are log-normal around their predictions (tests/test_forecast.py's
    fake clock) the likelihood keeps the log ratio for the tail too, once 5% of the rows are done.

    Where the rows run longest predicted first and the predictions are a trained predictor's (``calibrated``: its
    mean is fitted to actual lengths), SqrtRatioModel alone for every expected length and moment. A calibrated
    prediction says how long the rows left run, and the log ratio's one spread then over-counts the rows running and
    those not started alike. Replayed on 8 real runs of the mixed workload under longest-first and auto with a
    predictor trained on rows they do not hold (benchmarks/length_replay.py), the tokens to come at 10-50% of rows
    were off by 0.052 in mean |log| (75% of points within 10%), the log ratio's by 0.090 (58%); on 14 more, not used
    to choose the prior on its slope, 0.070 (69%) against 0.113 (45%). On 4 runs of 80 open rows, 0.168 against
    0.360 (docs/BENCHMARKS.md, "The sqrt ratio for a trained predictor's rows, longest first" and "The sqrt ratio's
    slope on the prediction"). With the heuristic's predictions it did worse than the log ratio
    (benchmarks/length_labelled.py), so it is used for trained ones only. In any other order the weighing stands
    (there it is about even with the sqrt ratio, ibid., --fifo).

    The drain's tail there (``quantile_cdf``, of every row) is the log ratio's (``spread``): the few answers that
    loop to max_tokens make a run's end later than the sqrt ratio's light tail says, and its likelihood on the rows
    seen does not show it. On a simulated engine over the embedded model's labelled lengths
    (benchmarks/tail_spread.py), with a GPU's step cost, where the end is the latest row's, the sqrt ratio's own tail
    put the ETA at 50% of rows at x0.78-0.87 (medians, four workloads), within ±10% in 0-33% of draws; the log
    ratio's at x0.94-0.97, 92-100%. With this CPU's, where the tokens rule, the median |error| went from 3.1-11.2% to
    3.7-8.0% (docs/BENCHMARKS.md, "The floor under the ETA's error"). Where lengths are exactly sqrt-normal around
    the predictions and none loops, the log ratio's tail is too long instead: on tests/test_forecast.py's GPU story
    the ETA came out +8-13% at 10% of rows, +6-15% at 25% and +19-21% at 50% (-7% to +4% with the sqrt ratio's
    tail). Its mean, higher than the sqrt ratio's on calibrated rows, comes with it; a tail of the log ratio's
    shape moved to the sqrt ratio's mean is the next thing to try."""

    SQRT_PRICE = 1.0  # nats: the square root's third parameter (the slope on the prediction)

    def __init__(self, max_tokens: int, calibrated: bool = False):
        self.ratio, self.normal = LengthModel(max_tokens), NormalLengthModel(max_tokens)
        self.sqrt = SqrtLengthModel(max_tokens)
        # calibrated: the predictions come from a trained predictor; under longest-first, SqrtRatioModel alone
        self.calibrated = calibrated
        self.sqrt_ratio = SqrtRatioModel(max_tokens) if calibrated else None
        self.only = None  # the one model every answer comes from, if not the weighing
        self.weight = 0.0  # the normal model's
        self.sqrt_weight = 0.0  # the square root's (the log ratio's is what is left)
        self.best = self.ratio
        self.tail = None  # the model whose quantile_cdf the drain's tail uses for the rows running, if not the mixture
        self.spread = None  # the model whose quantile_cdf the drain's tail uses for every row, if not the above

    def grow_cap(self, max_tokens: int) -> None:
        """A row may ask for more than the job's max_tokens (its own max_tokens column, an OpenAI body's): the
        lengths the models allow grow to the largest any admitted row asks for. (One cap for every row: where
        rows' limits differ, the ones with a lower limit are then allowed too much, and the forecast errs long,
        not short.)"""
        for m in (self.ratio, self.normal, self.sqrt, self.sqrt_ratio):
            if m is not None and max_tokens > m.cap:
                m.cap = float(max_tokens)

    def observe(self, predicted, actual, hit_cap) -> None:
        self.ratio.observe(predicted, actual, hit_cap)
        self.normal.observe(predicted, actual, hit_cap)
        self.sqrt.observe(predicted, actual, hit_cap)
        if self.sqrt_ratio is not None:
            self.sqrt_ratio.observe(predicted, actual, hit_cap)

    def fit(self, running_p: np.ndarray, running_g: np.ndarray, left_shortest: bool = False,
            rest: tuple[float, float] = (0.0, 0.0), by_length: bool = False) -> tuple[float, float]:
        """Refit on the finished rows and the rows running (predicted p, g tokens so far) and weigh the three models,
        or (left_shortest; by_length: the rows run by predicted length either way, shortest-first too) choose the
        tail's model; rest: the sum and the count of the predictions of the rows still to start (the priors of the
        normal and the square root)."""
        running_p, running_g = np.asarray(running_p, np.float64), np.asarray(running_g, np.float64)
        self.only = self.spread = None
        if left_shortest and self.sqrt_ratio is not None:
            self.sqrt_ratio.fit(running_p, running_g, rest=rest)
            self.ratio.fit(running_p, running_g)  # the drain's tail: its spread (below)
            self.weight = self.sqrt_weight = 0.0
            self.tail = None
            self.best = self.only = self.sqrt_ratio
            self.spread = self.ratio
            return self.best.mu, self.best.sigma
        self.ratio.fit(running_p, running_g)
        self.sqrt.fit(running_p, running_g, rest=rest)
        ratio_ll = self.ratio.loglik(running_p, running_g)
        sqrt_ll = self.sqrt.loglik(running_p, running_g) - self.SQRT_PRICE
        self.weight = self.sqrt_weight = 0.0
        self.tail = None
        self.best = self.ratio
        if left_shortest or by_length:
            self.tail = self.sqrt if sqrt_ll > ratio_ll else None
            return self.best.mu, self.best.sigma
        self.normal.fit(running_p, running_g, rest=rest)
        ll = np.nan_to_num(np.array([ratio_ll, self.normal.loglik(running_p, running_g), sqrt_ll]), nan=-np.inf)
        if not np.isfinite(ll.max()):  # the likelihoods cannot be compared (NaN, infinite): the log ratio
            return self.best.mu, self.best.sigma
        w = np.exp(np.maximum(ll - ll.max(), -50.0))
        w /= w.sum()
        self.weight, self.sqrt_weight = float(w[1]), float(w[2])
        self.best = (self.ratio, self.normal, self.sqrt)[int(np.argmax(w))]
        return self.best.mu, self.best.sigma

    def _mix(self, call):
        """call(model) of the one model with weight, or of each, weighed (each part of a tuple)."""
        if self.only is not None:
            return call(self.only)
        parts = [(m, w) for m, w in ((self.ratio, 1.0 - self.weight - self.sqrt_weight), (self.normal, self.weight),
                                     (self.sqrt, self.sqrt_weight)) if w > 1e-9]
        if len(parts) == 1:
            return call(parts[0][0])
        out = [(call(m), w) for m, w in parts]
        if isinstance(out[0][0], tuple):
            return tuple(sum(w * o[i] for o, w in out) for i in range(len(out[0][0])))
        return sum(w * o for o, w in out)

    def expected(self, predicted, generated=None, shift: float = 0.0) -> np.ndarray:
        return self._mix(lambda m: m.expected(predicted, generated, shift))

    def moments(self, predicted, shift: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        return self._mix(lambda m: m.moments(predicted, shift))

    def quantile_cdf(self, x, predicted, generated, shift: float = 0.0) -> np.ndarray:
        if self.spread is not None:
            return self.spread.quantile_cdf(x, predicted, generated, shift)
        mixed = self._mix(lambda m: m.quantile_cdf(x, predicted, generated, shift))
        if self.tail is None:
            return mixed
        return np.where(np.asarray(generated) > 0, self.tail.quantile_cdf(x, predicted, generated, shift), mixed)

    def __getattr__(self, name):  # cap, mu, sigma, mu_stderr, num_events
        if "best" not in self.__dict__:  # (copying, unpickling)
            raise AttributeError(name)
        return getattr(self.__dict__["best"], name)
