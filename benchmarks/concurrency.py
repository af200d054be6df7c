"""Engine step cost against the number of sequences running, on one engine.

Does the engine's throughput grow with how many sequences run at once? On a
GPU a decode step of 64 sequences costs about what a step of 4 does; on a
small CPU it may not. The answer decides what ordering and concurrency can do
for a makespan or a deadline.

For each level c the script adds c real prompts (GSM8K, MT-bench, Vicuna
bench, with the chat template), times their prefill until each has its first
token, then times --decode-steps decode steps of the c sequences (the
preset's sampling with ignore_eos, so none leaves early). One engine serves
every level; the levels run in a shuffled order, --repeats times.

    python benchmarks/concurrency.py --levels 1 2 4 8 16 32 64 --decode-steps 20
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.path.join(REPO, "..", "shared", "data"))
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--decode-steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    import pyarrow.parquet as pq

    from overnight.pipeline.configio import resolve
    from overnight.pipeline.engine.vllm import _quiet_vllm, configure_cpu_env, engine_args, is_cpu_platform
    from overnight.pipeline.tools.models import load_tokenizer, resolve as resolve_model

    prompts = []
    for name, n in (("gsm8k_test", 120), ("mt_bench", 40), ("vicuna_bench", 40)):
        prompts += pq.read_table(os.path.join(args.data, f"{name}.parquet"), columns=["prompt"]).column(0)\
            .to_pylist()[:n]
    random.Random(0).shuffle(prompts)
    base = resolve({"input": {"path": "unused.parquet"}, "output": {"path": "unused"}})
    model = resolve_model(base.engine.model)
    tok = load_tokenizer(model)
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
           for p in prompts]
    ids = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in ids]

    _quiet_vllm()
    if is_cpu_platform():
        configure_cpu_env(base.engine)
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    eargs = engine_args(base.engine, model.path)
    engine = LLMEngine.from_engine_args(EngineArgs(**eargs))
    s = base.sampling
    print(f"engine: {eargs}; sampling: temperature {s.temperature}, repetition penalty {s.repetition_penalty}, "
          f"max_tokens {s.max_tokens}", flush=True)

    counter = [0]

    def measure(c: int) -> tuple[float, float, int]:
        """Seconds to prefill c fresh prompts, seconds per decode step with c sequences, prompt tokens."""
        fixed = SamplingParams(max_tokens=args.decode_steps + 8, temperature=s.temperature, ignore_eos=True,
                               repetition_penalty=s.repetition_penalty, output_kind=RequestOutputKind.DELTA)
        rids, n_prompt = [], 0
        for _ in range(c):
            rid = str(counter[0])
            p = ids[counter[0] % len(ids)]
            engine.add_request(rid, {"prompt_token_ids": p}, fixed)
            rids.append(rid)
            n_prompt += len(p)
            counter[0] += 1
        started: set[str] = set()
        t0 = time.perf_counter()
        while len(started) < c:
            for o in engine.step():
                if any(len(x.token_ids) for x in o.outputs):
                    started.add(o.request_id)
        t1 = time.perf_counter()
        for _ in range(args.decode_steps):
            engine.step()
        t2 = time.perf_counter()
        engine.abort_request(rids)
        while engine.has_unfinished_requests():
            engine.step()
        return t1 - t0, (t2 - t1) / args.decode_steps, n_prompt

    measure(max(args.levels))  # warm-up, not counted
    results: dict[int, list[tuple[float, float, int]]] = {c: [] for c in args.levels}
    for r in range(args.repeats):
        order = list(args.levels)
        random.Random(r).shuffle(order)
        for c in order:
            pre, step, n = measure(c)
            results[c].append((pre, step, n))
            print(f"  rep {r} c={c:3d}: prefill {n} prompt tokens in {pre:.2f} s, decode {step * 1000:6.1f} ms/step",
                  flush=True)
    top = max(args.levels)
    top_tps = top / statistics.median(st for _, st, _ in results[top])
    print("\nsequences | decode ms/step | decode tok/s | per sequence tok/s | tok/s vs the most | prefill ms/1k tokens")
    for c in args.levels:
        step = statistics.median(st for _, st, _ in results[c])
        pre = statistics.median(1000 * p / n for p, _, n in results[c])
        print(f"  {c:3d} | {step * 1000:6.1f} | {c / step:6.1f} | {1 / step:5.2f} | {c / step / top_tps:.2f} | "
              f"{pre * 1000:.0f}")


if __name__ == "__main__":
    main()
