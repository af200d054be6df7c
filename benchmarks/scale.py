"""Scale on one machine: wall time and peak RSS of `overnight run` over N short rows, then of the rerun.

Builds N short rows (int or string ids, a short prompt) as several Parquet files of several row groups, runs

    overnight run IN --out OUT --engine echo --max-tokens 4 --json [--flush-rows N] [EXTRA...]

as a subprocess (the echo engine: 0 ms steps, no model output, so what is measured is overnight itself), then
runs the same command again, which finds every row done. For each run it prints the wall seconds and the peak
RSS of the process tree (psutil, polled every 0.1 s, summed over the process and its children), and checks
the summary (rows done, resumed).

    python benchmarks/scale.py --rows 1000000
    python benchmarks/scale.py --rows 10000000 --dir /tmp/scale-10m --keep
    python benchmarks/scale.py --rows 1000000 --breakdown [--trace]   # where the memory goes, in-process

--breakdown skips the subprocess runs and instead, in this process on an OUT the full run filled, measures
the RSS held by the scan of OUT and by a resume pass over the input; with --trace, the Python allocations
(tracemalloc) that hold it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERNIGHT = os.path.join(os.path.dirname(sys.executable), "overnight")

TEMPLATES = ["Say {} in words.", "What is {} plus one?", "Name a colour for item {}.",
             "Write a short title for note {}.", "Is {} a prime number? Answer briefly."]


def build(folder: str, n: int, files: int, row_group: int, ids: str) -> None:
    """n rows over `files` files of row groups of `row_group` rows: id, prompt."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    os.makedirs(folder, exist_ok=True)
    per = -(-n // files)
    for k in range(files):
        lo, hi = k * per, min(n, (k + 1) * per)
        if lo >= hi:
            break
        with pq.ParquetWriter(os.path.join(folder, f"part-{k:03d}.parquet"),
                              pa.schema([("id", pa.int64() if ids == "int" else pa.string()),
                                         ("prompt", pa.string())])) as w:
            for s in range(lo, hi, 1_000_000):
                e = min(hi, s + 1_000_000)
                num = np.arange(s, e, dtype=np.int64)
                text = pc.cast(pa.array(num), pa.string())
                id_col = pa.array(num) if ids == "int" else pc.binary_join_element_wise(
                    "row-", pc.utf8_lpad(text, 9, "0"), "")
                # "Say 123 in words." etc: the template split at "{}" with the number in between.
                which = pa.array(num % len(TEMPLATES))
                heads = pa.array([t.split("{}")[0] for t in TEMPLATES]).take(which)
                tails = pa.array([t.split("{}")[1] for t in TEMPLATES]).take(which)
                prompt = pc.binary_join_element_wise(heads, text, tails, "")
                w.write_table(pa.table({"id": id_col, "prompt": prompt}), row_group_size=row_group)


def peak_tree_rss(proc: subprocess.Popen, box: dict, every: float = 0.1) -> None:
    import psutil

    try:
        p = psutil.Process(proc.pid)
    except psutil.Error:
        return
    while proc.poll() is None:
        total = 0
        try:
            procs = [p] + p.children(recursive=True)
        except psutil.Error:
            break
        for q in procs:
            try:
                total += q.memory_info().rss
            except psutil.Error:
                pass
        box["peak"] = max(box.get("peak", 0), total)
        time.sleep(every)


def run(cmd: list[str], log_path: str) -> dict:
    box: dict = {}
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        watcher = threading.Thread(target=peak_tree_rss, args=(proc, box), daemon=True)
        watcher.start()
        out, _ = proc.communicate()
        wall = time.perf_counter() - t0
        watcher.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}; see {log_path}")
    summary = json.loads(out)
    return {"wall_s": round(wall, 1), "peak_rss_mb": round(box.get("peak", 0) / 2**20),
            "done": summary["num_done"], "resumed": summary["num_resumed"], "rows": summary["num_rows"]}


def breakdown(inp: str, out: str, trace: bool) -> None:
    """RSS (trace=False) or tracemalloc's top holders (trace=True: slow, and its own bookkeeping inflates RSS)
    of the scan of OUT and of a resume pass over IN, in this process."""
    import gc
    import tracemalloc

    import psutil

    from overnight.pipeline.configio import resolve
    from overnight.pipeline.input.resume import ResumeFilter
    from overnight.pipeline.input.source import ParquetSource
    from overnight.pipeline.input.stage import open_model, prepare
    from overnight.pipeline.output.checkpoint import OutputDir
    from overnight.pipeline.tally import Tally

    me = psutil.Process()

    def peak_rss() -> float:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def rss() -> float:
        return me.memory_info().rss / 2**20

    cfg = resolve({"input": {"path": inp}, "output": {"path": out}, "sampling": {"max_tokens": 4}})
    model = open_model(cfg)
    source = ParquetSource(cfg.input)
    gc.collect()
    base = rss()
    print(f"after imports, tokenizer and source: RSS {base:.0f} MB")
    if trace:
        tracemalloc.start(6)
    t0 = time.perf_counter()
    scan = OutputDir(out).scan(cfg.input.id_column)
    t_scan = time.perf_counter() - t0
    snap_scan = tracemalloc.take_snapshot() if trace else None
    traced = f", traced {tracemalloc.get_traced_memory()[0] / 2**20:.0f} MB" if trace else ""
    print(f"scan of OUT ({scan.num_done} rows, {scan.num_parts} parts): {t_scan:.1f} s, RSS +{rss() - base:.0f} MB"
          f"{traced}", flush=True)
    tally = Tally(source.num_rows)
    resume = ResumeFilter(scan, tally, out)
    t0 = time.perf_counter()
    n = 0
    for batch in prepare(cfg, source, model, None, resume, source.passthrough_columns(), tally):
        n += len(batch.rows)
    t_pass = time.perf_counter() - t0
    traced = (f", traced {tracemalloc.get_traced_memory()[0] / 2**20:.0f} MB (peak "
              f"{tracemalloc.get_traced_memory()[1] / 2**20:.0f} MB)") if trace else ""
    print(f"resume pass ({tally.num_read} read, {tally.num_resumed} resumed, {n} to do): {t_pass:.1f} s, "
          f"RSS +{rss() - base:.0f} MB{traced}; peak RSS {peak_rss():.0f} MB", flush=True)
    if not trace:
        return
    snap_pass = tracemalloc.take_snapshot()
    for title, snap in (("held after the scan", snap_scan), ("held after the resume pass", snap_pass)):
        print(f"\ntop holders {title} (tracemalloc, by line):")
        for stat in snap.statistics("lineno")[:6]:
            f = stat.traceback[0]
            print(f"  {stat.size / 2**20:8.1f} MB {stat.count:>10d} blocks  {f.filename.replace(REPO, '.')}:{f.lineno}")
    tracemalloc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--row-group", type=int, default=100_000)
    ap.add_argument("--ids", choices=("int", "str"), default="str")
    ap.add_argument("--dir", help="folder for IN and OUT (default: a temp folder, removed unless --keep)")
    ap.add_argument("--keep", action="store_true", help="keep IN and OUT")
    ap.add_argument("--reuse", action="store_true", help="reuse IN (and OUT for --rerun-only) in --dir")
    ap.add_argument("--rerun-only", action="store_true", help="only the rerun (OUT from an earlier full run)")
    ap.add_argument("--breakdown", action="store_true", help="where the memory goes, in-process (see above)")
    ap.add_argument("--trace", action="store_true", help="with --breakdown: tracemalloc's top holders (slow)")
    ap.add_argument("--flush-rows", type=int, help="default: overnight's own (1000)")
    ap.add_argument("extra", nargs="*", help="more options for overnight run (after --)")
    args = ap.parse_args()

    folder = args.dir or tempfile.mkdtemp(prefix="overnight-scale-")
    inp, out = os.path.join(folder, "in"), os.path.join(folder, "out")
    if not (args.reuse and os.path.isdir(inp)):
        shutil.rmtree(inp, ignore_errors=True)
        t0 = time.perf_counter()
        build(inp, args.rows, args.files, args.row_group, args.ids)
        print(f"built {args.rows} rows ({args.ids} ids) in {args.files} files in {time.perf_counter() - t0:.0f} s "
              f"-> {inp}", flush=True)
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    cmd = [OVERNIGHT, "run", inp, "--out", out, "--engine", "echo", "--max-tokens", "4", "--json",
           *(["--flush-rows", str(args.flush_rows)] if args.flush_rows else []), *args.extra]
    print(f"commit {commit}; command: {' '.join(cmd).replace(folder, 'DIR')}", flush=True)
    try:
        if args.breakdown:
            if not os.path.isdir(out):
                print("full run first, to fill OUT", flush=True)
                run(cmd + ["--fresh"], os.path.join(folder, "full.log"))
            breakdown(inp, out, args.trace)
            return
        results = []
        if not args.rerun_only:
            r = run(cmd + ["--fresh"], os.path.join(folder, "full.log"))
            assert r["done"] == args.rows, r
            results.append(("full run", r))
            print(f"full run: {r}", flush=True)
        r = run(cmd, os.path.join(folder, "rerun.log"))
        assert r["done"] == args.rows and r["resumed"] == args.rows, r
        results.append(("rerun, all done", r))
        print(f"rerun:    {r}", flush=True)
        print(f"\n{'rows':>10s} {'ids':>4s} {'run':>16s} {'wall s':>8s} {'peak RSS MB':>12s}")
        for name, r in results:
            print(f"{args.rows:>10d} {args.ids:>4s} {name:>16s} {r['wall_s']:>8.1f} {r['peak_rss_mb']:>12d}")
    finally:
        if not args.dir and not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
