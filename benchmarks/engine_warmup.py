"""Does a fresh engine run its first steps slower? The forecast's step-cost probe needs to know.

The deadline forecast splits a step's cost into a fixed and a per-sequence part
from its probe: the first rows of a run go in at a quarter, then half of the
engine's sequences. Those steps come right after the engine starts. This
script times the same decode steps (--seqs sequences, one prompt with the chat
template, the preset's sampling, min_tokens = max_tokens so none ends early)
on two fresh engines, one after the other in this process:

1. rows added as soon as the engine is ready, as `overnight run` does;
2. the engine left idle for --idle seconds first.

It prints each side's median step over the first --window seconds and after,
and their ratio.

    python benchmarks/engine_warmup.py --seqs 16 --steps 150 --window 3 --idle 8
"""

from __future__ import annotations

import argparse
import statistics
import time


def timed_steps(engine, ids: list[int], seqs: int, steps: int, tag: str) -> list[tuple[float, float]]:
    """(seconds since the first step began, step seconds) of each decode step."""
    sampling = dict(max_tokens=steps, min_tokens=steps, temperature=0.2, top_p=1.0, top_k=-1,
                    repetition_penalty=1.1, seed=None, stop=[])
    for i in range(seqs):
        engine.add(f"{tag}-{i}", ids, sampling)
    out, t0 = [], time.perf_counter()
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        out.append((t - t0, time.perf_counter() - t))
    return out[2:]  # the first steps prefill


def medians(steps: list[tuple[float, float]], window: float) -> tuple[float, float]:
    early = [s for t, s in steps if t < window]
    late = [s for t, s in steps if t >= window]
    return statistics.median(early), statistics.median(late)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--window", type=float, default=3.0, help="Seconds counted as the engine's first.")
    ap.add_argument("--idle", type=float, default=8.0, help="Seconds the second engine idles before its rows.")
    args = ap.parse_args()

    from overnight.pipeline.config import EngineConfig
    from overnight.pipeline.engine.vllm import get_engine, shutdown_engines
    from overnight.pipeline.tools.models import load_tokenizer, resolve

    model = resolve("smollm2-135m")
    tok = load_tokenizer(model)
    text = tok.apply_chat_template([{"role": "user", "content": "Write a long story about a dragon and a knight."}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    cfg = EngineConfig(max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=2048)

    results = {}
    for side, idle in (("rows at once", 0.0), (f"idle {args.idle:.0f} s first", args.idle)):
        shutdown_engines()
        engine = get_engine(cfg, model.path)
        time.sleep(idle)
        steps = timed_steps(engine, ids, args.seqs, args.steps, side)
        results[side] = medians(steps, args.window)
        early, late = results[side]
        print(f"{side:18s}: {args.seqs} sequences, median step over the first {args.window:.0f} s "
              f"{early * 1000:.1f} ms, after {late * 1000:.1f} ms, ratio {early / late:.2f}", flush=True)
    shutdown_engines(timeout=1.0)
    (a_early, a_late), (b_early, _) = results.values()
    print(f"the first {args.window:.0f} s, rows at once against idle first: {a_early / b_early:.2f}x")


if __name__ == "__main__":
    main()
