"""The forecast's length models under longest predicted first, emulated over the labelled lengths.

benchmarks/data/lengths.parquet holds 480 real prompts with the embedded model's output lengths from two samplings
each (benchmarks/length_prediction_data.py). This draws workloads from it as benchmarks/forecast.py does (open: 150
of the 160 MT-bench and Vicuna questions; mixed: 180 GSM8K, 60 MT-bench, 60 Vicuna, a 3:1:1 mix of 300), predicts
each row's length with the heuristic (what the online predictor gives before 256 rows have finished, so every row of
an open run) or with the product's trained predictor, fitted on the other folds of a 5-fold split on the other
sampling's lengths (calibrated: its mean is the actual mean within 1%), orders the rows longest predicted first
(or with every --every-th admission a pending row drawn at random, benchmarks/length_sampling.py's order), lays them
over 64 slots one token a step (benchmarks/length_early.py's lay_out) and, when 10%, 25% and 50% of the rows have
finished, compares the tokens a model expects still to come with those that came.

Models (fitted on what a forecast would see: the finished rows; the rows running as "at least" their tokens so far;
the rows cut at max_tokens as "at least" it):

    log ratio         the product's under this order: LengthMixture with left_shortest (LengthModel's sums)
    sqrt ratio        sqrt(actual / predicted) ~ Normal(a + b log(predicted), sigma), censored the same way (EM;
                      prior a 1, sigma 0.4, worth 3 rows; b at 0, worth 10): each row keeps its prediction's scale,
                      as in the log ratio, but the shape is the square root's, whose right tail is lighter. The
                      product's SqrtRatioModel, which LengthMixture(calibrated=True) uses under this order (a
                      trained predictor's predictions); until stop 34 a quadrature of the same model without b in
                      this script
    weighed           with rows drawn at random: the three models weighed as under fifo (tried at 9b3b854)
    log ratio @random with rows drawn at random: LengthModel fitted on those rows alone (stop 32's open idea)
    own r             not a model: each row's prediction times every ratio actual / predicted of the draw, known in
                      hindsight (the shape a perfect estimate of the ratio's distribution would give)
    hindsight         not a model: every row drawn from the draw's own lengths, blind to the predictions

    python benchmarks/length_labelled.py [--draws 40] [--every 8] [--fifo]

With --fifo the rows run in a random order, as under fifo, and the product's model is the mixture weighed as there.

Prints, per predictor, workload and model: the median of expected / actual tokens to come at 10%, 25% and 50% of
rows over the draws (two samplings alternate), its mean |log| over the three points, and the share of the points
within 10%; for the log ratio and the square root, also the rows running and the rows not started apart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

import numpy as np

SHARES = (0.10, 0.25, 0.50)
CAP = 512
SLOTS = 64


DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "lengths.parquet")
# forecast.py's workloads over the labelled rows: open, 150 of the 160 MT-bench and Vicuna questions; mixed, 3:1:1
MIXED = (("gsm8k", 180), ("mt_bench", 60), ("vicuna", 60))


def labelled(path: str = DATA) -> SimpleNamespace:
    """The labelled rows: src (their source), out and capped ([row, sampling]), the heuristic's predictions, and
    trained[:, k], out-of-fold predictions of the product's trained predictor fitted on sampling k's lengths."""
    import pyarrow.parquet as pq

    from overnight.buckets.features import featurize, prompt_text, subset
    from overnight.buckets.trained import TrainedPredictor

    rows = pq.read_table(path).to_pylist()
    fb = featurize([prompt_text(r["prompt"], json.loads(r["messages"]) if r["messages"] else None) for r in rows],
                   [r["prompt_tokens"] for r in rows], [CAP] * len(rows))
    out = np.array([[r["out_1"], r["out_2"]] for r in rows], np.float64)
    trained = np.zeros_like(out)
    for k in (0, 1):
        folds = np.random.default_rng(k).permutation(len(rows)) % 5
        for f in range(5):
            tr, te = np.flatnonzero(folds != f), np.flatnonzero(folds == f)
            model, _ = TrainedPredictor.fit(subset(fb, tr), out[tr, k])
            trained[te, k] = model.predict(subset(fb, te)).tokens
    return SimpleNamespace(src=np.array([r["source"] for r in rows]), out=out,
                           capped=np.array([[r["capped_1"], r["capped_2"]] for r in rows], bool),
                           heuristic=np.clip(fb.heuristic.astype(np.float64), 1, CAP), trained=trained)


def draw_rows(src: np.ndarray, workload: str, rng, scale: int = 1) -> np.ndarray:
    """The indices of one workload drawn from the labelled rows. scale > 1: that many times the rows, drawn with
    replacement in the same mix (a larger job of the same prompts)."""
    if workload == "open":
        pool = np.flatnonzero((src == "mt_bench") | (src == "vicuna"))
        return rng.choice(pool, 150 * scale, replace=scale > 1)
    return np.concatenate([rng.choice(np.flatnonzero(src == s), n * scale, replace=scale > 1) for s, n in MIXED])


def own_r(p, g, ratios, cap):
    """Each row's prediction times every ratio of the draw: E[min(pR, cap) - g | pR > g] over those ratios."""
    length = np.minimum(p[:, None] * ratios[None, :], cap)
    alive = length > g[:, None]
    return np.where(alive.any(1), np.where(alive, length, 0.0).sum(1) / np.maximum(alive.sum(1), 1) - g, 1.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--draws", type=int, default=40)
    ap.add_argument("--every", type=int, default=8)
    ap.add_argument("--fifo", action="store_true", help="the rows in a random order (fifo's) instead: the product's "
                                                         "mixture weighed as there, against the sqrt ratio")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from length_early import lay_out
    from length_replay import Hindsight
    from length_sampling import sampled_order

    from overnight.pipeline.scheduling.lengths import LengthMixture, LengthModel

    lab = labelled(args.data)
    src, out, capped, heuristic, trained = lab.src, lab.out, lab.capped, lab.heuristic, lab.trained
    print(f"{len(src)} labelled rows; trained predictor out of fold, mean predicted / mean actual: "
          + ", ".join(f"{trained[:, k].mean() / out[:, k].mean():.3f}" for k in (0, 1)))

    def draw(workload, rng):
        return draw_rows(src, workload, rng)

    def tokens(m, p, g, run, pool):
        return float(m.expected(p[run], g[run]).sum()), float(m.expected(p[pool]).sum())

    print("expected / actual output tokens to come " + ("in a random order (fifo)" if args.fifo else
          "under longest predicted first") + ", 64 slots; median over "
          f"{args.draws} draws at " + " / ".join(f"{s:.0%}" for s in SHARES) + " of rows; mean |log| there; "
          "within 10%")
    for predictor in ("heuristic", "trained"):
        for workload in ("open", "mixed"):
            res: dict = {}
            for d in range(args.draws):
                rng = np.random.default_rng(d)
                idx = draw(workload, rng)
                k = d % 2  # this draw's lengths; the trained predictor learned the other sampling's
                a = np.minimum(out[idx, k], CAP)
                cut = capped[idx, k] | (a >= CAP)
                p = heuristic[idx] if predictor == "heuristic" else trained[idx, 1 - k]
                for every in ((0,) if args.fifo else (0, args.every)):
                    order = list(rng.permutation(len(p))) if args.fifo else sampled_order(p, every, d)
                    pos = np.empty(len(p), int)
                    pos[order] = np.arange(len(p))
                    drawn = ((pos + 1) % every == 0) if every else np.zeros(len(p), bool)
                    start, end = lay_out(a, order, SLOTS)
                    ends = np.sort(end)
                    for share in SHARES:
                        t = ends[max(1, int(round(share * len(p)))) - 1] + 0.5
                        fin, run, pool = end <= t, (start <= t) & (end > t), start > t
                        g = np.where(run, t - start, 0.0)
                        act_run, act_pool = float((a[run] - g[run]).sum()), float(a[pool].sum())
                        rest = (float(p[pool].sum()), float(pool.sum()))
                        got = {}
                        if every == 0:
                            m = LengthMixture(CAP)
                            m.observe(p[fin], a[fin], cut[fin])
                            m.fit(p[run], g[run], left_shortest=not args.fifo, rest=rest)
                            got["mixture (fifo's)" if args.fifo else "log ratio"] = tokens(m, p, g, run, pool)
                            sq = LengthMixture(CAP, calibrated=True)
                            sq.observe(p[fin], a[fin], cut[fin])
                            sq.fit(p[run], g[run], left_shortest=True, rest=rest)
                            got["sqrt ratio"] = tokens(sq, p, g, run, pool)
                            h = Hindsight(a)
                            got["hindsight"] = tokens(h, p, g, run, pool)
                            r = a / p
                            got["own r"] = (float(own_r(p[run], g[run], r, CAP).sum()),
                                            float(own_r(p[pool], np.zeros(int(pool.sum())), r, CAP).sum()))
                        else:
                            m = LengthMixture(CAP)
                            m.observe(p[fin], a[fin], cut[fin])
                            m.fit(p[run], g[run], left_shortest=False, rest=rest)
                            got[f"weighed, 1 in {every} at random"] = tokens(m, p, g, run, pool)
                            lm = LengthModel(CAP)
                            lm.observe(p[fin & drawn], a[fin & drawn], cut[fin & drawn])
                            lm.fit(p[run & drawn], g[run & drawn])
                            got[f"log ratio @random, 1 in {every}"] = tokens(lm, p, g, run, pool)
                        for name, (er, ep) in got.items():
                            res.setdefault(name, {}).setdefault(share, []).append(
                                ((er + ep) / (act_run + act_pool), er / act_run, ep / act_pool if act_pool else np.nan))
            print(f"\n{predictor}, {workload}:")
            for name, by_share in res.items():
                x = np.array([[v[0] for v in by_share[s]] for s in SHARES])  # [share, draw]
                le = np.abs(np.log(x))
                line = (f"  {name:28s} " + " / ".join(f"x{np.median(v):.2f}" for v in x)
                        + f"   {le.mean():.3f}   {(le <= np.log(1.1)).mean():4.0%}")
                if name in ("log ratio", "sqrt ratio", "mixture (fifo's)"):
                    parts = [[np.nanmedian([v[i] for v in by_share[s]]) for s in SHARES] for i in (1, 2)]
                    line += ("   running " + " / ".join(f"x{v:.2f}" for v in parts[0])
                             + ", not started " + " / ".join(f"x{v:.2f}" if np.isfinite(v) else "-" for v in parts[1]))
                print(line, flush=True)


if __name__ == "__main__":
    main()
