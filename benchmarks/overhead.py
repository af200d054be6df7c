"""Overhead: `overnight` against plain `vllm.LLM.generate`, same prompts, same engine, one process.

Both sides drive the very same LLMEngine (``vllm.LLM(...).llm_engine``), so
the engine settings are identical by construction. Every request carries the
same seed, so both sides generate the same tokens. The order alternates
between repetitions so that warm-up and drift show up as noise, not bias.
overnight's time includes reading Parquet, tokenizing, scheduling and writing
checkpointed parts; LLM.generate's includes its own tokenization.

    python benchmarks/overhead.py --n 200 --max-tokens 256 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--input", default=os.path.join(REPO, "examples", "prompts.parquet"))
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    import pyarrow.parquet as pq

    from overnight.pipeline.api import run_job
    from overnight.pipeline.configio import resolve
    from overnight.pipeline.engine.vllm import VllmEngine, _quiet_vllm, configure_cpu_env, engine_args, is_cpu_platform
    from overnight.pipeline.tools.models import load_tokenizer, resolve as resolve_model

    out_root = tempfile.mkdtemp(prefix="overnight-bench-")
    # fifo: the same order as LLM.generate, so the comparison is of overhead alone.
    cfg = resolve({"input": {"path": args.input, "limit": args.n},
                   "output": {"path": os.path.join(out_root, "out")},
                   "sampling": {"max_tokens": args.max_tokens, "seed": args.seed},
                   "scheduler": {"policy": "fifo"}})
    model = resolve_model(cfg.engine.model)
    _quiet_vllm()
    if is_cpu_platform():
        configure_cpu_env(cfg.engine)
    from vllm import LLM, SamplingParams

    eargs = engine_args(cfg.engine, model.path)
    llm = LLM(**eargs)
    engine = VllmEngine(llm.llm_engine)
    tok = load_tokenizer(model)
    prompts = pq.read_table(args.input, columns=["prompt"]).column("prompt").to_pylist()[: args.n]
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]
    s = cfg.sampling
    params = SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                            repetition_penalty=s.repetition_penalty, seed=s.seed)

    def raw() -> tuple[float, int]:
        t0 = time.perf_counter()
        outs = llm.generate(texts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        return dt, sum(len(o.outputs[0].token_ids) for o in outs)

    def ours() -> tuple[float, int]:
        t0 = time.perf_counter()
        summary = run_job(cfg, fresh=True, engine_factory=lambda job: engine, is_tty=False)
        dt = time.perf_counter() - t0
        assert summary.num_ok == args.n, summary
        return dt, summary.num_output_tokens

    print(f"engine: {eargs}")
    print(f"{args.n} prompts from {os.path.relpath(args.input, REPO)}, max_tokens={s.max_tokens}, "
          f"temperature={s.temperature}, top_p={s.top_p}, top_k={s.top_k}, seed={s.seed}")
    print(f"{'rep':>3s} {'LLM.generate tok/s':>19s} {'overnight tok/s':>16s} {'ratio':>6s} {'tokens (raw/ours)':>18s}")
    ratios = []
    for rep in range(args.repeats):
        order = (raw, ours) if rep % 2 == 0 else (ours, raw)
        res = {f.__name__: f() for f in order}
        (rt, rtok), (ot, otok) = res["raw"], res["ours"]
        ratio = (otok / ot) / (rtok / rt)
        ratios.append(ratio)
        print(f"{rep:>3d} {rtok / rt:>19.1f} {otok / ot:>16.1f} {ratio:>6.3f} {rtok:>9d}/{otok:<8d}", flush=True)
    print(f"median ratio (overnight / LLM.generate, output tokens/s): {statistics.median(ratios):.3f}  "
          f"min {min(ratios):.3f}  max {max(ratios):.3f}")


if __name__ == "__main__":
    main()
