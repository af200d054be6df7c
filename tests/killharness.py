"""Kill `overnight run` again and again over one job, rerunning it after each kill, then count.

Each attempt is a real `overnight run` process. Kills alternate between a
SIGKILL at a random moment and a SIGKILL from inside the process at a
failpoint: while reading input, with a part written under its temporary name
but not renamed, with a part visible but not yet in the manifest, and half-way
through a manifest update. After the kills, one more run completes the job;
then every Parquet file must be readable, every input id must appear exactly
once, and the manifest's counts must match the data.

    python tests/killharness.py --kills 20 --rows 4000               # echo engine, about two minutes
    python tests/killharness.py --kills 5 --rows 120 --engine vllm   # the real engine, ~40 s per restart

On the echo engine the job runs on a tiny model folder (tests/fakes.py: a tokenizer, no weights), so the
harness does not need the embedded model prepared; on vLLM it runs the embedded model.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from conftest import overnight_cmd, real_prompts  # noqa: E402

KILL_POINTS = [
    ("random moment", None),
    ("reading input", "source.batch"),
    ("writing a part (before rename)", "storage.before_rename"),
    ("part written, manifest not updated", "part.after_write"),
    ("updating the manifest", "manifest.before_write"),
    ("right after a manifest update", "manifest.after_write"),
]


@dataclass
class Report:
    engine: str
    rows: int
    kills: int = 0
    runs: int = 0
    kills_by_point: dict = field(default_factory=dict)
    rows_lost: int = 0
    duplicates: int = 0
    unreadable_files: int = 0
    manifest_matches: bool = False
    recover_s: list = field(default_factory=list)  # per kill: restart until the next part appears (or the end)
    final_s: float = 0.0


def make_input(path: Path, n: int) -> list:
    import pyarrow as pa
    import pyarrow.parquet as pq

    base = real_prompts(min(n, 60))
    reps = -(-n // base.num_rows)
    table = pa.concat_tables([base] * reps).slice(0, n)
    ids = [f"k{i:05d}" for i in range(n)]
    table = table.set_column(0, "id", pa.array(ids))
    pq.write_table(table, path, row_group_size=max(50, n // 10))
    return ids


def parts(out: Path) -> list[Path]:
    return sorted((out / "parts").glob("part-*.parquet")) if (out / "parts").exists() else []


def run(inp: Path, out: Path, engine: str, rows: int, kills: int, seed: int, model: Optional[str] = None,
        log=print) -> Report:
    """model: --model for every attempt (None: the default, the embedded model)."""
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    ids = make_input(inp, rows)
    report = Report(engine=engine, rows=rows)
    base_env = dict(os.environ)
    config = inp.with_name("killharness.yaml")
    # Many read batches, so kills land while reading too; 64 rows in flight (the embedded model's preset) with
    # any model, so an attempt gets as far before a kill.
    config.write_text("input:\n  batch_rows: 100\nengine:\n  max_num_seqs: 64\n")
    args = [*overnight_cmd(), "run", str(inp), "--out", str(out), "--config", str(config), "--max-tokens", "48",
            "--flush-rows", "25", "--flush-seconds", "1", "--log-every", "5"]
    if model is not None:
        args += ["--model", model]
    if engine == "echo":
        base_env["OVERNIGHT_ENGINE"] = "echo:step_ms=4"
    else:
        base_env.pop("OVERNIGHT_ENGINE", None)
    budget = 8.0 if engine == "echo" else 60.0  # about how long an uninterrupted attempt makes progress
    while report.kills < kills:
        name, point = KILL_POINTS[report.kills % len(KILL_POINTS)]
        env = dict(base_env)
        if point:
            env["OVERNIGHT_FAILPOINTS"] = f"{point}=kill@{rng.randint(1, 4)}"
        before = len(parts(out))
        t0 = time.monotonic()
        proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        report.runs += 1
        killed = False
        if point is None:
            deadline = t0 + rng.uniform(0.3, budget)
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                killed = True
        proc.wait(timeout=600)
        if point is not None and proc.returncode == -signal.SIGKILL:
            killed = True
        try:  # the engine's own processes follow their parent; make sure
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        elapsed = time.monotonic() - t0
        if killed:
            report.kills += 1
            report.kills_by_point[name] = report.kills_by_point.get(name, 0) + 1
            report.recover_s.append(round(elapsed, 2))
            log(f"kill {report.kills:3d} at {name:38s} after {elapsed:5.1f} s; parts {before} -> {len(parts(out))}")
        elif proc.returncode == 0:
            log("the job completed before it could be killed; starting over in a new folder is not needed: done")
            break
        else:
            raise RuntimeError(f"attempt failed with exit {proc.returncode}: {proc.stderr.read()[-2000:]}")
    t0 = time.monotonic()
    final = subprocess.run(args, env=base_env, capture_output=True, text=True, timeout=1800)
    report.runs += 1
    report.final_s = round(time.monotonic() - t0, 2)
    if final.returncode != 0:
        raise RuntimeError(f"final run failed with exit {final.returncode}: {final.stderr[-3000:]}")

    seen = []
    for p in parts(out):
        try:
            seen += pq.read_table(p, columns=["id", "status"]).column("id").to_pylist()
        except Exception:
            report.unreadable_files += 1
    counts = Counter(seen)
    report.rows_lost = len(set(ids) - set(counts))
    report.duplicates = sum(c - 1 for c in counts.values() if c > 1)
    manifest = json.loads((out / "manifest.json").read_text())
    c = manifest["counts"]
    report.manifest_matches = (c["num_done"] == len(seen) and c["num_parts"] == len(parts(out))
                               and manifest["state"] == "completed")
    return report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--rows", type=int, default=4000)  # more than 20 attempts can finish, so every kill lands mid-job
    ap.add_argument("--engine", choices=["echo", "vllm"], default="echo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        model = None
        if args.engine == "echo":
            from fakes import write_tiny_model
            model = write_tiny_model(Path(d) / "tiny-model")
        r = run(Path(d) / "in.parquet", Path(d) / "out", args.engine, args.rows, args.kills, args.seed, model)
    if args.json:
        print(json.dumps(asdict(r), indent=2))
    else:
        mean = sum(r.recover_s) / len(r.recover_s) if r.recover_s else 0
        print(f"{r.kills} kills over {r.runs} runs ({r.engine} engine, {r.rows} rows): rows lost {r.rows_lost}, "
              f"duplicates {r.duplicates}, unreadable files {r.unreadable_files}, manifest matches data: "
              f"{r.manifest_matches}; mean attempt before a kill {mean:.1f} s, final run {r.final_s:.1f} s")
        for k, v in r.kills_by_point.items():
            print(f"  {v:3d} x {k}")


if __name__ == "__main__":
    main()
