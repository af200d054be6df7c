"""How much of an answer's length the prompt decides: two runs over the same prompts, Kendall's tau between them.

No predictor that sees only the prompt can be expected to rank one sampling's
output lengths much better than another sampling of the same prompts does, so
this is the ceiling the prediction benchmark is read against. Ids are grouped
by their prefix (gsm8k-, mt_bench-, ...) for a per-source figure.

    python benchmarks/length_noise.py RUN_1 RUN_2
"""

from __future__ import annotations

import argparse
import collections

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs=2, help="two `overnight run` output folders over the same prompts")
    args = ap.parse_args()

    from overnight.buckets.metrics import kendall_tau
    from overnight.pipeline.tools.inspection import open_results

    lengths = []
    for url in args.runs:
        con, _ = open_results(url)
        lengths.append(dict(con.execute("select id, output_tokens from results where status = 'ok'").fetchall()))
    ids = sorted(set(lengths[0]) & set(lengths[1]), key=str)
    a = np.array([lengths[0][i] for i in ids], dtype=float)
    b = np.array([lengths[1][i] for i in ids], dtype=float)
    print(f"{len(ids)} rows in both runs: Kendall's tau between the two samplings {kendall_tau(a, b):.3f}")
    groups = collections.defaultdict(list)
    for k, i in enumerate(ids):
        groups[str(i).split("-")[0][:12]].append(k)
    for name, idx in sorted(groups.items()):
        print(f"  {name:12s} {len(idx):4d} rows  tau {kendall_tau(a[idx], b[idx]):.3f}")


if __name__ == "__main__":
    main()
