"""How well does the forecast's step cost, fitted so far, cost the steps still to come? Replayed from step logs.

For each log written by benchmarks/step_log.py, at the moments 10%, 25% and 50% of its rows had finished, this
fits StepCost (pipeline/scheduling/step_cost.py) on the steps logged until then, as the deadline tracker does (every
step seen for jumps in the batch, the engine's first SETTLE_S seconds not measured), and costs the steps that
actually came after (their number, sequences and prompt tokens) against their actual seconds. Side by side: the
product's rule, which leaves out the AFTER_GROWTH decode steps after the batch grows by a quarter, and the fit
without it (AFTER_GROWTH = 0).

    python benchmarks/step_cost_replay.py steps.json [steps.json ...] [--shares 0.1 0.25 0.5] [--weights] [--context]
        [--physics] [--keep 64 128 256 512 0] [--stretches] [--prefill-mean]

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


def replay(rec: list, after_growth: int, shares=SHARES, weigh=None, drifts=None,
           prefill_rule: str | None = None) -> list[tuple[float, float, float]]:
    """(fixed s, s per sequence, future cost / actual) at each share of rows finished; weigh: the sizes' weights
    from their step counts in the line's fit (None: the product's, the counts); drifts: a list to append the
    fit's StepCost.drift to at each share; prefill_rule: StepCost.PREFILL (None: the product's)."""
    from overnight.pipeline.scheduling import deadline as dl
    from overnight.pipeline.scheduling.step_cost import StepCost

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
        sc.PREFILL = prefill_rule or sc.PREFILL
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


def kept_until(rec: list, shares):
    """For each share of rows finished: (the index of the step it was reached at, the StepCost fed every step until
    then as the tracker feeds it, {sequences: [(context tokens, seconds)]} of the decode steps that StepCost kept by
    size)."""
    from overnight.pipeline.scheduling import deadline as dl
    from overnight.pipeline.scheduling.step_cost import StepCost

    finished = [i for i, r in enumerate(rec) for _ in range(r[5])]
    for share in shares:
        i = finished[int(math.ceil(share * len(finished))) - 1]
        sc, kept = StepCost(), {}
        for t, n, prefill, seconds, _, _, ctx in rec[:i + 1]:
            sc.saw(n)
            if seconds is not None and t >= dl.SETTLE_S:
                plain = not prefill and sc._pending is None and not sc._unsettled  # what observe() keeps by size
                sc.observe(n, prefill, seconds)
                if plain:
                    kept.setdefault(n, []).append((ctx, seconds))
        yield i, sc, kept


def replay_context(rec: list, shares=SHARES, how: str = "free", keep: int = 64) -> list[tuple[float, float, float]]:
    """Tried, not in the product: decode steps costed as fixed + per sequence + per 1,000 tokens of the running
    rows' context, on the last `keep` decode steps of each size kept by the product's settle and growth rules;
    prefill as the product's excess. how="free": the three by least squares; how="within": the context's cost
    from the variation within each size (each size centred), then the product's weighted line through each
    size's median of what is left. The steps to come are costed with the context they actually had, which a
    forecast would have to predict. (fixed s, s per sequence, future cost / actual) at each share."""
    from overnight.pipeline.scheduling.step_cost import StepCost

    out = []
    for i, sc, kept in kept_until(rec, shares):
        kept = {n: [(c / 1000.0, t) for c, t in v[-keep:]] for n, v in kept.items()}
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


# SmolLM2-135M: the keys and values of one token (2 x layers x kv heads x head dim) over the weights
SMOLLM2_RHO = 2 * 30 * 3 * 64 / 134.5e6


def replay_physics(rec: list, shares=SHARES, rho: float = SMOLLM2_RHO,
                   on: str = "fixed") -> list[tuple[float, float, float]]:
    """Tried at stop 30 and not kept then; on="fixed" at rho is the product's form since stop 68 (StepCost.rho,
    which bounds the fit as the line does; the product's rule above replays the fit without it, StepCost's rho 0,
    as before stop 68): the context's cost pinned by its physics. A decode step reads the weights once
    and each running row's keys and values once per context token, so (on="fixed") a step costs
    a * (1 + rho * context) + b * sequences, rho the keys and values of a token over the weights; or
    (on="per_seq") a + b * (sequences + rho * context). a and b: the product's line through each size's median
    (the last 64 kept decode steps), at that size's median context; prefill as the product's excess. The steps to
    come are costed with the context they actually had. (a, b, future cost / actual) at each share."""
    out = []
    for i, sc, kept in kept_until(rec, shares):
        pts = [(n, np.median([c for c, _ in v[-64:]]), np.median([t for _, t in v[-64:]]), len(v[-64:]))
               for n, v in kept.items() if len(v) >= 3]
        n_, c_, t_, w_ = (np.array(x, np.float64) for x in zip(*pts))

        def cost(n, ctx, a, b):
            return a * (1 + rho * ctx) + b * n if on == "fixed" else a + b * (n + rho * ctx)

        x = np.stack([1 + rho * c_, n_], 1) if on == "fixed" else np.stack([np.ones_like(n_), n_ + rho * c_], 1)
        sw = np.sqrt(w_)
        a, b = np.linalg.lstsq(x * sw[:, None], t_ * sw, rcond=None)[0]
        if a < 0:
            a, b = 0.0, float(w_ @ t_ / (w_ @ x[:, 1]))
        ps = np.array(sc.prefill_steps, np.float64)
        mid = float(np.median([c for v in kept.values() for c, _ in v[-64:]]))
        c = max(0.0, float((ps[:, 3] - np.array([cost(p[0] / p[1], mid, a, b) * p[1] for p in ps])).sum()
                           / max(ps[:, 2].sum(), 1.0))) if len(ps) else 0.0
        future = rec[i + 1:]
        total = sum(cost(r[1], r[6], a, b) + c * r[2] for r in future)
        out.append((a, b, total / sum(r[3] for r in future if r[3] is not None)))
    return out


def stretches(rec: list, shares=SHARES) -> list[tuple[float, float]]:
    """At each share of rows finished: (median of the last 64 decode-only steps of the size with the most, mean of
    that size's decode-only steps after), in seconds: how much a step of the same size moves from one stretch of the
    run to the next."""
    from overnight.pipeline.scheduling import deadline as dl

    finished = [i for i, r in enumerate(rec) for _ in range(r[5])]
    out = []
    for share in shares:
        i = finished[int(math.ceil(share * len(finished))) - 1]
        plain = [(j, r[1], r[3]) for j, r in enumerate(rec) if r[3] is not None and not r[2] and r[0] >= dl.SETTLE_S]
        sizes = [n for j, n, _ in plain if j <= i]
        n0 = max(set(sizes), key=sizes.count)
        past = [t for j, n, t in plain if j <= i and n == n0][-64:]
        future = [t for j, n, t in plain if j > i and n == n0]
        out.append((float(np.median(past)), float(np.mean(future)) if future else math.nan))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--shares", type=float, nargs="+", default=list(SHARES),
                    help="shares of rows finished to fit at (0.75 0.9: late, where the batch empties)")
    ap.add_argument("--weights", action="store_true", help="also the sizes weighed equally and by sqrt(steps)")
    ap.add_argument("--context", action="store_true", help="also a fit with a term for the running rows' context, "
                                                           "costing the steps to come with their actual context")
    ap.add_argument("--physics", action="store_true",
                    help="also the context's cost pinned by its physics (SmolLM2-135M's keys and values per token "
                         "over its weights), scaled")
    ap.add_argument("--keep", type=int, nargs="*", default=[],
                    help="also the product's rule keeping this many decode steps of each size (0: all)")
    ap.add_argument("--prefill-mean", action="store_true",
                    help="also a prompt token's cost as the prefilling steps' mean excess (before stop 60)")
    ap.add_argument("--stretches", action="store_true",
                    help="also the last 64 steps' median of the commonest size against the mean of those after")
    args = ap.parse_args()
    from overnight.pipeline.scheduling.step_cost import StepCost

    rules = {f"AFTER_GROWTH={StepCost.AFTER_GROWTH} (the product)": (StepCost.AFTER_GROWTH, None, None),
             "AFTER_GROWTH=0": (0, None, None)}
    if args.weights:  # tried, not kept: the line through each size's median weighed otherwise than by its steps
        rules["sizes weighed equally"] = (StepCost.AFTER_GROWTH, np.ones_like, None)
        rules["by sqrt(steps)"] = (StepCost.AFTER_GROWTH, np.sqrt, None)
    if args.prefill_mean:  # before stop 60: a prompt token's cost the prefilling steps' summed excess per token
        rules["prefill: mean excess"] = (StepCost.AFTER_GROWTH, None, "mean")
    ratios = {name: [] for name in rules}
    print("fitted cost of the steps to come / their actual seconds, at " +
          " / ".join(f"{s:.0%}" for s in args.shares) + " of rows")
    context_rules = {"context term, free least squares": ("free", 64),
                     "context term from within sizes": ("within", 64),
                     "context term from within sizes, 256": ("within", 256)} if args.context else {}
    if args.physics:
        context_rules.update({"physics: rho on the fixed part": ("physics", SMOLLM2_RHO, "fixed"),
                              "rho / 2 on the fixed part": ("physics", SMOLLM2_RHO / 2, "fixed"),
                              "rho x 2 on the fixed part": ("physics", SMOLLM2_RHO * 2, "fixed"),
                              "per sequence: context / 1,000": ("physics", 1 / 1000, "per_seq"),
                              "per sequence: context / 2,000": ("physics", 1 / 2000, "per_seq"),
                              "per sequence: context / 3,900": ("physics", 1 / 3900, "per_seq"),
                              "per sequence: context / 500": ("physics", 1 / 500, "per_seq")})
    for name in context_rules:
        ratios[name] = []
    for keep in args.keep:
        ratios[f"KEEP={keep or 'all'}"] = []
    product = next(iter(rules))
    drifts = []
    for log in args.logs:
        rec = json.load(open(log))
        for name, (k, weigh, prefill) in rules.items():
            r = replay(rec, k, args.shares, weigh, drifts if name == product else None, prefill)
            ratios[name] += [x[2] for x in r]
            print(f"  {log}  {name:34s} " + "  ".join(f"{1000 * a:.0f} ms + {1000 * b:.2f} ms/seq: x{x:.3f}"
                                                       for a, b, x in r))
        print(f"  {log}  {'drift (log sd of block medians)':34s} " + "  ".join(f"{d:.3f}"
                                                                             for d in drifts[-len(args.shares):]))
        for keep in args.keep:
            saved, StepCost.KEEP = StepCost.KEEP, keep or 10 ** 9
            try:
                ratios[f"KEEP={keep or 'all'}"] += [x[2] for x in replay(rec, StepCost.AFTER_GROWTH, args.shares)]
            finally:
                StepCost.KEEP = saved
        if args.stretches:
            print(f"  {log}  {'last 64 steps, then the mean after':34s} " + "  ".join(
                f"{1000 * a:.0f} ms, then {1000 * b:.0f}" for a, b in stretches(rec, args.shares)))
        for name, (how, *opts) in context_rules.items():
            r = replay_physics(rec, args.shares, *opts) if how == "physics" else replay_context(rec, args.shares, how,
                                                                                                *opts)
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
