"""Rows drawn at random under longest predicted first, so that the forecast can weigh its length models there as
under fifo: tried at 9b3b854, not kept (docs/BENCHMARKS.md, "Rows drawn at random under longest-first").

Under longest-first (and auto while its deadline is safe) the rows seen early are the ones predicted longest, and
the rows left the ones predicted shortest, so the forecast takes the log ratio alone there (LengthMixture's
left_shortest). The change tried admitted one row in ``sample_every`` (8) drawn at random from the pool, and with
those rows weighed the three length models as under fifo.

Emulated (positional OUTs): each finished `overnight run` folder's rows (prediction, length, cut at max_tokens)
are ordered longest predicted first, every sample_every-th admission a pending row drawn at random (seeded), and
laid over --slots engine slots, each row one token a step. When 5%, 10%, 25% and 50% of the rows have finished,
the forecast's LengthMixture is fitted on what a forecast would see then (the finished rows; the rows running as
"at least"): the log ratio alone at 0, the three weighed otherwise. The predictions are the ones the run gave its
rows; with rows drawn at random the online predictor would have learned from other rows, which this does not
emulate.

Replayed (--replay OUT ...): finished runs that drew rows at random (at 9b3b854), with benchmarks/length_replay.py's
step clock: the tokens to come the mixture expected weighed (what the change did) and as the log ratio alone (what
the product does), and in hindsight (every row drawn from the run's own lengths).

    python benchmarks/length_sampling.py OUT [OUT ...] [--sample-every 0 16 8 4] [--seeds 3] [--slots 64]
    python benchmarks/length_sampling.py --replay OUT [OUT ...]

Prints, per run and setting (the first seed), expected / actual tokens to come at the four shares; then per setting
the mean |log| of that ratio over runs and seeds, and the makespan (in steps) over longest-first's without rows
drawn at random, side by side.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

SHARES = (0.05, 0.10, 0.25, 0.50)


def sampled_order(p, sample_every: int, seed: int) -> list[int]:
    """Longest predicted first, every sample_every-th admission a pending row drawn at random (0: none)."""
    rng = np.random.default_rng(seed)
    by_length = list(np.argsort(-np.asarray(p), kind="stable"))
    pending, order, i = set(by_length), [], 0
    while pending:
        if sample_every and (len(order) + 1) % sample_every == 0:
            j = int(rng.choice(sorted(pending)))
        else:
            while by_length[i] not in pending:
                i += 1
            j = int(by_length[i])
        pending.remove(j)
        order.append(j)
    return order


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outs", nargs="*")
    ap.add_argument("--replay", nargs="*", default=[])
    ap.add_argument("--sample-every", type=int, nargs="+", default=[0, 16, 8, 4])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=512)
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from length_early import lay_out
    from length_replay import load

    from overnight.pipeline.scheduling.lengths import LengthMixture

    cap = args.max_tokens
    if args.replay:
        from length_replay import Hindsight, replay, step_clock

        print("replayed: expected / actual output tokens to come at " + ", ".join(f"{s:.0%}" for s in SHARES))
        for out in args.replay:
            d = load(out)
            clock = step_clock(d)
            for name, kw in (("weighed (the change)", {"left_shortest": False}),
                             ("log ratio alone (the product)", {"left_shortest": True})):
                r = replay(d, lambda: LengthMixture(cap), clock, **kw)
                print(f"  {out:40s} {name:30s} " + " ".join(f"{x:.2f}" for x in r[:len(SHARES)]))
            r = replay(d, lambda: Hindsight(d["a"]), clock)
            print(f"  {out:40s} {'hindsight':30s} " + " ".join(f"{x:.2f}" for x in r[:len(SHARES)]))
    if not args.outs:
        return
    errors: dict = {}
    spans: dict = {}
    print("expected / actual output tokens to come at " + ", ".join(f"{s:.0%}" for s in SHARES) + " of rows")
    for out in args.outs:
        d = load(out)
        p, a, cut = d["p"], np.minimum(d["a"], cap), d["cut"]
        base = None
        for every in args.sample_every:
            for seed in range(args.seeds if every else 1):
                start, end = lay_out(a, sampled_order(p, every, seed), args.slots)
                span = float(end.max())
                base = span if every == 0 else base
                spans.setdefault(every, []).append(span / base)
                ends = np.sort(end)
                r = []
                for share in SHARES:
                    t = ends[max(1, int(round(share * len(p)))) - 1] + 0.5
                    fin, run, pool = end <= t, (start <= t) & (end > t), start > t
                    g = np.where(run, t - start, 0.0)
                    actual = float((a[run] - g[run]).sum() + a[pool].sum())
                    m = LengthMixture(cap)
                    m.observe(p[fin], a[fin], cut[fin])
                    m.fit(p[run], g[run], left_shortest=every == 0, rest=(float(p[pool].sum()), float(pool.sum())))
                    r.append(float(m.expected(p[run], g[run]).sum() + m.expected(p[pool]).sum()) / actual)
                errors.setdefault(every, []).append(r)
                if seed == 0:
                    print(f"  {out:40s} sample_every {every:2d}  " + " ".join(f"{x:.2f}" for x in r), flush=True)
    print("sample_every: mean |log(expected / actual)| at " + " / ".join(f"{s:.0%}" for s in SHARES)
          + "; at 10-50%; within 10% at 10-50%; makespan / longest-first's (min-max)")
    for every, rows in errors.items():
        le = np.abs(np.log(np.array(rows)))
        sp = np.array(spans[every])
        print(f"  {every:2d}  " + " / ".join(f"{x:.3f}" for x in le.mean(0)) + f"; {le[:, 1:].mean():.3f}; "
              f"{(le[:, 1:] <= np.log(1.1)).mean():.0%}; x{sp.mean():.3f} ({sp.min():.3f}-{sp.max():.3f})")


if __name__ == "__main__":
    main()
