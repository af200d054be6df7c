"""Labelled length data for the predictor benchmark: real prompts, the real engine, two samplings each.

Prompts from ../shared/data: the first --gsm8k GSM8K problems (short, uniform
answers), all 80 MT-bench first turns and 80 Vicuna bench questions (the
open-ended instructions), and MT-bench's second turns as three-message chats
(first turn, the model's own first answer from sampling 1, follow-up). Each
set runs --samplings times through `overnight run` with the embedded model and
its preset (temperature 0.2, repetition penalty 1.1, max_tokens 512), the
default policy and the online predictor, one engine for every run.

The result is one small Parquet file (benchmarks/data/lengths.parquet): per
row its id, source, category, prompt (or chat, as JSON), prompt tokens after
the chat template, and per sampling k the output tokens (out_k), whether it
stopped at max_tokens (capped_k), the run's own stored prediction (stored_k)
and when it finished (finished_k). The file's metadata records the commit,
the sampling settings and each run's wall time and engine-seconds.

    nice -n 10 python benchmarks/length_prediction_data.py --out benchmarks/data/lengths.parquet
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def prompts(data_dir: str, n_gsm: int, limit=None):
    import pyarrow.parquet as pq

    rows = []
    for name, source, n in (("gsm8k_test", "gsm8k", n_gsm), ("mt_bench", "mt_bench", None),
                            ("vicuna_bench", "vicuna", None)):
        t = pq.read_table(os.path.join(data_dir, f"{name}.parquet")).to_pylist()
        for r in t[:n][:limit]:
            rows.append({"id": r["id"], "source": source, "category": r.get("category") or "math",
                         "prompt": r["prompt"], "followup": r.get("followup")})
    return rows


def run_set(root: str, name: str, rows: list[dict], sampling: int, engine):
    """One `overnight run` over rows (prompt or messages); returns {id: result row} and the run's figures."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from overnight.pipeline.api import run_job
    from overnight.pipeline.configio import resolve
    from overnight.pipeline.tools.inspection import open_results

    inp = os.path.join(root, f"{name}.parquet")
    cols = {"id": [r["id"] for r in rows]}
    if any(r.get("messages") for r in rows):
        cols["messages"] = [r["messages"] for r in rows]
    else:
        cols["prompt"] = [r["prompt"] for r in rows]
    if not os.path.exists(inp):
        pq.write_table(pa.table(cols), inp)
    out = os.path.join(root, f"{name}-s{sampling}")
    cfg = resolve({"input": {"path": inp}, "output": {"path": out, "flush_rows": 64}})
    t0 = time.perf_counter()
    # Not fresh: with --work, a run that was stopped resumes and a finished one is kept.
    run_job(cfg, engine_factory=lambda job: engine, is_tty=False)
    wall = time.perf_counter() - t0
    con, _ = open_results(out)
    got = {r[0]: r for r in con.execute(
        "select id, prompt_tokens, output_tokens, finish_reason, predicted_tokens, epoch(finished_at), text, "
        "engine_seconds from results where status = 'ok'").fetchall()}
    engine_s = sum(r[7] or 0.0 for r in got.values())
    figures = {"set": name, "sampling": sampling, "rows": len(got), "output_tokens": sum(r[2] for r in got.values()),
               "engine_seconds": round(engine_s, 1)}
    print(f"  {name} sampling {sampling}: {len(got)} rows, {figures['output_tokens']} output tokens, "
          f"{engine_s:.0f} engine-seconds ({wall:.0f} s now)", flush=True)
    return got, figures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.path.join(REPO, "..", "shared", "data"))
    ap.add_argument("--gsm8k", type=int, default=240)
    ap.add_argument("--samplings", type=int, default=2)
    ap.add_argument("--limit", type=int, default=None, help="at most this many prompts per set (a smoke test)")
    ap.add_argument("--no-turn2", action="store_true", help="leave out MT-bench's second turns")
    ap.add_argument("--work", default=None, help="folder for the runs (default: a temporary one)")
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "data", "lengths.parquet"))
    args = ap.parse_args()

    import pyarrow as pa
    import pyarrow.parquet as pq

    from overnight.pipeline.configio import resolve
    from overnight.pipeline.engine.vllm import VllmEngine, _quiet_vllm, configure_cpu_env, engine_args, is_cpu_platform
    from overnight.pipeline.tools.models import resolve as resolve_model

    root = args.work or tempfile.mkdtemp(prefix="overnight-lengths-")
    os.makedirs(root, exist_ok=True)
    base = resolve({"input": {"path": "x.parquet"}, "output": {"path": root}})
    model = resolve_model(base.engine.model)
    _quiet_vllm()
    if is_cpu_platform():
        configure_cpu_env(base.engine)
    from vllm import LLM

    llm = LLM(**engine_args(base.engine, model.path, scheduling_policy="priority"))
    engine = VllmEngine(llm.llm_engine)

    first = prompts(args.data, args.gsm8k, args.limit)
    table = {r["id"]: {k: r[k] for k in ("id", "source", "category", "prompt")} | {"messages": None}
             for r in first}
    runs = []
    print(f"{len(first)} first-turn prompts, {args.samplings} samplings; runs in {root}", flush=True)
    for k in range(1, args.samplings + 1):
        got, fig = run_set(root, "first", first, k, engine)
        runs.append(fig)
        for i, r in got.items():
            table[i].update({"prompt_tokens": r[1], f"out_{k}": r[2], f"capped_{k}": r[3] == "length",
                             f"stored_{k}": r[4], f"finished_{k}": r[5]})
            if k == 1:
                table[i]["_answer"] = r[6]
    if not args.no_turn2:
        second = []
        for r in first:
            if r["followup"] and table[r["id"]].get("_answer") is not None:
                chat = [{"role": "user", "content": r["prompt"]},
                        {"role": "assistant", "content": table[r["id"]]["_answer"]},
                        {"role": "user", "content": r["followup"]}]
                second.append({"id": f"{r['id']}-turn2", "messages": chat})
                table[f"{r['id']}-turn2"] = {"id": f"{r['id']}-turn2", "source": "mt_bench_turn2",
                                             "category": r["category"], "prompt": r["followup"],
                                             "messages": json.dumps(chat)}
        print(f"{len(second)} second-turn chats", flush=True)
        for k in range(1, args.samplings + 1):
            got, fig = run_set(root, "turn2", second, k, engine)
            runs.append(fig)
            for i, r in got.items():
                table[i].update({"prompt_tokens": r[1], f"out_{k}": r[2], f"capped_{k}": r[3] == "length",
                                 f"stored_{k}": r[4], f"finished_{k}": r[5]})
    rows = [{k: v for k, v in r.items() if not k.startswith("_")} for r in table.values() if "out_1" in r]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    meta = {"commit": commit, "model": base.engine.model, "sampling": {
        "max_tokens": base.sampling.max_tokens, "temperature": base.sampling.temperature,
        "repetition_penalty": base.sampling.repetition_penalty}, "samplings": args.samplings, "runs": runs}
    t = pa.Table.from_pylist(rows)
    t = t.replace_schema_metadata({"overnight_lengths": json.dumps(meta)})
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    pq.write_table(t, args.out, compression="zstd")
    print(f"{len(rows)} rows -> {args.out}")


if __name__ == "__main__":
    main()
