"""Output-length predictors side by side on held-out rows: Kendall's tau, MAE, calibration, bucket hit, cost.

Data: benchmarks/data/lengths.parquet (benchmarks/length_prediction_data.py):
real prompts from ../shared/data answered by the embedded model with its
preset, each sampled several times. Protocol: repeated K-fold
cross-validation. In repeat r the rows are split into --folds folds (seed r);
a trained predictor learns from the other folds' lengths in sampling r, and
every predictor is scored on the held-out fold against sampling r + 1 (the
next run of those prompts; no row's own lengths are ever seen in training).
The learning predictors need no training rows: each repeat simulates one run
over every row (simulate_run: input order shuffled, 64 rows in flight, each
row's prediction taken when it is admitted, finished rows handed over 256 at a
time as the annotator does); the warm start's prior predicts each row with the
trained model of the fold that held it out. Figures are over the pooled
held-out predictions of a repeat; the table gives the mean and the spread
(min-max) over repeats.

Reference lines: "the other sampling" (sampling r's length as the prediction of
sampling r + 1: the ceiling docs/BENCHMARKS.md measured) and, with three or more
samplings, "mean of the other samplings". "stored in the run" is what the
data's own runs stored (the online predictor of the code they ran on).

    python benchmarks/length_prediction.py                      # every row (GSM8K, MT-bench, Vicuna, 2nd turns)
    python benchmarks/length_prediction.py --sources mt_bench,vicuna   # the open-ended first turns only
    python benchmarks/length_prediction.py --probe vllm,vllm_cut15  # with the hidden-state probe: run
        # benchmarks/length_prediction_probe.py cost --layers 15 first (and embed, for the transformers blocks)
    python benchmarks/length_prediction.py --only default --probe last4,mean1 --with-trained
        # each probe block alone, and averaged with the default trained predictor (the mean of their log predictions)
"""

from __future__ import annotations

import argparse
import copy
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


class AdaGradOnline:
    """The online predictor before commit 5092d2b, for the 'before' line: log(tokens) = log(heuristic) + w . x,
    w learned by AdaGrad (lr 0.3) from finished rows, which the annotator handed it 256 at a time."""

    learns = True

    def __init__(self):
        from overnight.buckets.features import BASE_NUMERIC_NAMES, HASH_DIM

        self.k = len(BASE_NUMERIC_NAMES)
        self.w, self.g2 = np.zeros(HASH_DIM), np.full(HASH_DIM, 1e-6)
        self.wn, self.gn2 = np.zeros(self.k + 1), np.full(self.k + 1, 1e-6)
        self.num_observed = 0

    def _numeric(self, fb):
        x = fb.numeric[:, :self.k].astype(np.float64) / np.array([6, 7, 6, 2, 0.2, 10, 5, 6])
        return np.hstack([x, np.ones((len(fb), 1))])

    def _correction(self, fb):
        row_of = np.repeat(np.arange(len(fb)), np.diff(fb.indptr))
        return np.bincount(row_of, weights=self.w[fb.indices] * fb.values, minlength=len(fb)) + self._numeric(fb) @ self.wn

    def predict(self, fb):
        from overnight.buckets.predictors import Prediction

        base = np.log(np.maximum(fb.heuristic.astype(np.float64), 1.0))
        log_t = base + (self._correction(fb) if self.num_observed >= 16 else 0.0)
        t = np.clip(np.exp(log_t), 1.0, np.maximum(fb.caps, 1).astype(np.float64))
        return Prediction(t, log_t)

    def observe(self, fb, actual, hit_cap):
        base = np.log(np.maximum(fb.heuristic.astype(np.float64), 1.0))
        err = base + self._correction(fb) - np.log(np.maximum(actual, 1.0))
        err = np.where(hit_cap & (err > 0), 0.0, err)
        row_of = np.repeat(np.arange(len(fb)), np.diff(fb.indptr))
        touched, where = np.unique(fb.indices, return_inverse=True)
        g = np.bincount(where, weights=err[row_of] * fb.values, minlength=len(touched)) + 1e-5 * self.w[touched]
        self.g2[touched] += g * g
        self.w[touched] -= 0.3 * g / np.sqrt(self.g2[touched])
        gn = self._numeric(fb).T @ err + 1e-5 * self.wn
        self.gn2 += gn * gn
        self.wn -= 0.3 * gn / np.sqrt(self.gn2)
        self.num_observed += len(fb)


def simulate_run(p, fb, actual, capped, order, slots: int = 64):
    """A learning predictor's predictions as a run makes them: rows admitted in `order` (input order, FIFO),
    `slots` at a time (the preset's max_num_seqs); a row runs for its actual length (one token a step for every
    row, as when the engine is full) and then is learned from, in the annotator's batches of 256; each row's
    prediction is the one it had when it was admitted."""
    import heapq

    from overnight.buckets.annotate import LEARN_BATCH
    from overnight.buckets.features import subset

    n = len(order)
    pred = np.zeros(n)
    running: list = []
    pending: list = []
    t, nxt = 0.0, 0
    while nxt < n or running:
        if nxt < n and len(running) < slots:
            rows = order[nxt:nxt + slots - len(running)]
            nxt += len(rows)
            pred[rows] = p.predict(subset(fb, rows)).tokens
            for r in rows:
                heapq.heappush(running, (t + actual[r], int(r)))
        t, r = heapq.heappop(running)
        pending.append(r)
        if len(pending) >= LEARN_BATCH:
            rows = np.array(pending)
            p.observe(subset(fb, rows), actual[rows], capped[rows])
            pending = []
    return pred


class CrossFitted:
    """A prior whose prediction of each row comes from a model that did not see it (the fold's model)."""

    def __init__(self, fb, preds, name="trained"):
        self.name = name
        self.by_text = {(t, int(k)): i for i, (t, k) in enumerate(zip(fb.texts, fb.prompt_tokens))}
        self.preds = preds  # Prediction over every row

    @property
    def calib(self):
        return (0.0, 1.0, 1.0)  # scores are log lengths; tokens already calibrated

    def predict(self, fb):
        from overnight.buckets.predictors import Prediction

        idx = np.array([self.by_text[(t, int(k))] for t, k in zip(fb.texts, fb.prompt_tokens)], dtype=np.int64)
        return Prediction(self.preds.tokens[idx], self.preds.score[idx])


def job_seconds_per_row(meta) -> float:
    """Engine seconds a row took in the data's runs (the job's cost per row on this machine)."""
    runs = meta["runs"]
    return sum(r["engine_seconds"] for r in runs) / max(1, sum(r["rows"] for r in runs))


# -- predictor variants ---------------------------------------------------------------------------------------
# Each: (name, kind, factory). kind "static": fit(train fb, train lengths) -> predictor; "online": a learning
# predictor replayed over the held-out fold; "reference": a function of the other samplings.

def with_tokens(linear):
    """The default fit with the token model beside it, as `overnight predictor train` makes it, on the embedded
    model's embeddings (the data's model: benchmarks/length_prediction_data.py); they are read once."""
    inputs = []

    def make(fb, y, capped):
        if not inputs:
            from overnight.buckets.tokens import TokenInputs

            inputs.append(TokenInputs.of_model("smollm2-135m"))
        return linear(tokens=inputs[0])(fb, y, capped)

    return make


def variants(args):
    from overnight.buckets.predictors import HeuristicPredictor, OnlinePredictor
    from overnight.buckets.trained import TrainedPredictor

    def mlp(fb, y, capped):
        from overnight.buckets.mlp import MlpPredictor

        return MlpPredictor.fit(fb, y, capped, epochs=40, seed=0)[0]

    def linear(**kw):
        return lambda fb, y, capped: TrainedPredictor.fit(fb, y, capped, **kw)[0]

    def without_kinds(make):
        """The same fit with the kind-of-task and chat-context features zeroed (constant columns weigh nothing)."""
        from overnight.buckets.features import BASE_NUMERIC_NAMES

        def strip(fb):
            fb = copy.copy(fb)
            fb.numeric = fb.numeric.copy()
            fb.numeric[:, len(BASE_NUMERIC_NAMES):] = 0.0
            return fb

        class Stripped:
            def __init__(self, p):
                self.p = p

            def predict(self, fb):
                return self.p.predict(strip(fb))

        return lambda fb, y, capped: Stripped(make(strip(fb), y, capped))

    v = [
        ("heuristic", "static", lambda fb, y, capped: HeuristicPredictor()),
        ("online: AdaGrad, batches of 256 (before)", "online", lambda: AdaGradOnline()),
        ("online (from the heuristic)", "online", lambda: OnlinePredictor()),
        ("trained: torch MLP (format 2, before)", "static", mlp),
        ("trained: ridge, rank target, chosen by CV tau (default)", "static", linear()),
        ("trained: ridge, penalties by CV over 3 splits", "static", linear(cv_repeats=3)),
        ("trained: ridge, log-length target", "static", linear(target="log")),
        ("trained: ridge, log length, chosen by CV squared error (1-SE)", "static", linear(target="log", select="mse")),
        ("trained: ridge, no hashed words", "static", linear(words=False)),
        ("trained: ridge, no kind or chat features", "static", without_kinds(linear())),
        ("trained: pairwise (RankNet)", "static", linear(objective="pairwise")),
        ("trained + online (warm start)", "warm", lambda prior: OnlinePredictor(prior=prior)),
        ("trained: with the model's token embeddings (buckets/tokens.py)", "static", with_tokens(linear)),
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
    ap.add_argument("--probe", default="", help="add the hidden-state probe on these blocks (comma-separated: "
                                                "vllm, vllm_cut<layers> from `length_prediction_probe.py cost`; "
                                                "mean<k>, last<k> (after k layers), last from `length_prediction_probe.py embed`; "
                                                "cut<k> from its `layers`)")
    ap.add_argument("--with-trained", action="store_true", help="also score each probe block averaged with the "
                                                                  "default trained predictor (mean of log predictions)")
    ap.add_argument("--json", default=None, help="write the per-repeat figures here")
    args = ap.parse_args()

    from overnight.buckets.bucketing import assign, log_bounds
    from overnight.buckets.features import featurize, subset
    from overnight.buckets.metrics import kendall_tau
    from overnight.buckets.predictors import Prediction
    from overnight.buckets.trained import TrainedPredictor

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
    probes = {}
    if args.probe:
        import importlib.util

        spec = importlib.util.spec_from_file_location("lp_probe", os.path.join(REPO, "benchmarks",
                                                                               "length_prediction_probe.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        for block in args.probe.split(","):
            nm = f"hidden-state probe: ridge on {block}"
            probes[nm] = mod.Probe.load_cached([r["id"] for r in rows], args.data, block)
            vs.append((nm, "probe", None))
    both = {f"trained + probe on {nm.rsplit(' ', 1)[-1]} (mean of log predictions)": nm
            for nm in probes} if args.with_trained else {}
    names = [v[0] for v in vs] + list(both) + ["stored in the run (online, as run)", "the other sampling"]
    if k > 2:
        names.append("mean of the other samplings")
    stats = {nm: {"tau": [], "mae": [], "cal": [], "hit": [], "train_tau": []} for nm in names}
    fit_s = {nm: [] for nm in names}

    def score(nm, pred, truth):
        stats[nm]["tau"].append(kendall_tau(pred, truth))
        stats[nm]["mae"].append(float(np.mean(np.abs(pred - truth))))
        stats[nm]["cal"].append(float(np.mean(pred) / np.mean(truth)))
        stats[nm]["hit"].append(float(np.mean(assign(pred, bounds) == assign(truth, bounds))))

    default = next(nm for nm, _, _ in vs if "(default)" in nm)
    for r in range(args.repeats):
        s_train, s_test = r % k, (r + 1) % k
        fold_of = np.random.default_rng(r).permutation(n) % args.folds
        truth = out[:, s_test]
        preds = {nm: np.zeros(n) for nm in names}
        default_score = np.zeros(n)
        for f in range(args.folds):
            tr, te = np.flatnonzero(fold_of != f), np.flatnonzero(fold_of == f)
            fb_tr, fb_te = subset(fb, tr), subset(fb, te)
            y_tr = out[tr, s_train]
            for nm, kind, make in vs:
                if kind not in ("static", "probe") and not (kind == "warm" and nm == default):
                    continue
                t0 = time.perf_counter()
                if kind == "probe":
                    preds[nm][te] = probes[nm].fit_predict(tr, y_tr, te)
                    continue
                p = make(fb_tr, y_tr, capped[tr, s_train])
                fit_s[nm].append(time.perf_counter() - t0)
                pr = p.predict(fb_te)
                preds[nm][te] = pr.tokens
                if nm == default:
                    default_score[te] = pr.score
                if f == 0:
                    stats[nm]["train_tau"].append(kendall_tau(p.predict(fb_tr).tokens, y_tr))
        # Learning predictors: a simulated run over every row in a random input order (see simulate_run); the
        # warm start's prior predicts each row with the trained model of the fold that held it out.
        order = np.random.default_rng(100 + r).permutation(n)
        for nm, kind, make in vs:
            if kind == "online":
                p = make()
                preds[nm] = simulate_run(p, fb, truth, capped[:, s_test], order)
            elif kind == "warm":
                prior = CrossFitted(fb, Prediction(preds[default].copy(), default_score.copy()))
                preds[nm] = simulate_run(make(prior), fb, truth, capped[:, s_test], order)
        for nm, probe_nm in both.items():
            preds[nm] = np.exp(0.5 * np.log(preds[default]) + 0.5 * np.log(preds[probe_nm]))
        preds["stored in the run (online, as run)"] = stored[:, s_test]
        preds["the other sampling"] = out[:, s_train]
        if k > 2:
            preds["mean of the other samplings"] = out[:, [i for i in range(k) if i != s_test]].mean(axis=1)
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
    order = np.arange(n)
    for nm, kind, make in vs:
        if kind == "probe":
            cost[nm] = probes[nm].seconds_per_row
            continue
        if kind == "static":
            p = make(fb, out[:, 0], capped[:, 0])
            t0 = time.perf_counter()
            for _ in range(3):
                p.predict(fb)
            cost[nm] = feat_s + (time.perf_counter() - t0) / 3 / n
            continue
        prior = TrainedPredictor.fit(fb, out[:, 0], capped[:, 0])[0] if kind == "warm" else None
        t0 = time.perf_counter()
        p = make(prior) if kind == "warm" else make()
        simulate_run(p, fb, out[:, 0], capped[:, 0], order)
        cost[nm] = feat_s + (time.perf_counter() - t0) / n  # predicting and learning, over one run of n rows

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
    print("\nfit seconds (mean per fold): " + ", ".join(f"{nm.split(':')[-1].strip()[:24]} {np.mean(v):.2f}"
                                                        for nm, v in fit_s.items() if v))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"stats": stats, "cost": cost, "job_seconds_per_row": job_s}, fh, indent=1)


if __name__ == "__main__":
    main()
