"""How well does the forecast's length model predict the output tokens still to come? Replayed from finished runs.

For each finished `overnight run` folder given (the full runs of benchmarks/forecast.py, say), at the moments 5%,
10%, 25%, 50% and 75% of its rows had finished, this rebuilds what the deadline tracker saw: the finished rows
(prediction, length, whether max_tokens cut them), the rows running (prediction, tokens so far) and the rows not
started (prediction). Tokens so far come from a step clock: every running row gains one token a step, and the
steps' rate over time is fitted to all rows' first-token and finish times (a straight line per row overstates the
tokens of the rows still running late in a run, when the batch empties and steps get faster). It then fits a length
model on what was seen and compares the tokens it expects still to come with the tokens that came.

Models (pipeline/scheduling/lengths.py): LengthModel (log(actual / predicted) ~ Normal, censored),
NormalLengthModel (the length itself ~ Normal, the prediction not used) and LengthMixture (the forecast's: those two
and SqrtLengthModel weighed by how likely each makes what the run has seen, the priors at the mean prediction of
every row; the log ratio alone where the run ran longest predicted first, which it reads from the run's
status.json). A last line, for reference, is no model a run could have: every row drawn from the run's own lengths,
known in hindsight (Hindsight). "calibrated" is LengthMixture told that the predictions are a trained predictor's:
where the run ran longest predicted first, the sqrt ratio alone (SqrtRatioModel), elsewhere the same as the mixture.

    python benchmarks/length_replay.py OUT [OUT ...] [--max-tokens 512] [--variants] [--running] [--trace N]

Prints, per run and share, expected / actual tokens to come, and per model the mean |log| of that ratio. With
--running, the tokens still to come of the rows running at that moment only (what the end of the drain and its
tail draw on). With --trace N, the forecast's mixture at every N rows done up to a fifth of the rows: expected /
actual tokens to come, the weights of the normal and the square root, and the log ratio's fit (a transient early in
a run shows there).
"""

from __future__ import annotations

import argparse
import math

import numpy as np

SHARES = (0.05, 0.10, 0.25, 0.50, 0.75)


def load(out: str) -> dict:
    import duckdb

    rel = duckdb.sql(f"select predicted_tokens p, output_tokens a, finish_reason = 'length' cut, epoch(queued_at) q, "
                     f"epoch(first_token_at) f, epoch(finished_at) e from read_parquet('{out}/**/parts/*.parquet') "
                     f"where status = 'ok'")
    rows = rel.fetchall()
    d = {c: np.array([r[i] for r in rows], dtype=object) for i, c in enumerate(rel.columns)}
    d["f"] = np.array([x if x is not None else np.nan for x in d["f"]], dtype=np.float64)
    for c in ("p", "a", "q", "e"):
        d[c] = d[c].astype(np.float64)
    d["f"] = np.where(np.isnan(d["f"]), d["e"], d["f"])
    d["cut"] = d["cut"].astype(bool)
    return d


def step_clock(d: dict, dt: float = 0.5, smooth: float = 3.0):
    """Tokens a running row has gained by time t: the cumulative step rate, fitted by least squares so that each
    row's tokens after its first are the steps between its first token and its finish (smoothed over time)."""
    f, e, a = d["f"], d["e"], d["a"]
    edges = np.arange(f.min(), e.max() + dt, dt)
    k = len(edges) - 1
    lo = np.clip(f[:, None], edges[None, :-1], edges[None, 1:])
    hi = np.clip(e[:, None], edges[None, :-1], edges[None, 1:])
    m = np.vstack([hi - lo, np.diff(np.eye(k), axis=0) * smooth])
    y = np.concatenate([a - 1, np.zeros(k - 1)])
    rate = np.maximum(np.linalg.lstsq(m, y, rcond=None)[0], 0.0)
    cum = np.concatenate([[0.0], np.cumsum(rate * dt)])
    return lambda t: np.interp(t, edges, cum)


def state(d: dict, t: float, clock):
    fin = d["e"] <= t
    run = ~fin & (d["q"] <= t)
    pool = ~fin & (d["q"] > t)
    start = d["f"]
    g = np.floor(np.clip(clock(np.full_like(start, t)) - clock(np.minimum(start, t)), 0, d["a"] - 1))
    g = np.where(run & (start > t), 0.0, g)
    actual = float(np.sum(d["a"][run] - g[run]) + np.sum(d["a"][pool]))
    return fin, run, pool, g, actual


class Hindsight:
    """Not a model the forecast could have: every row's length drawn from the run's own lengths, all of them, known
    in hindsight, and blind to the predictions. What is left of its error is the luck of which rows are left (and
    what the predictions knew that a blind model cannot): the floor for any model that does not use them."""

    def __init__(self, lengths: np.ndarray):
        self.sorted = np.sort(lengths)
        self.tail_sum = np.concatenate([np.cumsum(self.sorted[::-1])[::-1], [0.0]])

    def observe(self, *_):
        pass

    def fit(self, *_):
        pass

    def expected(self, predicted, generated=None) -> np.ndarray:
        g = np.zeros(len(predicted)) if generated is None else np.asarray(generated, dtype=np.float64)
        k = np.searchsorted(self.sorted, g, side="right")  # the lengths above g
        alive = len(self.sorted) - k
        return np.where(alive > 0, self.tail_sum[k] / np.maximum(alive, 1) - g, 1.0)


def variants(max_tokens: int) -> dict:
    """Other ways to weigh the length models, tried and not kept (docs/BENCHMARKS.md): the log ratio and the normal
    alone, as the mixture was before the square root was weighed in ("before"); under longest first, a log-linear
    model with its slope on the prediction fixed at 0.75 or 0.875 instead of the log ratio's 1 ("slope"); the square
    root of the length (SqrtLengthModel) alone or weighed in with the others, the normal left out under longest
    first too ("three", "ratio or sqrt"); equal weights from 5 finished rows on; the likelihood difference divided
    by the square root of the rows; a log-normal on the length itself, blind to the predictions (LengthModel on a
    constant prediction); the log ratio without a shape (its Kaplan-Meier estimate); and for calibrated
    predictions, the sqrt ratio without its slope (as until stop 35) or with a lighter or heavier prior on it."""
    from overnight.pipeline.scheduling.lengths import LengthMixture, LengthModel

    class Two(LengthMixture):
        """The mixture before the square root was weighed in for the token sums: the log ratio and the normal."""
        SQRT_PRICE = math.inf

        def fit(self, p, g, left_shortest=False, rest=(0.0, 0.0)):
            out = super().fit(p, g, left_shortest, rest)
            self.sqrt_weight = 0.0
            return out

    class Equal(Two):
        def fit(self, p, g, left_shortest=False, rest=(0.0, 0.0)):
            super().fit(p, g, left_shortest, rest)
            if self.ratio.n >= 5 and not left_shortest:
                self.weight = 0.5
            else:  # as these were tried: the log ratio alone until 5 rows have finished
                self.weight, self.best = 0.0, self.ratio
            return self.best.mu, self.best.sigma

    class Damped(Two):
        def fit(self, p, g, left_shortest=False, rest=(0.0, 0.0)):
            super().fit(p, g, left_shortest, rest)
            if self.ratio.n >= 5 and not left_shortest:
                p, g = np.asarray(p, np.float64), np.asarray(g, np.float64)
                diff = (self.normal.loglik(p, g) - self.ratio.loglik(p, g)) / math.sqrt(self.ratio.n + len(p))
                self.weight = 1.0 / (1.0 + math.exp(-min(max(diff, -50.0), 50.0)))
                self.best = self.normal if self.weight > 0.5 else self.ratio
            else:
                self.weight, self.best = 0.0, self.ratio
            return self.best.mu, self.best.sigma

    class LogNormal:
        def __init__(self):
            self.m = LengthModel(max_tokens)

        def observe(self, p, a, cut):
            self.m.observe(np.full(len(p), 100.0), a, cut)

        def fit(self, p, g, **_):
            return self.m.fit(np.full(len(p), 100.0), g)

        def expected(self, p, g=None):
            return self.m.expected(np.full(len(p), 100.0), g)

    class KaplanMeier:
        """The ratio r = log(actual / predicted) without a shape: the product-limit (Kaplan-Meier) estimate over the
        finished rows, rows cut at max_tokens and rows running censored ("r at least this"). The mass it leaves
        beyond its largest ratio (a censored one) goes to 8 points of LengthModel's log-normal above it."""

        def __init__(self, tail_at_cap: bool = False):
            self.m = LengthModel(max_tokens)
            self.exact, self.cens = [], []
            self.tail_at_cap = tail_at_cap  # the mass beyond the largest ratio runs to max_tokens instead

        def observe(self, p, a, cut):
            self.m.observe(p, a, cut)
            p, a, cut = (np.asarray(x, np.float64) for x in (p, a, cut))
            r = np.log(np.maximum(a, 1.0) / np.maximum(p, 1.0))
            self.exact.extend(r[cut == 0].tolist())
            self.cens.extend(r[cut == 1].tolist())

        def fit(self, p, g, **_):
            from overnight.pipeline.scheduling.lengths import norm_cdf

            mu, sigma = self.m.fit(np.asarray(p, np.float64), np.asarray(g, np.float64))
            keep = (np.asarray(p) > 0) & (np.asarray(g) > 0)
            cens = np.concatenate([self.cens, np.log(np.asarray(g, np.float64)[keep] / np.asarray(p, np.float64)[keep])])
            ex = np.sort(np.asarray(self.exact))
            times = np.unique(ex)
            at_risk = len(ex) - np.searchsorted(ex, times, side="left") + (len(cens) - np.searchsorted(np.sort(cens), times, side="left"))
            deaths = np.searchsorted(ex, times, side="right") - np.searchsorted(ex, times, side="left")
            surv = np.cumprod(1.0 - deaths / np.maximum(at_risk, 1))
            mass = -np.diff(np.concatenate([[1.0], surv]))
            tail = float(surv[-1]) if len(surv) else 1.0
            last = float(times[-1]) if len(times) else -np.inf
            # the tail's 8 points: quantiles of N(mu, sigma) above `last`
            lo = float(norm_cdf((last - mu) / sigma)) if np.isfinite(last) else 0.0
            qs = lo + (1.0 - lo) * (np.arange(8) + 0.5) / 8
            from statistics import NormalDist
            tail_r = np.array([NormalDist(mu, sigma).inv_cdf(min(max(q, 1e-9), 1 - 1e-9)) for q in qs])
            if self.tail_at_cap:
                tail_r = np.full(8, np.inf)
            self.atoms = np.concatenate([times, tail_r])
            self.weights = np.concatenate([mass, np.full(8, tail / 8)])
            return mu, sigma

        def expected(self, p, g=None):
            p = np.maximum(np.asarray(p, np.float64), 1.0)
            g = np.zeros(len(p)) if g is None else np.asarray(g, np.float64)
            L = np.minimum(p[:, None] * np.exp(self.atoms[None, :]), max_tokens)
            alive = (L > g[:, None]) * self.weights[None, :]
            tot = alive.sum(axis=1)
            e = (alive * (L - g[:, None])).sum(axis=1) / np.maximum(tot, 1e-12)
            return np.where(tot > 1e-9, np.maximum(e, 1.0), self.m.expected(p, g))

    from overnight.pipeline.scheduling.lengths import SqrtLengthModel

    class Three(LengthMixture):
        """The log ratio, the normal and the square root (LengthMixture's sqrt) weighed by likelihood for the token
        sums under longest first too (the normal left out there, or always: "ratio or sqrt"); the square root pays
        one nat for its third parameter ("no penalty": none)."""

        def __init__(self, max_tokens, penalty=1.0, with_normal=True):
            super().__init__(max_tokens)
            self.penalty, self.with_normal = penalty, with_normal

        def fit(self, p, g, left_shortest=False, rest=(0.0, 0.0)):
            p, g = np.asarray(p, np.float64), np.asarray(g, np.float64)
            self.ratio.fit(p, g)
            self.sqrt.fit(p, g, rest=rest)
            models = [(self.ratio, self.ratio.loglik(p, g)), (self.sqrt, self.sqrt.loglik(p, g) - self.penalty)]
            if not left_shortest and self.with_normal:
                self.normal.fit(p, g, rest=rest)
                models.append((self.normal, self.normal.loglik(p, g)))
            ll = np.array([x[1] for x in models])
            w = np.exp(ll - ll.max())
            self.parts = [(m, float(wi)) for (m, _), wi in zip(models, w / w.sum())]
            self.best = max(self.parts, key=lambda x: x[1])[0]
            return self.best.mu, self.best.sigma

        def expected(self, predicted, generated=None, shift=0.0):
            return sum(w * m.expected(predicted, generated, shift) for m, w in self.parts)

    class FixedSlope(LengthMixture):
        """Under longest predicted first, log(actual) ~ Normal(mu + b log(predicted), sigma) with b fixed below the
        log ratio's 1 (LengthModel on predictions p_mean^(1 - b) p^b, p_mean the mean prediction of every row);
        elsewhere the mixture."""

        def __init__(self, max_tokens, b):
            super().__init__(max_tokens)
            self.b, self.seen, self.sloped = b, ([], [], []), None

        def observe(self, p, a, cut):
            super().observe(p, a, cut)
            for kept, x in zip(self.seen, (p, a, cut)):
                kept.extend(np.asarray(x).tolist())

        def _eff(self, p):
            return self.p_mean ** (1.0 - self.b) * np.maximum(np.asarray(p, np.float64), 1.0) ** self.b

        def fit(self, p, g, left_shortest=False, rest=(0.0, 0.0)):
            out = super().fit(p, g, left_shortest, rest)
            self.sloped = None
            if left_shortest:
                count = len(self.seen[0]) + len(p) + rest[1]
                self.p_mean = (sum(self.seen[0]) + float(np.sum(p)) + rest[0]) / max(count, 1)
                self.sloped = LengthModel(max_tokens)
                self.sloped.observe(self._eff(self.seen[0]), self.seen[1], self.seen[2])
                self.sloped.fit(self._eff(p), np.asarray(g, np.float64))
            return out

        def expected(self, predicted, generated=None, shift=0.0):
            if self.sloped is None:
                return super().expected(predicted, generated, shift)
            return self.sloped.expected(self._eff(predicted), generated, shift)

    from overnight.pipeline.scheduling.sqrt_ratio import SqrtRatioModel

    def calibrated(slope_weight):
        """LengthMixture(calibrated=True) with a prior this heavy on the sqrt ratio's slope (1e9: none, as until
        stop 35)."""
        def make():
            m = LengthMixture(max_tokens, calibrated=True)
            m.sqrt_ratio = SqrtRatioModel(max_tokens, slope_weight=slope_weight)
            return m
        return make

    return {"calibrated, no slope (LengthMixture)": calibrated(1e9),
            "calibrated, slope weight 3 (LengthMixture)": calibrated(3.0),
            "calibrated, slope weight 30 (LengthMixture)": calibrated(30.0),
            "ratio or normal (before)": lambda: Two(max_tokens),
            "slope 0.75 under longest first": lambda: FixedSlope(max_tokens, 0.75),
            "slope 0.875 under longest first": lambda: FixedSlope(max_tokens, 0.875),
            "three, no penalty": lambda: Three(max_tokens, 0.0),
            "ratio or sqrt": lambda: Three(max_tokens, with_normal=False),
            "sqrt length": lambda: SqrtLengthModel(max_tokens),
            "equal weights": lambda: Equal(max_tokens), "likelihood / sqrt(rows)": lambda: Damped(max_tokens),
            "log-normal on length": LogNormal, "Kaplan-Meier ratio": KaplanMeier,
            "Kaplan-Meier ratio, tail at max_tokens": lambda: KaplanMeier(tail_at_cap=True)}


def runs_longest_first(out: str) -> bool:
    """Whether the run ran the rows predicted longest first (longest-first; auto without a deadline at risk) and
    drew none at random, as the forecast's LengthMixture is told (its left_shortest)."""
    import json
    import os

    status = json.load(open(os.path.join(out, "status.json")))
    policy = (status.get("scheduler") or {}).get("policy")
    if (status.get("scheduler") or {}).get("sampled"):  # rows drawn at random (tried at 9b3b854, not kept)
        return False
    return policy == "longest-first" or (policy == "auto" and (status.get("forecast") or {}).get("mode") == "throughput")


def replay(d: dict, make, clock, running_only: bool = False, **fit_kw) -> list[float]:
    order = np.sort(d["e"])
    n = len(order)
    ratios = []
    for share in SHARES:
        t = order[int(math.ceil(share * n)) - 1] + 0.01
        fin, run, pool, g, actual = state(d, t, clock)
        model = make()
        model.observe(d["p"][fin], d["a"][fin], d["cut"][fin])
        if "left_shortest" in fit_kw:  # a LengthMixture: the predictions of the rows not started, for its prior
            fit_kw["rest"] = (float(d["p"][pool].sum()), float(pool.sum()))
        model.fit(d["p"][run], g[run], **fit_kw)
        expected = float(model.expected(d["p"][run], g[run]).sum())
        if running_only:  # the rows running only: what they have still to generate
            ratios.append(expected / float(np.sum(d["a"][run] - g[run])))
            continue
        if pool.any():
            expected += float(model.expected(d["p"][pool]).sum())
        ratios.append(expected / actual)
    return ratios


def trace(out: str, every: int, max_tokens: int) -> None:
    """The mixture at every `every` rows done, up to a fifth of the rows."""
    from overnight.pipeline.scheduling.lengths import LengthMixture

    d = load(out)
    clock = step_clock(d)
    order = np.sort(d["e"])
    for k in range(every, max(every, len(order) // 5) + 1, every):
        fin, run, pool, g, actual = state(d, order[k - 1] + 0.01, clock)
        m = LengthMixture(max_tokens)
        m.observe(d["p"][fin], d["a"][fin], d["cut"][fin])
        m.fit(d["p"][run], g[run], left_shortest=runs_longest_first(out),
              rest=(float(d["p"][pool].sum()), float(pool.sum())))
        e = float(m.expected(d["p"][run], g[run]).sum() + m.expected(d["p"][pool]).sum())
        print(f"  {out}  {k:4d} rows done: x{e / actual:.2f}, normal's weight {m.weight:.2f}, the square root's "
              f"{m.sqrt_weight:.2f}, log ratio mu {m.ratio.mu:.2f} sigma {m.ratio.sigma:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outs", nargs="+")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--variants", action="store_true", help="also the weighings tried and not kept")
    ap.add_argument("--running", action="store_true", help="score the tokens still to come of the rows running "
                                                           "only (what the drain's end and its tail draw on)")
    ap.add_argument("--trace", type=int, default=0, metavar="N",
                    help="only the mixture at every N rows done, up to a fifth of the rows")
    args = ap.parse_args()
    if args.trace:
        for out in args.outs:
            trace(out, args.trace, args.max_tokens)
        return
    from overnight.pipeline.scheduling.lengths import LengthMixture, LengthModel, NormalLengthModel

    models = {"log ratio (LengthModel)": lambda: LengthModel(args.max_tokens),
              "normal on length": lambda: NormalLengthModel(args.max_tokens),
              "all, weighed (LengthMixture)": lambda: LengthMixture(args.max_tokens),
              "calibrated (LengthMixture)": lambda: LengthMixture(args.max_tokens, calibrated=True)}
    if args.variants:
        models.update(variants(args.max_tokens))
    hindsight = "hindsight (the run's own lengths)"
    table = {name: [] for name in [*models, hindsight]}
    print("expected / actual output tokens to come, at " + " / ".join(f"{s:.0%}" for s in SHARES) + " of rows")
    for out in args.outs:
        d = load(out)
        clock = step_clock(d)
        for name, make in models.items():
            mixture = "Mixture" in name or name in ("equal weights", "likelihood / sqrt(rows)", "three, no penalty",
                                                   "ratio or sqrt", "ratio or normal (before)")
            mixture = mixture or name.startswith("slope")
            r = replay(d, make, clock, args.running, **({"left_shortest": runs_longest_first(out)} if mixture else {}))
            table[name].append(r)
            print(f"  {out}  {name:22s} " + " ".join(f"{x:.2f}" for x in r))
        r = replay(d, lambda: Hindsight(d["a"]), clock, args.running)
        table[hindsight].append(r)
        print(f"  {out}  {hindsight:22s} " + " ".join(f"{x:.2f}" for x in r))
    print("mean |log(expected / actual)| at each share; at 10-50%; share of points within 10%; at 10-50%; worst "
          "expected / actual at 10-50%:")
    for name, rows in table.items():
        le = np.abs(np.log(np.array(rows)))
        core = le[:, 1:4]
        print(f"  {name:22s} " + " ".join(f"{x:.3f}" for x in le.mean(0)) + f"; {core.mean():.3f}; "
              f"{np.mean(le < math.log(1.1)):.0%}; {np.mean(core < math.log(1.1)):.0%}; "
              f"{float(np.array(rows)[:, 1:4].flat[np.argmax(core)]):.2f}")


if __name__ == "__main__":
    main()
