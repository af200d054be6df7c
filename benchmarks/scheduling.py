"""Makespan, deadline goodput and prediction quality on the real mixed workload, in one run.

Workload: GSM8K + MT-bench + Vicuna bench prompts from ../shared/data, shuffled
with a fixed seed and split in two halves, A and B. Real EOS, the preset's
sampling (max_tokens 512). One engine serves every side, so engine settings
are identical by construction; its start-up is outside every timing.

1. Half A runs once (FIFO); its outputs train the predictor (`overnight
   predictor train`), which never sees half B.
2. Makespan on B: plain `LLM.generate` in input order against overnight
   longest-first with the trained predictor, and with the online predictor.
3. Deadline goodput on B: a time budget of 30% of the LLM.generate makespan;
   rows completed by the deadline, overnight auto against overnight fifo.
4. Prediction on B: Kendall's tau of heuristic, online (replayed in finish
   order) and trained predictors against B's actual lengths.

Each comparison repeats --repeats times, alternating which side runs first.

    python benchmarks/scheduling.py --gsm8k 240 --mt 80 --vicuna 80 --repeats 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def workload(data_dir: str, n_gsm: int, n_mt: int, n_vic: int, seed: int):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    parts = []
    for name, n in (("gsm8k_test", n_gsm), ("mt_bench", n_mt), ("vicuna_bench", n_vic)):
        t = pq.read_table(os.path.join(data_dir, f"{name}.parquet"), columns=["id", "prompt"])
        parts.append(t.slice(0, n))
    table = pa.concat_tables(parts)
    rng = np.random.default_rng(seed)
    table = table.take(rng.permutation(table.num_rows))
    half = table.num_rows // 2
    return table.slice(0, half), table.slice(half)


def copied(table, copies: int):
    """Each half `copies` times over (ids suffixed), shuffled again: enough rows to queue far past a GPU's
    max_num_seqs. A half's copies stay in that half, so the predictor never sees half B's prompts."""
    import numpy as np
    import pyarrow as pa

    if copies <= 1:
        return table
    parts = [table.set_column(0, "id", pa.array([f"{i}#{c}" for i in table.column("id").to_pylist()]))
             for c in range(copies)]
    out = pa.concat_tables(parts)
    return out.take(np.random.default_rng(copies).permutation(out.num_rows))


def deadline_goodput(args, ours, job, pb_path: str, budget: float, trained_path: str):
    print(f"\ndeadline goodput on half B: time budget {budget:.1f} s ({args.deadline_share:.0%} of the "
          f"LLM.generate makespan); rows completed by the deadline:")
    done: dict[str, list[int]] = {"auto": [], "fifo": []}
    for r in range(args.repeats if args.deadline_repeats is None else args.deadline_repeats):
        for pol in (["auto", "fifo"] if r % 2 == 0 else ["fifo", "auto"]):
            extra = {"predictor": trained_path} if pol == "auto" else {}
            _, summ = ours(job(pb_path, f"b-deadline-{pol}", scheduler={"policy": pol, "time_budget": f"{budget}s",
                                                                        "on_deadline": "abort"}, buckets=extra))
            done[pol].append(summ.num_done)
            caps = sorted({s["cap"] for s in _timeline(os.path.join(args.root, f"b-deadline-{pol}"))
                           if s.get("cap") is not None})  # the forecasts' (none before the first)
            print(f"  rep {r} {pol:5s}: {summ.num_done:4d} rows ({summ.state}, exit {summ.exit_code}); "
                  f"caps in its timeline: {caps}", flush=True)
    ratios = [x / max(1, y) for x, y in zip(done["auto"], done["fifo"])]
    print(f"  auto / fifo: {', '.join(f'{x:.2f}x' for x in ratios)} (median {statistics.median(ratios):.2f}x)")
    return done, budget


def _timeline(out: str) -> list:
    try:
        with open(os.path.join(out, "timeline.json")) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return []
    return data if isinstance(data, list) else data.get("samples", [])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.path.join(REPO, "..", "shared", "data"))
    ap.add_argument("--gsm8k", type=int, default=240)
    ap.add_argument("--mt", type=int, default=80)
    ap.add_argument("--vicuna", type=int, default=80)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--deadline-share", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--copies", type=int, default=1,
                    help="Each half this many times over (a GPU's engine holds the default 200 rows at once).")
    ap.add_argument("--deadline-repeats", type=int, default=None, help="Deadline pairs (default: --repeats).")
    ap.add_argument("--out", default=None, help="Folder for the runs' outputs (default: a temporary one).")
    ap.add_argument("--deadline-only", nargs=2, metavar=("BUDGET_S", "PREDICTOR"), default=None,
                    help="Run only the deadline comparison, with this time budget and the predictor file an "
                         "earlier full run trained (its budget and lengths.pt), to compare a change of policy.")
    args = ap.parse_args()

    import pyarrow.parquet as pq

    from overnight.buckets.dataset import load_outputs
    from overnight.buckets.evaluate import evaluate
    from overnight.buckets.trained import TrainedPredictor
    from overnight.pipeline.api import run_job
    from overnight.pipeline.configio import resolve
    from overnight.pipeline.engine.vllm import VllmEngine, _quiet_vllm, configure_cpu_env, engine_args, is_cpu_platform
    from overnight.pipeline.tools.models import load_tokenizer, resolve as resolve_model

    root = args.out or tempfile.mkdtemp(prefix="overnight-sched-")
    os.makedirs(root, exist_ok=True)
    a, b = workload(args.data, args.gsm8k, args.mt, args.vicuna, args.seed)
    a, b = copied(a, args.copies), copied(b, args.copies)
    args.root = root
    pa_path, pb_path = os.path.join(root, "a.parquet"), os.path.join(root, "b.parquet")
    pq.write_table(a, pa_path)
    pq.write_table(b, pb_path)

    base = resolve({"input": {"path": pb_path}, "output": {"path": root}})
    model = resolve_model(base.engine.model)
    _quiet_vllm()
    if is_cpu_platform():
        configure_cpu_env(base.engine)
    from vllm import LLM, SamplingParams

    eargs = engine_args(base.engine, model.path, scheduling_policy="priority")
    llm = LLM(**eargs)
    engine = VllmEngine(llm.llm_engine)
    tok = load_tokenizer(model)
    s = base.sampling
    params = SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                            repetition_penalty=s.repetition_penalty)
    print(f"engine: {eargs}")
    print(f"workload: {args.gsm8k} GSM8K + {args.mt} MT-bench + {args.vicuna} Vicuna, shuffled (seed {args.seed}); "
          f"half A {a.num_rows} rows trains, half B {b.num_rows} rows is measured; sampling: {dataclasses.asdict(s)}")
    sys.stdout.flush()

    def job(inp: str, name: str, **sched):
        layer = {"input": {"path": inp}, "output": {"path": os.path.join(root, name), "flush_rows": 64},
                 "scheduler": dict(sched.pop("scheduler", {})), "buckets": dict(sched.pop("buckets", {}))}
        return resolve(layer)

    def ours(cfg):
        t0 = time.perf_counter()
        summary = run_job(cfg, fresh=True, engine_factory=lambda job: engine, is_tty=False)
        return time.perf_counter() - t0, summary

    if args.deadline_only:
        deadline_goodput(args, ours, job, pb_path, float(args.deadline_only[0]), args.deadline_only[1])
        return

    # 1. train on half A
    t_a, sa = ours(job(pa_path, "a-fifo", scheduler={"policy": "fifo"}))
    data_a = load_outputs([os.path.join(root, "a-fifo")])
    trained_path = os.path.join(root, "lengths.pt")
    tp, rep = TrainedPredictor.fit(data_a.features, data_a.actual, data_a.hit_cap, epochs=60, seed=0)
    tp.save(trained_path)
    print(f"\nhalf A: {sa.num_ok} rows, {sa.num_output_tokens} output tokens in {t_a:.0f} s; predictor trained "
          f"on it in {rep.seconds:.1f} s (train tau {rep.train_tau:.3f})")

    # 2. makespan on half B
    prompts = b.column("prompt").to_pylist()
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]

    def raw():
        t0 = time.perf_counter()
        outs = llm.generate(texts, params, use_tqdm=False)
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

    sides = {
        "LLM.generate (input order)": lambda: raw(),
        "overnight longest-first, trained": lambda: (lambda r: (r[0], r[1].num_output_tokens))(
            ours(job(pb_path, "b-lf-trained", scheduler={"policy": "longest-first"},
                     buckets={"predictor": trained_path}))),
        "overnight longest-first, online": lambda: (lambda r: (r[0], r[1].num_output_tokens))(
            ours(job(pb_path, "b-lf-online", scheduler={"policy": "longest-first"}, buckets={"predictor": "online"}))),
    }
    names = list(sides)
    times: dict[str, list[float]] = {n: [] for n in names}
    print("\nmakespan on half B (seconds, output tokens):")
    for r in range(args.repeats):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            dt_s, tokens = sides[n]()
            times[n].append(dt_s)
            print(f"  rep {r} {n:34s} {dt_s:7.1f} s {tokens:7d} tokens", flush=True)
    raw_med = statistics.median(times[names[0]])
    for n in names[1:]:
        med = statistics.median(times[n])
        print(f"  {n}: median {med:.1f} s vs {raw_med:.1f} s -> {100 * (1 - med / raw_med):+.1f}% faster "
              f"(per rep: {', '.join(f'{100 * (1 - x / y):+.1f}%' for x, y in zip(times[n], times[names[0]]))})")

    # 3. deadline goodput on half B
    done, budget = deadline_goodput(args, ours, job, pb_path, args.deadline_share * raw_med, trained_path)

    # 4. prediction on half B (actual lengths from the trained longest-first run)
    data_b = load_outputs([os.path.join(root, "b-lf-trained")])
    print(f"\nprediction on half B ({len(data_b)} rows, never seen in training): Kendall's tau")
    results = {}
    for spec in ("heuristic", "online", trained_path):
        e = evaluate(data_b, spec)
        results[e.predictor] = dataclasses.asdict(e)
        print(f"  {e.predictor:40s} tau {e.kendall_tau:6.3f}  MAE {e.mae:6.1f}  bucket hit {e.bucket_hit_rate:5.1%}")
    with open(os.path.join(root, "results.json"), "w") as f:
        json.dump({"makespan_s": times, "deadline_rows": done, "budget_s": budget, "prediction": results}, f,
                  indent=2)
    print(f"\nraw results: {os.path.join(root, 'results.json')}")


if __name__ == "__main__":
    main()
