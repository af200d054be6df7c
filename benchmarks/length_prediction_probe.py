"""The hidden-state probe: the served model's own representation of each prompt, and a ridge probe on it.

TRAIL and EGTP (ICLR 2026) predict output length from the serving model's
hidden states of the prompt. Here: the embedded SmolLM2-135M-Instruct reads
each prompt of benchmarks/data/lengths.parquet after the chat template, exactly
as the job renders it, and the hidden states are mean-pooled over the
prompt's tokens at a few layers (and the last token's at the last layer).
A ridge regression on log length (penalty by leave-one-out on the training
rows, calibrated as the trained predictor is) is the probe;
benchmarks/length_prediction.py scores it beside the others (--probe).

    python benchmarks/length_prediction_probe.py embed   # transformers, all layers; cached under ~/.cache/overnight
    python benchmarks/length_prediction_probe.py cost    # what vLLM's pooling runner costs per row on this machine

`cost` runs the same weights as a vLLM pooling model (runner="pooling",
mean pooling), over the data's prompts, whole and cut to its first layers
(hf_overrides num_hidden_layers), and prints the seconds per row against the
engine-seconds a row took in the data's generation runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "benchmarks", "data", "lengths.parquet")
CACHE = os.path.join(os.environ.get("OVERNIGHT_CACHE", os.path.expanduser("~/.cache/overnight")), "bench")
# Mean-pooled layers (of 30) and the last token's state at the last layer.
LAYERS = (5, 10, 15, 20, 30)


def _chats(path: str):
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    chats = [json.loads(r["messages"]) if r["messages"] else [{"role": "user", "content": r["prompt"]}] for r in rows]
    return [r["id"] for r in rows], chats


def _cache_path(path: str) -> str:
    digest = hashlib.blake2b(open(path, "rb").read(), digest_size=8).hexdigest()
    return os.path.join(CACHE, f"probe-{digest}.npz")


def embed(path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from overnight.pipeline.tools.models import resolve as resolve_model

    model_dir = resolve_model("smollm2-135m").path
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    ids, chats = _chats(path)
    feats, t0 = [], time.perf_counter()
    with torch.no_grad():
        for chat in chats:
            text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            enc = tok(text, return_tensors="pt", add_special_tokens=False)
            hs = model(**enc, output_hidden_states=True).hidden_states  # [layers + 1] x [1, T, 576]
            parts = [hs[i][0].mean(dim=0) for i in LAYERS] + [hs[LAYERS[-1]][0, -1]]
            feats.append(torch.cat(parts).numpy().astype(np.float32))
    seconds = (time.perf_counter() - t0) / len(ids)
    os.makedirs(CACHE, exist_ok=True)
    out = _cache_path(path)
    np.savez_compressed(out, ids=np.array(ids), x=np.stack(feats), seconds_per_row=np.array(seconds),
                        layers=np.array(LAYERS))
    print(f"{len(ids)} prompts embedded with transformers in {seconds * 1e3:.0f} ms a row -> {out}")


class Probe:
    """Ridge on log length over one block of the pooled hidden states, for benchmarks/length_prediction.py."""

    def __init__(self, x: np.ndarray, seconds_per_row: float, caps: np.ndarray):
        self.x = x
        self.seconds_per_row = seconds_per_row
        self.caps = caps

    @classmethod
    def load_cached(cls, ids, path: str = DATA, block: str = "mean10", cost_file: str | None = None) -> "Probe":
        """block: mean<layer> (mean-pooled at that layer) or last (the last token's state at the last layer)."""
        cache = _cache_path(path)
        if not os.path.exists(cache):
            sys.exit(f"no cached hidden states for {path}: run `python benchmarks/length_prediction_probe.py "
                     f"embed` first")
        z = np.load(cache)
        where = {i: k for k, i in enumerate(z["ids"].tolist())}
        layers = z["layers"].tolist()
        d = z["x"].shape[1] // (len(layers) + 1)
        k = len(layers) if block == "last" else layers.index(int(block[4:]))
        x = z["x"][[where[i] for i in ids], k * d:(k + 1) * d].astype(np.float64)
        seconds = float(z["seconds_per_row"])
        vllm_cost = os.path.join(CACHE, "probe-cost.json")
        if os.path.exists(vllm_cost):  # the vLLM pooling runner's measured cost, when `cost` ran
            seconds = json.load(open(vllm_cost))["seconds_per_row_cut"]
        return cls(x, seconds, np.full(len(ids), 512))

    def fit_predict(self, tr: np.ndarray, y_tr: np.ndarray, te: np.ndarray) -> np.ndarray:
        from overnight.buckets.trained import calibrate

        x_tr, x_te = self.x[tr], self.x[te]
        mu, sd = x_tr.mean(axis=0), x_tr.std(axis=0) + 1e-6
        a_tr, a_te = (x_tr - mu) / sd, (x_te - mu) / sd
        y = np.log(np.maximum(y_tr, 1.0))
        ym = y.mean()
        # Dual ridge with leave-one-out residuals from the eigendecomposition of the Gram matrix.
        s, u = np.linalg.eigh(a_tr @ a_tr.T)
        s = np.maximum(s, 0.0)
        uy = u.T @ (y - ym)
        best = None
        for lam in np.geomspace(1e1, 1e6, 16):
            h = (u * (s / (s + lam))) @ u.T
            fit = h @ (y - ym)
            loo = (y - ym - fit) / np.maximum(1 - np.diag(h) - 1.0 / len(y), 1e-6)
            err = float(np.mean(loo ** 2))
            if best is None or err < best[0]:
                best = (err, lam, y - loo)
        _, lam, oof = best
        alpha = u @ (uy / (s + lam))
        calib = calibrate(oof, y_tr, self.caps[tr])
        score = ym + (a_te @ a_tr.T) @ alpha
        a, b, c = calib
        return np.clip(c * np.exp(a + b * score), 1.0, self.caps[te])


def cost(path: str, n: int, layers_cut: int) -> None:
    """Seconds per row of vLLM's pooling runner over the data's prompts, whole model and cut."""
    from overnight.pipeline.configio import resolve
    from overnight.pipeline.engine.vllm import _quiet_vllm, configure_cpu_env, engine_args, is_cpu_platform
    from overnight.pipeline.tools.models import resolve as resolve_model

    import pyarrow.parquet as pq

    meta = json.loads(pq.read_table(path).schema.metadata[b"overnight_lengths"])
    runs = meta["runs"]
    job_s = sum(r["engine_seconds"] for r in runs) / sum(r["rows"] for r in runs)
    base = resolve({"input": {"path": "x.parquet"}, "output": {"path": "/tmp"}})
    model_dir = resolve_model(base.engine.model).path
    _quiet_vllm()
    if is_cpu_platform():
        configure_cpu_env(base.engine)
    from vllm import LLM
    from vllm.config import PoolerConfig
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    _, chats = _chats(path)
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats][:n]
    num_tokens = sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts)
    result = {"rows": len(texts), "prompt_tokens": num_tokens, "job_seconds_per_row": job_s}
    for name, overrides in (("whole", None), ("cut", {"num_hidden_layers": layers_cut})):
        kw = engine_args(base.engine, model_dir)
        kw.update(runner="pooling", pooler_config=PoolerConfig(pooling_type="MEAN"))
        for key in ("scheduling_policy", "enable_chunked_prefill"):
            kw.pop(key, None)
        if overrides:
            kw["hf_overrides"] = overrides
        llm = LLM(**kw)
        llm.embed(texts[:8], use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.embed(texts, use_tqdm=False)
        dt = time.perf_counter() - t0
        result[f"seconds_per_row_{name}"] = dt / len(texts)
        result[f"dim_{name}"] = len(outs[0].outputs.embedding)
        print(f"vLLM pooling, {name} model{'' if not overrides else f' ({layers_cut} layers)'}: {len(texts)} rows, "
              f"{num_tokens} prompt tokens in {dt:.1f} s: {dt / len(texts) * 1e3:.1f} ms a row, "
              f"{num_tokens / dt:.0f} prompt tokens/s; {dt / len(texts) / job_s:.1%} of the job's "
              f"{job_s:.2f} engine-seconds a row", flush=True)
        del llm
        import gc

        gc.collect()
    os.makedirs(CACHE, exist_ok=True)
    with open(os.path.join(CACHE, "probe-cost.json"), "w") as f:
        json.dump(result, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["embed", "cost"])
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--rows", type=int, default=200, help="cost: rows to embed")
    ap.add_argument("--layers", type=int, default=10, help="cost: layers of the cut model")
    args = ap.parse_args()
    if args.what == "embed":
        embed(args.data)
    else:
        cost(args.data, args.rows, args.layers)


if __name__ == "__main__":
    main()
