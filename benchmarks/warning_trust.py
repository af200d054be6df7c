"""When the early warning comes while only the engine's first step sizes are measured (stop 51).

The warning waits until the step cost's fit can be trusted (DeadlineTracker.trusts): sizes that tell the fixed
cost from the per-sequence one, or steps near the size the rows left run at. The probe's sizes (a quarter and a
half of the engine) may be the only ones measured for many seconds, and under auto's cap one size for minutes.
DeadlineTracker.misses_at_best also trusts a miss that holds even if a full engine's step cost no more than the
largest step measured. This runs the same job with that rule off and on, alternately, in one process (one engine,
started before: the warning's timing, not the engine's start-up), and prints for each run the seconds from the
job's start to the first forecast that said "at risk", the rows done then, and the rows the job did.

    python benchmarks/warning_trust.py --repeats 3          # 200 open-ended prompts, max_tokens 128, 40 s budget
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


def one(cli, inp: Path, out: Path, budget: str, max_tokens: int) -> dict:
    from click.testing import CliRunner

    r = CliRunner().invoke(cli, ["run", str(inp), "--out", str(out), "--max-tokens", str(max_tokens),
                                 "--time-budget", budget])
    timeline = json.loads((out / "timeline.json").read_text())
    t0 = timeline[0]["t"]
    warned = [s for s in timeline if s["at_risk"]]
    done = json.loads((out / "status.json").read_text())["rows"]["done"]
    return {"exit": r.exit_code, "warned_s": round(warned[0]["t"] - t0, 1) if warned else None,
            "rows_done_then": warned[0]["rows_done"] if warned else None, "rows_done": done}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--budget", default="40s")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import pyarrow.parquet as pq
    from click.testing import CliRunner

    from conftest import real_prompts
    from overnight.jobs.cli import cli
    from overnight.pipeline.scheduling import deadline

    rule = deadline.DeadlineTracker.misses_at_best
    results = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        inp = d / "in.parquet"
        pq.write_table(real_prompts(args.rows), inp)
        CliRunner().invoke(cli, ["run", str(inp), "--out", str(d / "warm"), "--limit", "2", "--max-tokens", "4"])
        for i in range(args.repeats):
            for side in (("off", "on") if i % 2 == 0 else ("on", "off")):
                deadline.DeadlineTracker.misses_at_best = rule if side == "on" else (lambda self, f, size: False)
                r = one(cli, inp, d / f"{side}{i}", args.budget, args.max_tokens)
                results[side].append(r)
                print(f"repeat {i} rule {side}: {r}", flush=True)
        deadline.DeadlineTracker.misses_at_best = rule
    for side, rs in results.items():
        times = [r["warned_s"] for r in rs if r["warned_s"] is not None]
        print(f"rule {side}: warned in {len(times)} of {len(rs)} runs; seconds to the warning "
              f"{sorted(times)} (median {statistics.median(times) if times else None}); rows done then "
              f"{[r['rows_done_then'] for r in rs]}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
