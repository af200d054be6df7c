"""Output-length predictors side by side on held-out rows: Kendall's tau, MAE, calibration, bucket hit, cost.

Data: benchmarks/data/lengths.parquet (benchmarks/length_prediction_data.py):
real prompts from ../shared/data answered by the embedded model with its
preset, each sampled several times. Protocol: repeated K-fold
cross-validation. In repeat r the rows are split into --folds folds (seed r);
a trained predictor learns from the other folds' lengths in sampling r, and
every predictor is scored on the held-out fold against sampling r + 1 (the
next run of those prompts; no row's own lengths are ever seen in training).
The online predictors replay each held-out fold as a run of it would, in the
order its rows finished, learning as they finish. Figures are over the pooled
held-out predictions of a repeat; the table gives the mean and the spread
(min-max) over repeats.

Reference lines: "the other sampling" (sampling r's length as the prediction of
sampling r + 1: the ceiling docs/BENCHMARKS.md measured) and "mean of the other
samplings" (the best a prompt-only predictor can do, near enough, with three).

    python benchmarks/length_prediction.py                      # every row (GSM8K, MT-bench, Vicuna, 2nd turns)
    python benchmarks/length_prediction.py --sources mt_bench,vicuna   # the open-ended first turns only
    python benchmarks/length_prediction.py --probe              # with the hidden-state probe (embeds once, cached)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "benchmarks", "data", "lengths.parquet")


def load(path: str, sources):
    import pyarrow.parquet as pq

    from overnight.buckets.features import featurize, prompt_text

    t = pq.read_table(path)
    meta = json.loads(t.schema.metadata[b"overnight_lengths"])
    rows = [r for r in t.to_pylist() if not sources or r["source"] in sources]
    k = meta["samplings"]
    rows = [r for r in rows if all(r.get(f"out_{i}") is not None for i in range(1, k + 1))]
    texts = [prompt_text(r["prompt"], json.loads(r["messages"]) if r["messages"] else None) for r in rows]
    cap = int(meta["sampling"]["max_tokens"])
    fb = featurize(texts, [r["prompt_tokens"] for r in rows], [cap] * len(rows))
    out = np.array([[r[f"out_{i}"] for i in range(1, k + 1)] for r in rows], dtype=np.float64)
    capped = np.array([[r[f"capped_{i}"] for i in range(1, k + 1)] for r in rows], dtype=bool)
    finished = np.array([[r[f"finished_{i}"] for i in range(1, k + 1)] for r in rows], dtype=np.float64)
    stored = np.array([[np.nan if r[f"stored_{i}"] is None else r[f"stored_{i}"] for i in range(1, k + 1)]
                       for r in rows], dtype=np.float64)
    return rows, fb, out, capped, finished, stored, meta


def job_seconds_per_row(meta) -> float:
    """Engine seconds a row took in the data's runs (the job's cost per row on this machine)."""
    runs = meta["runs"]
    return sum(r["engine_seconds"] for r in runs) / max(1, sum(r["rows"] for r in runs))


# -- predictor variants ---------------------------------------------------------------------------------------
# Each: (name, kind, factory). kind "static": fit(train fb, train lengths) -> predictor; "online": a learning
# predictor replayed over the held-out fold; "reference": a function of the other samplings.

def variants(args):
    from overnight.buckets.predictors import HeuristicPredictor, OnlinePredictor
    from overnight.buckets.trained import TrainedPredictor

    def mlp(fb, y, capped):
        from overnight.buckets.mlp import MlpPredictor

        return MlpPredictor.fit(fb, y, capped, epochs=40, seed=0)[0]

    def linear(**kw):
        return lambda fb, y, capped: TrainedPredictor.fit(fb, y, capped, **kw)[0]

    v = [
        ("heuristic", "static", lambda fb, y, capped: HeuristicPredictor()),
        ("online (from the heuristic)", "online", lambda fb, y, capped: OnlinePredictor()),
        ("trained: torch MLP (format 2, before)", "static", mlp),
        ("trained: ridge, log length (default)", "static", linear()),
        ("trained: ridge, no hashed words", "static", linear(words=False)),
        ("trained: ridge, rank target", "static", linear(target="rank")),
        ("trained: ridge, chosen by CV tau", "static", linear(select="tau")),
        ("trained: pairwise (RankNet)", "static", linear(objective="pairwise")),
        ("trained + online (warm start)", "online",
         lambda fb, y, capped: OnlinePredictor(prior=TrainedPredictor.fit(fb, y, capped)[0])),
    ]
    if args.only:
        v = [x for x in v if any(s in x[0] for s in args.only.split(","))]
    return v


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--sources", default="", help="comma-separated sources to keep (gsm8k, mt_bench, vicuna, "
                                                   "mt_bench_turn2); default all")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--only", default="", help="comma-separated name fragments of the variants to run")
    ap.add_argument("--probe", action="store_true", help="add the hidden-state probe (benchmarks/"
                                                         "length_prediction_probe.py embeds the prompts, cached)")
    ap.add_argument("--json", default=None, help="write the per-repeat figures here")
    args = ap.parse_args()

    from overnight.buckets.bucketing import assign, log_bounds
    from overnight.buckets.evaluate import replay
    from overnight.buckets.features import featurize, subset
    from overnight.buckets.metrics import kendall_tau

    sources = set(filter(None, args.sources.split(",")))
    rows, fb, out, capped, finished, stored, meta = load(args.data, sources)
    n, k = out.shape
    bounds = log_bounds(int(meta["sampling"]["max_tokens"]), 8)
    by_source = {s: sum(r["source"] == s for r in rows) for s in sorted({r["source"] for r in rows})}
    print(f"{n} rows ({', '.join(f'{s} {c}' for s, c in by_source.items())}), {k} samplings; data from commit "
          f"{meta['commit']}, {meta['model']}, {meta['sampling']}")
    print(f"mean output tokens per sampling: {', '.join(f'{x:.0f}' for x in out.mean(axis=0))}; "
          f"{args.repeats} repeats of {args.folds}-fold cross-validation\n")

    vs = variants(args)
    probe = None
    if args.probe:
        import importlib.util

        spec = importlib.util.spec_from_file_location("lp_probe", os.path.join(REPO, "benchmarks",
                                                                               "length_prediction_probe.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        probe = mod.Probe.load_cached([r["id"] for r in rows])
        vs.append(("hidden-state probe (ridge)", "probe", None))
    names = [v[0] for v in vs] + ["stored in the run (online, as run)", "the other sampling",
                                  "mean of the other samplings"]
    stats = {nm: {"tau": [], "mae": [], "cal": [], "hit": [], "train_tau": []} for nm in names}
    fit_s = {nm: [] for nm in names}

    def score(nm, pred, truth):
        stats[nm]["tau"].append(kendall_tau(pred, truth))
        stats[nm]["mae"].append(float(np.mean(np.abs(pred - truth))))
        stats[nm]["cal"].append(float(np.mean(pred) / np.mean(truth)))
        stats[nm]["hit"].append(float(np.mean(assign(pred, bounds) == assign(truth, bounds))))

    for r in range(args.repeats):
        s_train, s_test = r % k, (r + 1) % k
        fold_of = np.random.default_rng(r).permutation(n) % args.folds
        truth = out[:, s_test]
        preds = {nm: np.zeros(n) for nm in names}
        for f in range(args.folds):
            tr, te = np.flatnonzero(fold_of != f), np.flatnonzero(fold_of == f)
            fb_tr, fb_te = subset(fb, tr), subset(fb, te)
            y_tr = out[tr, s_train]
            for nm, kind, make in vs:
                t0 = time.perf_counter()
                if kind == "probe":
                    preds[nm][te] = probe.fit_predict(tr, y_tr, te)
                    continue
                p = make(fb_tr, y_tr, capped[tr, s_train])
                fit_s[nm].append(time.perf_counter() - t0)
                if kind == "online":
                    order = np.argsort(finished[te, s_test], kind="stable")
                    preds[nm][te] = replay(p, fb_te, truth[te], capped[te, s_test], order)
                else:
                    preds[nm][te] = p.predict(fb_te).tokens
                    if f == 0:
                        stats[nm]["train_tau"].append(kendall_tau(p.predict(fb_tr).tokens, y_tr))
        preds["stored in the run (online, as run)"] = stored[:, s_test]
        preds["the other sampling"] = out[:, s_train]
        others = [i for i in range(k) if i != s_test]
        preds["mean of the other samplings"] = out[:, others].mean(axis=1)
        for nm in names:
            score(nm, preds[nm], truth)
        print(f"repeat {r}: trained on sampling {s_train + 1}, scored on sampling {s_test + 1}: " +
              ", ".join(f"{nm.split(':')[-1].strip()[:18]} {stats[nm]['tau'][-1]:.3f}" for nm in names[:4]), flush=True)

    # Cost per row: featurize + predict (+ learn, for the online ones) over every row, against the job's time.
    job_s = job_seconds_per_row(meta)
    texts = list(fb.texts)
    t0 = time.perf_counter()
    for _ in range(3):
        featurize(texts, fb.prompt_tokens.tolist(), fb.caps.tolist())
    feat_s = (time.perf_counter() - t0) / 3 / n
    cost = {}
    for nm, kind, make in vs:
        if kind == "probe":
            cost[nm] = probe.seconds_per_row
            continue
        p = make(fb, out[:, 0], capped[:, 0])
        t0 = time.perf_counter()
        for _ in range(3):
            if kind == "online":
                replay(p, fb, out[:, 0], capped[:, 0], np.arange(n))
            else:
                p.predict(fb)
        cost[nm] = feat_s + (time.perf_counter() - t0) / 3 / n

    def cell(xs, fmt):
        xs = [x for x in xs if not (isinstance(x, float) and math.isnan(x))]
        if not xs:
            return "-"
        return f"{fmt.format(np.mean(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"

    print(f"\nheld-out rows: {n} per repeat; the job took {job_s:.2f} engine-seconds a row on this machine\n")
    print("| predictor | Kendall's tau | MAE (tokens) | mean predicted / actual | bucket hit | train tau | "
          "cost per row | share of the job |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for nm in names:
        s = stats[nm]
        c = cost.get(nm)
        c_s = f"{c * 1e6:.0f} us" if c is not None else "-"
        share = f"{c / job_s:.4%}" if c is not None else "-"
        print(f"| {nm} | {cell(s['tau'], '{:.3f}')} | {cell(s['mae'], '{:.0f}')} | {cell(s['cal'], '{:.2f}')} | "
              f"{cell(s['hit'], '{:.0%}')} | {cell(s['train_tau'], '{:.2f}')} | {c_s} | {share} |")
    print(f"\nfit seconds (mean per fold): " + ", ".join(f"{nm.split(':')[-1].strip()[:24]} {np.mean(v):.2f}"
                                                        for nm, v in fit_s.items() if v))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"stats": stats, "cost": cost, "job_seconds_per_row": job_s}, fh, indent=1)


if __name__ == "__main__":
    main()
