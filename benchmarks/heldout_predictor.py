"""A trained length predictor for benchmarks/forecast.py's workload, fitted on labelled rows the workload does not hold.

benchmarks/data/lengths.parquet labels 480 real prompts (240 GSM8K, 80 MT-bench, 80 Vicuna bench, 80 MT-bench second
turns) with the embedded model's output lengths. This fits `overnight predictor train`'s model (the word model and
the embedded model's token embeddings, as the command does) on every labelled row whose id is not in the workload
that forecast.py builds with the same --workload, --rows and --seed, on the first sampling's lengths, and saves it
for `overnight run --predictor FILE`. It prints the fit's own report and, on the workload's labelled rows (which it
did not see), Kendall's tau and mean predicted / mean actual.

    python benchmarks/heldout_predictor.py --workload mixed --rows 300 --save /tmp/mixed.pt
    python benchmarks/forecast.py --workload mixed --rows 300 --extra "--predictor /tmp/mixed.pt" ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.path.join(HERE, "..", "..", "shared", "data"))
    ap.add_argument("--labels", default=os.path.join(HERE, "data", "lengths.parquet"))
    ap.add_argument("--workload", default="open")
    ap.add_argument("--rows", type=int, default=150)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--save", required=True)
    args = ap.parse_args()
    sys.path.insert(0, HERE)
    import pyarrow.parquet as pq
    from forecast import workload

    from overnight.buckets.features import featurize, prompt_text, subset
    from overnight.buckets.metrics import kendall_tau
    from overnight.buckets.tokens import TokenInputs
    from overnight.buckets.trained import TrainedPredictor

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "in.parquet")
        workload(args.data, args.rows, args.seed, path, args.workload)
        in_run = set(pq.read_table(path, columns=["id"]).column("id").to_pylist())
    rows = pq.read_table(args.labels).to_pylist()
    cap = json.loads(pq.read_metadata(args.labels).metadata[b"overnight_lengths"])["sampling"]["max_tokens"]
    fb = featurize([prompt_text(r["prompt"], json.loads(r["messages"]) if r["messages"] else None) for r in rows],
                   [r["prompt_tokens"] for r in rows], [cap] * len(rows))
    actual = np.array([r["out_1"] for r in rows], np.float64)
    capped = np.array([r["capped_1"] for r in rows], bool)
    seen = np.array([r["id"] in in_run for r in rows])
    train, test = np.flatnonzero(~seen), np.flatnonzero(seen)
    p, report = TrainedPredictor.fit(subset(fb, train), actual[train], capped[train],
                                     tokens=TokenInputs.of_model("smollm2-135m"))
    p.save(args.save)
    got = p.predict(subset(fb, test)).tokens
    kinds = {}
    for r in (rows[i] for i in train):
        kinds[r["source"]] = kinds.get(r["source"], 0) + 1
    print(f"trained on {len(train)} labelled rows not in the {args.workload} workload ({kinds}); cross-validated tau "
          f"{report.cv_tau:.3f}")
    print(f"on the workload's {len(test)} labelled rows: tau {kendall_tau(got, actual[test]):.3f}, mean predicted / "
          f"mean actual {got.mean() / actual[test].mean():.3f} -> {args.save}")


if __name__ == "__main__":
    main()
