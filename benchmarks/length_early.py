"""The length model's first rows, under an order that follows the predictions. Emulated from finished runs.

auto near a deadline runs the rows predicted shortest first, and its early warning comes when a few rows have
finished. This takes a finished `overnight run` folder's rows (prediction, length, cut at max_tokens) and lays
them over `--slots` engine slots in an order (shortest predicted first, longest first, or a random one, as fifo),
each row one token a step. When k rows have finished, it fits a length model on what a forecast would see then
(the finished rows; the rows running, with their tokens so far, as "at least") and compares the tokens it expects
still to come with those that came.

Models: the forecast's LengthMixture (pipeline/scheduling/lengths.py; the three models weighed by likelihood from
the first step, the priors at the mean prediction of every row), the same as at bfbd4bd (LengthModel alone
until 5 rows had finished; the normal's prior at the mean prediction of the rows seen), NormalLengthModel alone
(its prior from the rows seen), and a censored regression of log length on log
prediction (tried, not kept: log L = a + b log p + Normal, b shrunk towards b0 by 20 rows), which sits between
the two: b = 1 is the log-ratio model, b = 0 a log-normal blind to the predictions.

    python benchmarks/length_early.py OUT [OUT ...] [--slots 64] [--max-tokens 512]

Prints, per run, the slope of log length on log prediction in hindsight (least squares over all its rows, those
cut at max_tokens at it: b = 1 is the log-ratio model, b = 0 the normal); then per run, order and model, expected
/ actual tokens to come at k = 0 (halfway to the first row's finish), 1, 2, 3, 5, 8, 12, 20, 40 finished rows;
and per order and model the mean |log| of that ratio.
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import sys

import numpy as np

KS = (0, 1, 2, 3, 5, 8, 12, 20, 40)  # 0: halfway to the first row's finish


def lay_out(a, order, slots: int):
    """Each row's start and end step, the rows taken in this order over this many slots, one token a step."""
    start, end = np.full(len(a), np.inf), np.full(len(a), np.inf)
    free = [0.0] * slots
    for i in order:
        t = heapq.heappop(free)
        start[i], end[i] = t, t + a[i]
        heapq.heappush(free, end[i])
    return start, end


def states(p, a, order, slots: int, cap: int):
    """(finished, running, not started, tokens so far, actual tokens to come) when each k of KS rows has finished."""
    a = np.minimum(a, cap)
    start, end = lay_out(a, order, slots)
    ends = np.sort(end)
    for k in KS:
        t = ends[k - 1] + 0.5 if k else ends[0] / 2
        fin = end <= t
        run = (start <= t) & ~fin
        pool = start > t
        g = np.where(run, t - start, 0.0)
        yield fin, run, pool, g, float((a[run] - g[run]).sum() + a[pool].sum())


def slope_model(max_tokens: int, b0: float):
    from overnight.pipeline.scheduling.lengths import LengthModel, finished_rows, norm_cdf, norm_pdf

    class SlopeModel(LengthModel):
        """log L = alpha + beta log p + Normal(0, sigma), fitted by EM with the censored rows; beta is shrunk
        towards b0 by PRIOR rows of log-prediction variance 0.25."""

        PRIOR = 20.0

        def __init__(self):
            super().__init__(max_tokens)
            self.x, self.y, self.cx = [], [], []
            self.alpha, self.beta = 0.0, b0

        def observe(self, predicted, actual, hit_cap):
            p, a, cut = finished_rows(predicted, actual, hit_cap, self.cap)
            self.x += np.log(p[~cut]).tolist()
            self.y += np.log(a[~cut]).tolist()
            self.cx += np.log(p[cut]).tolist()

        def fit(self, running_p, running_g, iterations=40, **_):
            keep = (running_p > 0) & (running_g > 0)
            x, y = np.array(self.x), np.array(self.y)
            cx = np.concatenate([np.array(self.cx), np.log(running_p[keep])])
            cc = np.concatenate([np.full(len(self.cx), math.log(self.cap)), np.log(running_g[keep])])
            xs = np.concatenate([x, cx])
            xbar = float(xs.mean())
            a, b, s = self.alpha, self.beta, self.sigma
            if not len(x) and len(cx):
                a = float(np.mean(cc - b0 * cx))
            w0 = self.PRIOR * 0.25
            for _ in range(iterations):
                s = max(s, 0.05)
                m = a + b * cx
                z = (cc - m) / s
                lam = norm_pdf(z) / np.clip(1 - norm_cdf(z), 1e-12, None)
                ys = np.concatenate([y, m + s * lam])
                y2 = np.concatenate([y * y, m * m + s * s + s * (cc + m) * lam])
                n, xc, ym = len(xs), xs - xbar, float(ys.mean())
                nb = (float(xc @ (ys - ym)) + w0 * b0) / (float(xc @ xc) + w0)
                na = ym - nb * xbar
                res2 = float(y2.sum() - 2 * (na * ys.sum() + nb * (xs @ ys))
                             + na * na * n + 2 * na * nb * xs.sum() + nb * nb * (xs @ xs))
                ns = math.sqrt(max((res2 + self.prior_weight * self.prior_sigma ** 2) / (n + self.prior_weight),
                                   0.05 ** 2))
                done = abs(na - a) < 1e-4 and abs(nb - b) < 1e-4 and abs(ns - s) < 1e-4
                a, b, s = na, nb, ns
                if done:
                    break
            self.alpha, self.beta, self.sigma = a, b, s
            self.mu = a + (b - 1) * xbar
            return self.mu, self.sigma

        def _p(self, predicted):  # predictions under which LengthModel's log p + mu is alpha + beta log p
            return np.exp(self.alpha - self.mu + self.beta * np.log(np.maximum(np.asarray(predicted, float), 1.0)))

        def expected(self, predicted, generated=None, shift=0.0):
            return super().expected(self._p(predicted), generated, shift)

    return SlopeModel()


def before_mixture(max_tokens: int):
    """The forecast's LengthMixture as it was at bfbd4bd: LengthModel alone until 5 rows had finished, and the
    normal's prior the mean prediction of the rows seen (finished and running) alone."""
    from overnight.pipeline.scheduling.lengths import LengthMixture

    class Before(LengthMixture):
        SQRT_PRICE = float("inf")  # (no square root then)

        def fit(self, running_p, running_g, left_shortest=False, rest=(0.0, 0.0)):
            super().fit(running_p, running_g, left_shortest)
            self.sqrt_weight = 0.0
            if self.ratio.n < 5:
                self.weight, self.best = 0.0, self.ratio
            return self.best.mu, self.best.sigma

    return Before(max_tokens)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outs", nargs="+")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=512)
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from length_replay import load

    from overnight.pipeline.scheduling.lengths import LengthMixture, NormalLengthModel

    cap = args.max_tokens
    models = {"the forecast's (LengthMixture)": lambda: LengthMixture(cap),
              "the forecast's at bfbd4bd": lambda: before_mixture(cap),
              "normal on length alone": lambda: NormalLengthModel(cap),
              "regression, b0 = 1": lambda: slope_model(cap, 1.0),
              "regression, b0 = 0.5": lambda: slope_model(cap, 0.5)}
    print(f"expected / actual output tokens to come, at {', '.join(map(str, KS))} rows finished")
    table: dict = {}
    for out in args.outs:
        d = load(out)
        p, a, cut = d["p"], d["a"], d["cut"]
        b = float(np.polyfit(np.log(p), np.log(np.minimum(a, cap)), 1)[0])
        print(f"  {out}  in hindsight, least squares of log length on log prediction: slope b = {b:.2f}")
        orders = {"shortest first": np.argsort(p, kind="stable"), "longest first": np.argsort(-p, kind="stable"),
                  "random (fifo)": np.random.default_rng(0).permutation(len(p))}
        for oname, order in orders.items():
            for name, make in models.items():
                r = []
                for fin, run, pool, g, actual in states(p, a, order, args.slots, cap):
                    m = make()
                    m.observe(p[fin], a[fin], cut[fin])
                    if isinstance(m, LengthMixture):
                        m.fit(p[run], g[run], left_shortest=oname == "longest first",
                              rest=(float(p[pool].sum()), float(pool.sum())))
                    else:
                        m.fit(p[run], g[run])
                    r.append(float(m.expected(p[run], g[run]).sum() + m.expected(p[pool]).sum()) / actual)
                table.setdefault((oname, name), []).append(r)
                print(f"  {out}  {oname:14s}  {name:30s} " + " ".join(f"{x:.2f}" for x in r))
    print("mean |log(expected / actual)| over the runs and k; at k <= 5; at k >= 8")
    for (oname, name), rows in table.items():
        le = np.abs(np.log(np.array(rows)))
        print(f"  {oname:14s}  {name:30s} {le.mean():.3f}; {le[:, :5].mean():.3f}; {le[:, 5:].mean():.3f}")


if __name__ == "__main__":
    main()
