"""What does a token of context cost a decode step? vLLM alone, 16 and then 64 sequences that never end.

Starts the embedded model as overnight does (its preset's engine settings), adds 16 requests of a 60-token prompt
that ignore the end of sequence, times STEPS decode steps while their context grows a token a step, aborts them,
and does the same with 64. Prints, per batch size, a line through step time against the context a sequence holds
(its slope over the sequences: the cost of a token of context a sequence) and the medians of each 100 steps; the
step cost's forms (pipeline/scheduling/step_cost.py) say what that slope should be from the model's config.

    python benchmarks/context_cost.py [--repetition-penalty 1.1] [--steps 700]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repetition-penalty", type=float, default=1.1, help="the preset's 1.1; 1.0 for none")
    ap.add_argument("--temperature", type=float, default=0.2)
    ap.add_argument("--steps", type=int, default=700)
    args = ap.parse_args()

    from vllm import SamplingParams

    from overnight.pipeline.config import EngineConfig
    from overnight.pipeline.engine.vllm import VllmEngine
    from overnight.pipeline.tools.models import resolve

    engine = VllmEngine.from_config(EngineConfig(max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=2048),
                                    resolve("smollm2-135m").path)
    rho, on = engine.context_term
    print(f"the step cost's context term: rho {rho:.3g} on the {on} part (VllmEngine.context_term)")
    llm = engine.engine
    sampling = SamplingParams(max_tokens=2048 - 61, ignore_eos=True, temperature=args.temperature,
                              repetition_penalty=args.repetition_penalty)
    prompt = {"prompt_token_ids": list(range(100, 160))}
    for n in (16, 64):
        ids = [f"n{n}-{i}" for i in range(n)]
        for r in ids:
            llm.add_request(r, prompt, sampling)
        for _ in range(5):  # the prefill and the first decode steps
            llm.step()
        seconds = []
        for _ in range(args.steps):
            t = time.perf_counter()
            llm.step()
            seconds.append(time.perf_counter() - t)
        llm.abort_request(ids)
        llm.step()
        ts = np.array(seconds)
        context = 65 + np.arange(args.steps)  # a sequence's, prompt and tokens so far
        fixed, slope = np.linalg.lstsq(np.vstack([np.ones(len(ts)), context]).T, ts, rcond=None)[0]
        medians = " ".join(f"{1000 * float(np.median(ts[i:i + 100])):.0f}" for i in range(0, len(ts), 100))
        print(f"{n} sequences: {1000 * fixed:.1f} ms + {1e6 * slope:.2f} us per token of context each holds, "
              f"{1e6 * slope / n:.3f} us a sequence; medians of each 100 steps: {medians} ms")


if __name__ == "__main__":
    main()
