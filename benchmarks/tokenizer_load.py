"""Loading the embedded model's tokenizer in a fresh process, as a job that starts no vLLM does (the echo engine,
`overnight plan`), two ways side by side: AutoTokenizer.from_pretrained (before), and overnight's load_tokenizer,
which takes transformers' TokenizersBackend directly for a folder AutoTokenizer would load as that class (after).
Each way runs in its own Python process, interleaved, so that neither finds the other's imports; a whole echo run
of 5 rows is timed the same way, with the tokenizer loaded each way.

    python benchmarks/tokenizer_load.py --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOAD = {
    "AutoTokenizer": "from transformers import AutoTokenizer; from overnight.pipeline.tools.models import resolve; "
                     "AutoTokenizer.from_pretrained(resolve('smollm2-135m').path)",
    "load_tokenizer": "from overnight.pipeline.tools.models import load_tokenizer, resolve; "
                      "load_tokenizer(resolve('smollm2-135m'))",
}
# The same echo run, its tokenizer loaded through AutoTokenizer (the path taken before) or as it is now.
RUN = ("import sys; from overnight.pipeline.tools import models; from overnight.jobs.cli import main; "
       "{patch}sys.argv = ['overnight', 'run', {inp!r}, '--out', {out!r}, '--engine', 'echo', '--limit', '5']; "
       "main()")
PATCH = {"AutoTokenizer": "models._names_tokenizers_backend = lambda folder: False; ", "load_tokenizer": ""}


def timed(code: str) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, cwd=REPO)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    inp = os.path.join(REPO, "examples", "prompts.parquet")
    loads = {k: [] for k in LOAD}
    runs = {k: [] for k in LOAD}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for k in LOAD:
                loads[k].append(timed(LOAD[k]))
                out = os.path.join(tmp, f"{k}-{i}")
                runs[k].append(timed(RUN.format(patch=PATCH[k], inp=inp, out=out)))
    for label, table in (("tokenizer load, process included", loads), ("echo run of 5 rows", runs)):
        med = {k: statistics.median(v) for k, v in table.items()}
        print(f"{label}: " + "; ".join(f"{k} median {med[k]:.2f} s ({', '.join(f'{x:.2f}' for x in table[k])})"
                                       for k in table)
              + f"; ratio {med['AutoTokenizer'] / med['load_tokenizer']:.2f}x")


if __name__ == "__main__":
    main()
