"""How well does the forecast's step cost, fitted so far, cost the steps still to come? Replayed from step logs.

For each log written by benchmarks/step_log.py, at the moments 10%, 25% and 50% of its rows had finished, this
fits StepCost (pipeline/scheduling/forecast.py) on the steps logged until then, as the deadline tracker does (every
step seen for jumps in the batch, the engine's first SETTLE_S seconds not measured), and costs the steps that
actually came after (their number, sequences and prompt tokens) against their actual seconds. Side by side: the
product's rule, which leaves out the AFTER_GROWTH decode steps after the batch grows by a quarter, and the fit
without it (AFTER_GROWTH = 0).

    python benchmarks/step_cost_replay.py steps.json [steps.json ...] [--shares 0.1 0.25 0.5] [--weights] [--context]

Prints, per log and share, the fit and (fitted cost of the future steps) / (their actual seconds), then per rule
the mean |log| of that ratio and the share of points within 5%. For the product's rule, also the step cost's drift
as the fit saw it (StepCost.drift) and how often the ratio fell within its 80% range, exp(+-1.2816 * drift), the
range the ETA widens by.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

SHARES = (0.10, 0.25, 0.50)


def replay(rec: list, after_growth: int, shares=SHARES, weigh=None, drifts=None) -> list[tuple[float, float, float]]:
    """(fixed s, s per sequence, future cost / actual) at each share of rows finished; weigh: the sizes' weights
    from their step counts in the line's fit (None: the product's, the counts); drifts: a list to append the
    fit's StepCost.drift to at each share."""
    from overnight.pipeline.scheduling import deadline as dl
    from overnight.pipeline.scheduling.forecast import StepCost

    class Weighed(StepCost):
        def _points(self):
            n, t, w = super()._points()
            return n, t, weigh(w)

    finished = [i for i, r in enumerate(rec) for _ in range(r[5])]  # the step each row finished at
    out = []
    for share in shares:
        i = finished[int(math.ceil(share * len(finished))) - 1]
        sc = StepCost() if weigh is None else Weighed()
        sc.AFTER_GROWTH = after_growth
        for t, n, prefill, seconds, *_ in rec[:i + 1]:
            sc.saw(n)
            if seconds is not None and t >= dl.SETTLE_S:
                sc.observe(n, prefill, seconds)
        a, b, c = sc.fit()
        if drifts is not None:
            drifts.append(sc.drift)
        future = rec[i + 1:]
        n = np.array([r[1] for r in future], np.float64)
        prefill = np.array([r[2] for r in future], np.float64)
        actual = sum(r[3] for r in future if r[3] is not None)
        out.append((a, b, (a * len(n) + b * n.sum() + c * prefill.sum()) / actual))
    return out


def replay_context(rec: list, shares=SHARES, how: str = "free", keep: int = 64) -> list[tuple[float, float, float]]:
    """Tried, not in the product: decode steps costed as fixed + per sequence + per 1,000 tokens of the running
    rows' context, on the last `keep` decode steps of each size kept by the product's settle and growth rules;
    prefill as the product's excess. how="free": the three by least squares; how="within": the context's cost
    from the variation within each size (each size centred), then the product's weighted line through each
    size's median of what is left. The steps to come are costed with the context they actually had, which a
    forecast would have to predict. (fixed s, s per sequence, future cost / actual) at each share."""
    from overnight.pipeline.scheduling import deadline as dl
    from overnight.pipeline.scheduling.forecast import StepCost

    finished = [i for i, r in enumerate(rec) for _ in range(r[5])]
    out = []
    for share in shares:
        i = finished[int(math.ceil(share * len(finished))) - 1]
        sc, kept = StepCost(), {}
        for t, n, prefill, seconds, _, _, ctx in rec[:i + 1]:
            sc.saw(n)
            if seconds is not None and t >= dl.SETTLE_S:
                plain = not prefill and sc._pending is None and not sc._unsettled  # what observe() keeps by size
                sc.observe(n, prefill, seconds)
                if plain:
                    kept.setdefault(n, []).append((ctx / 1000.0, seconds))
        kept = {n: v[-keep:] for n, v in kept.items()}
        if how == "free":
            x = np.array([[1.0, n, c] for n, v in kept.items() for c, _ in v])
            y = np.array([t for v in kept.values() for _, t in v])
            a, b, e = np.linalg.lstsq(x, y, rcond=None)[0]
        else:
            xs = [np.array([c for c, _ in v]) for v in kept.values() if len(v) >= 8]
            ys = [np.array([t for _, t in v]) for v in kept.values() if len(v) >= 8]
            xc = np.concatenate([x - x.mean() for x in xs]) if xs else np.zeros(0)
            yc = np.concatenate([y - y.mean() for y in ys]) if ys else np.zeros(0)
            e = max(0.0, float(xc @ yc / max(float(xc @ xc), 1e-12)))
            line = StepCost()
            for n, v in kept.items():
                line.sizes[n] = [t - e * c for c, t in v]
            line.num_steps = 1
            a, b, _ = line.fit()
        ps = np.array(sc.prefill_steps, np.float64)
        mid = float(np.median([c for v in kept.values() for c, _ in v]))
        c = max(0.0, float((ps[:, 3] - (a * ps[:, 1] + b * ps[:, 0] + e * mid * ps[:, 1])).sum()
                           / max(ps[:, 2].sum(), 1.0))) if len(ps) else 0.0
        future = rec[i + 1:]
        cost = sum(a + b * r[1] + e * r[6] / 1000.0 + c * r[2] for r in future)
        actual = sum(r[3] for r in future if r[3] is not None)
        out.append((a, b, cost / actual))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--shares", type=float, nargs="+", default=list(SHARES),
                    help="shares of rows finished to fit at (0.75 0.9: late, where the batch empties)")
    ap.add_argument("--weights", action="store_true", help="also the sizes weighed equally and by sqrt(steps)")
    ap.add_argument("--context", action="store_true", help="also a fit with a term for the running rows' context, "
                                                           "costing the steps to come with their actual context")
    args = ap.parse_args()
    from overnight.pipeline.scheduling.forecast import StepCost

    rules = {f"AFTER_GROWTH={StepCost.AFTER_GROWTH} (the product)": (StepCost.AFTER_GROWTH, None),
             "AFTER_GROWTH=0": (0, None)}
    if args.weights:  # tried, not kept: the line through each size's median weighed otherwise than by its steps
        rules["sizes weighed equally"] = (StepCost.AFTER_GROWTH, np.ones_like)
        rules["by sqrt(steps)"] = (StepCost.AFTER_GROWTH, np.sqrt)
    ratios = {name: [] for name in rules}
    print("fitted cost of the steps to come / their actual seconds, at " +
          " / ".join(f"{s:.0%}" for s in args.shares) + " of rows")
    context_rules = {"context term, free least squares": ("free", 64),
                     "context term from within sizes": ("within", 64),
                     "context term from within sizes, 256": ("within", 256)} if args.context else {}
    for name in context_rules:
        ratios[name] = []
    product = next(iter(rules))
    drifts = []
    for log in args.logs:
        rec = json.load(open(log))
        for name, (k, weigh) in rules.items():
            r = replay(rec, k, args.shares, weigh, drifts if name == product else None)
            ratios[name] += [x[2] for x in r]
            print(f"  {log}  {name:34s} " + "  ".join(f"{1000 * a:.0f} ms + {1000 * b:.2f} ms/seq: x{x:.3f}"
                                                       for a, b, x in r))
        print(f"  {log}  {'drift (log sd of block medians)':34s} " + "  ".join(f"{d:.3f}"
                                                                             for d in drifts[-len(args.shares):]))
        for name, (how, keep) in context_rules.items():
            r = replay_context(rec, args.shares, how, keep)
            ratios[name] += [x[2] for x in r]
            print(f"  {log}  {name:34s} " + "  ".join(f"{1000 * a:.0f} ms + {1000 * b:.2f} ms/seq: x{x:.3f}"
                                                       for a, b, x in r))
    for name, v in ratios.items():
        le = np.abs(np.log(np.array(v)))
        print(f"{name:34s} mean |log| {le.mean():.3f}, within 5% at {np.mean(le < math.log(1.05)):.0%} of points")
    le = np.abs(np.log(np.array(ratios[product])))
    d = np.array(drifts)
    print(f"the product's ratio within exp(+-1.2816 * drift) at {np.mean(le <= 1.2816 * d):.0%} of points "
          f"(drift {d.min():.3f}-{d.max():.3f}, median {np.median(d):.3f})")


if __name__ == "__main__":
    main()
