"""Which sampling settings suit SmolLM2-135M-Instruct? Side by side in one engine.

For each setting, runs the same open-ended prompts (MT-bench + Vicuna bench)
through one vLLM engine and reports how often generation ran into max_tokens
(the model looping), the mean output length and the output tokens/s.

    python benchmarks/sampling_preset.py --n 80 --max-tokens 512
"""

from __future__ import annotations

import argparse
import time

SETTINGS = {
    "greedy": dict(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0),
    "t0.2 top_p0.9 (model card)": dict(temperature=0.2, top_p=0.9, top_k=-1, repetition_penalty=1.0),
    "greedy rep1.1": dict(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.1),
    "t0.2 rep1.1": dict(temperature=0.2, top_p=1.0, top_k=-1, repetition_penalty=1.1),
    "t0.2 top_k50 rep1.05": dict(temperature=0.2, top_p=1.0, top_k=50, repetition_penalty=1.05),
}


def load_prompts(data_dir: str, n: int) -> list[str]:
    import pyarrow.parquet as pq

    half = n // 2
    mt = pq.read_table(f"{data_dir}/mt_bench.parquet").column("prompt").to_pylist()[:half]
    vi = pq.read_table(f"{data_dir}/vicuna_bench.parquet").column("prompt").to_pylist()[: n - half]
    return mt + vi


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--n", type=int, default=80)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from overnight.pipeline.config import EngineConfig
    from overnight.pipeline.engine.vllm import VllmEngine
    from overnight.pipeline.tools.models import load_tokenizer, resolve

    model = resolve("smollm2-135m")
    tok = load_tokenizer(model)
    engine = VllmEngine.from_config(EngineConfig(max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=2048),
                                    model.path)
    prompts = load_prompts(args.data, args.n)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]
    ids = tok(texts, add_special_tokens=False)["input_ids"]

    print(f"{len(prompts)} open-ended prompts, max_tokens={args.max_tokens}, seed={args.seed}")
    print(f"{'setting':30s} {'hit max_tokens':>15s} {'mean out tok':>13s} {'tok/s':>7s}")
    for name, s in SETTINGS.items():
        sampling = dict(s, max_tokens=args.max_tokens, seed=args.seed, stop=[])
        t0 = time.perf_counter()
        for i, p in enumerate(ids):
            engine.add(f"{name}-{i}", p, sampling)
        outs = []
        while engine.has_unfinished():
            outs.extend(engine.step())
        dt = time.perf_counter() - t0
        n_len = sum(1 for o in outs if o.finish_reason == "length")
        tokens = sum(o.num_output_tokens for o in outs)
        print(f"{name:30s} {n_len:>4d}/{len(outs)} ({100 * n_len / len(outs):3.0f}%) {tokens / len(outs):>13.0f} "
              f"{tokens / dt:>7.0f}", flush=True)


if __name__ == "__main__":
    main()
