"""Build examples/prompts.parquet from the shared prompt sets (run once by developers).

200 rows: 100 GSM8K, 50 MT-bench (first turns), 50 Vicuna bench, shuffled with a fixed seed.
"""

import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

src = sys.argv[1] if len(sys.argv) > 1 else "../shared/data"
rng = np.random.default_rng(20261122)
parts = []
for name, n in (("gsm8k_test", 100), ("mt_bench", 50), ("vicuna_bench", 50)):
    t = pq.read_table(f"{src}/{name}.parquet")
    idx = np.sort(rng.choice(t.num_rows, size=n, replace=False))
    t = t.take(idx)
    category = t.column("category") if "category" in t.column_names else pa.array(["math"] * n)
    parts.append(pa.table({"id": t.column("id"), "source": [name] * n, "category": category,
                           "prompt": t.column("prompt")}))
table = pa.concat_tables(parts)
table = table.take(rng.permutation(table.num_rows))
pq.write_table(table, "examples/prompts.parquet")
print(table.num_rows, "rows ->", "examples/prompts.parquet")
