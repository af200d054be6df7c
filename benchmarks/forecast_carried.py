"""A length shape carried into the run, against the one the run learns alone (issue 10 §1, stop 40); not kept.

Stop 39 (benchmarks/forecast_variants.py --part priors) found that a strong prior on the sqrt ratio's shape closes
most of the gap left under longest-first with a trained predictor, but only when the prior is right: with every
prediction x0.7 or x1.4 it failed. This measures the honest version of that prior and a guard against its failure:

    the product's  SqrtRatioModel as LengthMixture(calibrated=True) fits it under longest-first: a = 1, s = 0.4,
                   worth 3 rows
    carried        the prior is the sqrt ratio fitted on labelled rows that are not in the run (both samplings of
                   every other labelled prompt, the trained predictor's out-of-fold predictions): what a trained
                   predictor's file could carry from its own held-out rows. Worth 10 or 30 rows
    guarded        the product's fit and the carried one, weighed by how likely each makes the mean the run has
                   seen: the sqrt ratio's a, fitted with the weak prior, against Normal(a_k, s^2 / w_k + se^2),
                   a_k and w_k each prior's mean and worth, se the fit's standard error (a normal mean's evidence
                   under each prior); equal odds a priori

Each with the predictions as they are, and x0.7 and x1.4 (the carried shape then no longer fits the run's rows).
The runs are emulated as benchmarks/forecast_variants.py's (the 480 labelled prompts, 64 slots, longest predicted
first by the trained predictor, out of fold).

With --fifo, the rows run in a random order and what is carried is the choice between the mixture's three shapes
(the log ratio, the normal, the square root): each shape's log-likelihood per row on carried full lengths, times
--worth rows, is added to the run's own before the weighing. Carried from the run's own prompts, their other
sampling (yesterday's run of the same rows: a bound on what carrying can give; in the per-prompt world the run's
lengths are drawn, the carried ones are still the real samplings), or from every other labelled prompt (a predictor
trained on another mix). With the trained predictor's rows and the heuristic's.

Prints the tokens to come within 10% over 10 / 25 / 50% of rows, the mean |error|, and the median signed error at
each point.

    python benchmarks/forecast_carried.py [--draws 40]
    python benchmarks/forecast_carried.py --fifo [--draws 40] [--worth 30]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]

from forecast_variants import CAP, line, points  # noqa: E402


def carried_shape(lab, out, idx):
    """(a, b, s) of the sqrt ratio fitted on every labelled row outside the run, both samplings."""
    from overnight.pipeline.scheduling.sqrt_ratio import SqrtRatioModel

    rest = np.setdiff1d(np.arange(len(lab.src)), idx)
    m = SqrtRatioModel(CAP, prior_weight=1e-3, slope_weight=10.0)
    for k in (0, 1):
        p, a = lab.trained[rest, 1 - k], out[rest, k]
        m.observe(p, a, a >= CAP)
    m.fit(np.zeros(0), np.zeros(0))
    return m.a, m.b, m.s


class Guarded:
    """The weak-prior fit and the carried-prior fit, weighed by the evidence of the run's mean under each prior."""

    def __init__(self, weak, strong, carried_a: float, carried_w: float):
        self.weak, self.strong, self.a_c, self.w_c = weak, strong, carried_a, carried_w
        self.w = 0.5

    def observe(self, *a):
        self.weak.observe(*a)
        self.strong.observe(*a)

    def fit(self, running_p, running_g, rest=(0.0, 0.0)):
        self.weak.fit(running_p, running_g, rest=rest)
        self.strong.fit(running_p, running_g, rest=rest)
        w = self.weak
        s, se2 = w.s, w.s ** 2 / max(w.num_events, 1e-9)
        ll = []
        for mu, weight in ((w.prior_mu, w.prior_weight), (self.a_c, self.w_c)):
            v = s * s / weight + se2
            ll.append(-0.5 * (w.a - mu) ** 2 / v - 0.5 * math.log(v))
        self.w = 1.0 / (1.0 + math.exp(max(min(ll[0] - ll[1], 50.0), -50.0)))
        return self.weak.mu, self.weak.sigma

    def expected(self, predicted, generated=None, shift=0.0):
        return ((1 - self.w) * self.weak.expected(predicted, generated, shift)
                + self.w * self.strong.expected(predicted, generated, shift))

    def __getattr__(self, name):
        return getattr(self.__dict__["weak"], name)


def tokens_to_come(p, a, st, model) -> float:
    done, run, pend, g, _ = st
    model.observe(p[done], a[done], a[done] >= CAP)
    model.fit(p[run], g, rest=(float(p[pend].sum()), float(len(pend))))
    return float(model.expected(p[run], g).sum() + (model.expected(p[pend]).sum() if len(pend) else 0.0))


def spread_prior_sqrt(s0: float, weight: float):
    """SqrtLengthModel whose EM also holds its spread s (of sqrt(length)) towards s0, worth this many rows."""
    from overnight.pipeline.scheduling.length_shapes import SqrtLengthModel

    class SpreadPrior(SqrtLengthModel):
        def _variance(self, var: float, total: float) -> float:
            return (var * total + weight * s0 ** 2) / (total + weight)
    return SpreadPrior(CAP)


def fifo(draws: int, worth: float) -> None:
    """Under fifo: the product's weighing of the three shapes; the same with a prior on the weights (each shape's
    likelihood per row on carried full lengths, times ``worth`` rows); each shape fitted on the run's own lengths
    in hindsight; and the square root alone, fitted by the run, with its spread held towards a carried one."""
    from forecast_floor import draw_run, worlds
    from length_early import lay_out

    from overnight.pipeline.scheduling.length_shapes import SqrtLengthModel
    from overnight.pipeline.scheduling.lengths import LengthMixture

    lab, out, prompt = worlds()
    z = np.zeros(0)

    def full(p, a):
        m = LengthMixture(CAP)
        m.observe(p, a, a >= CAP)
        m.fit(z, z)
        return m

    print(f"tokens to come under fifo, carried shapes worth {worth:.0f} rows, {draws} draws")
    for predictor in ("trained", "heuristic"):
        for world in ("real", "per-prompt"):
            for workload in ("mixed", "open"):
                errs: dict = {}
                fits: dict = {}
                for d in range(draws):
                    rng = np.random.default_rng(1000 + d)
                    idx, p, a = draw_run(lab, out, prompt, world, workload, rng)
                    preds = lab.trained if predictor == "trained" else np.stack([lab.heuristic] * 2, 1)
                    if predictor == "heuristic":
                        p = lab.heuristic[idx]
                    others = np.setdiff1d(np.arange(len(lab.src)), idx)

                    def carried(rows, scale=1.0):
                        """The shapes fitted on these rows' full lengths (both samplings), scaled."""
                        lengths = np.concatenate([out[rows, 1], out[rows, 0]])
                        lengths = np.clip(np.round(lengths * scale), 1, CAP)
                        return full(np.concatenate([preds[rows, 0], preds[rows, 1]]), lengths)
                    # the run's own prompts, their other sampling (yesterday's run of the same rows: a bound), and
                    # every other labelled prompt (another mix); the same prompts' lengths x0.7 and x1.4
                    same, other = carried(idx), carried(others)
                    short, long_ = carried(idx, 0.7), carried(idx, 1.4)
                    hind = full(p, a)
                    start, end = lay_out(a, rng.permutation(len(idx)), 64)
                    ends = np.sort(end)
                    for share in (0.10, 0.25, 0.50):
                        now = ends[max(1, int(round(share * len(a)))) - 1]
                        done, run = np.flatnonzero(end <= now), np.flatnonzero((start <= now) & (end > now))
                        pend = np.flatnonzero(start > now)
                        g = now - start[run]
                        actual = float((a[run] - g).sum() + a[pend].sum())
                        rest = (float(p[pend].sum()), float(len(pend)))

                        def err(model) -> float:
                            got = model.expected(p[run], g).sum() + (model.expected(p[pend]).sum() if len(pend) else 0)
                            return float(got) / actual - 1

                        m = LengthMixture(CAP, calibrated=predictor == "trained")
                        m.observe(p[done], a[done], a[done] >= CAP)
                        m.fit(p[run], g, rest=rest)
                        errs.setdefault("the weighing (the product's)", []).append(err(m))
                        ll = np.array([m.ratio.loglik(p[run], g), m.normal.loglik(p[run], g),
                                       m.sqrt.loglik(p[run], g) - m.SQRT_PRICE])
                        for name, c in (("same prompts", same), ("other prompts", other)):
                            n = c.ratio.n + sum(c.ratio.capped.values())
                            x = ll + worth * np.array([c.ratio.loglik(z, z), c.normal.loglik(z, z),
                                                       c.sqrt.loglik(z, z) - c.SQRT_PRICE]) / n
                            w = np.exp(np.maximum(x - x.max(), -50.0))
                            m.weight, m.sqrt_weight = float(w[1] / w.sum()), float(w[2] / w.sum())
                            errs.setdefault(f"shapes weighed, prior from {name}", []).append(err(m))
                        for name, model in (("log ratio", hind.ratio), ("normal", hind.normal),
                                            ("square root", hind.sqrt)):
                            errs.setdefault(f"hindsight: {name}, the run's own lengths", []).append(err(model))
                        sq = SqrtLengthModel(CAP)
                        sq.observe(p[done], a[done], a[done] >= CAP)
                        sq.fit(p[run], g, rest=rest)
                        errs.setdefault("square root alone, the run's fit", []).append(err(sq))
                        fits.setdefault(share, []).append((sq.a + sq.b * (hind.sqrt.x0 - sq.x0)) / hind.sqrt.a - 1)
                        fits.setdefault(-share, []).append(sq.s / hind.sqrt.s - 1)
                        for name, c in (("same prompts", same), ("other prompts", other),
                                        ("same prompts x0.7", short), ("same prompts x1.4", long_)):
                            sq = spread_prior_sqrt(c.sqrt.s, worth)
                            sq.observe(p[done], a[done], a[done] >= CAP)
                            sq.fit(p[run], g, rest=rest)
                            errs.setdefault(f"square root, spread from {name}", []).append(err(sq))
                print(f"{predictor} predictor, {world} {workload}")
                for n, v in errs.items():
                    print("  " + line(n, v), flush=True)
                print("  the run's square root against its hindsight fit, median a / s off at 10 / 25 / 50%: "
                      + " / ".join(f"{np.median(fits[x]):+.1%}, {np.median(fits[-x]):+.1%}" for x in (0.1, 0.25, 0.5)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=40)
    ap.add_argument("--fifo", action="store_true", help="under fifo: the shapes' weighing with a carried prior")
    ap.add_argument("--worth", type=float, default=30.0, help="--fifo: the carried prior's worth, in rows")
    args = ap.parse_args()
    if args.fifo:
        return fifo(args.draws, args.worth)
    from forecast_floor import draw_run, worlds

    from overnight.pipeline.scheduling.sqrt_ratio import SqrtRatioModel

    lab, out, prompt = worlds()
    print(f"tokens to come under longest-first, a trained predictor's rows, a carried shape, {args.draws} draws")
    for scale_p in (1.0, 0.7, 1.4):
        for world in ("real", "per-prompt"):
            for workload in ("mixed", "open"):
                errs: dict = {}
                shapes = []
                for d in range(args.draws):
                    idx, p, a = draw_run(lab, out, prompt, world, workload, np.random.default_rng(1000 + d))
                    ca, cb, cs = carried_shape(lab, out, idx)
                    shapes.append((ca, cb, cs))
                    p = p * scale_p
                    variants = {
                        "the product's (a 1, s 0.4, worth 3)": lambda: SqrtRatioModel(CAP),
                        "carried, worth 10": lambda: SqrtRatioModel(CAP, prior_mu=ca, prior_sigma=cs, prior_weight=10),
                        "carried, worth 30": lambda: SqrtRatioModel(CAP, prior_mu=ca, prior_sigma=cs, prior_weight=30),
                        "guarded, carried worth 30": lambda: Guarded(
                            SqrtRatioModel(CAP), SqrtRatioModel(CAP, prior_mu=ca, prior_sigma=cs, prior_weight=30),
                            ca, 30.0),
                    }
                    for st in points(a, np.argsort(-p, kind="stable")):
                        for n, make in variants.items():
                            m = make()
                            errs.setdefault(n, []).append(tokens_to_come(p, a, st, m) / st[4] - 1)
                            if isinstance(m, Guarded):
                                errs.setdefault("(guarded: the carried fit's weight)", []).append(m.w)
                sh = np.array(shapes).mean(0)
                print(f"predictions x{scale_p}, {world} {workload} (carried shape a {sh[0]:.3f} b {sh[1]:+.3f} "
                      f"s {sh[2]:.3f}, mean over draws)")
                for n, v in errs.items():
                    if n.startswith("("):
                        w = np.asarray(v).reshape(-1, 3)
                        print(f"  {n:44s} mean at 10 / 25 / 50%: " + " / ".join(f"{x:.2f}" for x in w.mean(0)))
                    else:
                        print("  " + line(n, v), flush=True)


if __name__ == "__main__":
    main()
