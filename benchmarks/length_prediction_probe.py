"""The hidden-state probe: the served model's own representation of each prompt, and a ridge probe on it.

TRAIL and EGTP (ICLR 2026) predict output length from the serving model's
hidden states of the prompt. Here: the embedded SmolLM2-135M-Instruct reads
each prompt of benchmarks/data/lengths.parquet after the chat template, exactly
as the job renders it, and the hidden states are mean-pooled over the
prompt's tokens at a few layers, or the last token's state is taken (blocks
mean<k> and last<k>: after k of the 30 layers; mean0 pools the token
embeddings, which need no layer run).
A ridge regression on log length (penalty by leave-one-out on the training
rows, calibrated as the trained predictor is) is the probe;
benchmarks/length_prediction.py scores it beside the others (--probe).

    python benchmarks/length_prediction_probe.py embed   # transformers, all layers; cached under ~/.cache/overnight
    python benchmarks/length_prediction_probe.py layers  # transformers cut to its first 1, 2, 4 layers: cost a row,
                                                         # and their states as blocks cut1, cut2, cut4
    python benchmarks/length_prediction_probe.py cost    # vLLM's pooling runner: cost per row, and its features
    python benchmarks/length_prediction_probe.py tokens  # pools of the input embeddings alone, no layer run:
                                                         # blocks tok_last, tok_users, tok_sif, tok_meanmax

`cost` runs the same weights as a vLLM pooling model (runner="pooling",
the last token's state), over the data's prompts, whole and cut to its first
layers (hf_overrides num_hidden_layers), prints the seconds per row against
the engine-seconds a row took in the data's generation runs, and keeps the
features, so that the benchmark's probe can be scored on what vLLM computes
(blocks vllm, vllm_cut) as well as on transformers' states.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from typing import Optional

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "benchmarks", "data", "lengths.parquet")
CACHE = os.path.join(os.environ.get("OVERNIGHT_CACHE", os.path.expanduser("~/.cache/overnight")), "bench")
# Blocks `embed` keeps: mean-pooled states and the last token's state after these layers (of 30).
MEAN_LAYERS = (0, 1, 2, 4, 5, 10, 15, 20, 30)
LAST_LAYERS = (1, 2, 3, 4, 6, 8, 15, 30)


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

    # One thread: on a busy 2-core machine, OpenMP's spin-waits made two threads 30x slower than one.
    torch.set_num_threads(1)
    model_dir = resolve_model("smollm2-135m").path
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, chats = _chats(path)
    feats, t0 = {f"mean{k}": [] for k in MEAN_LAYERS}, time.perf_counter()
    feats.update({f"last{k}": [] for k in LAST_LAYERS})
    with torch.no_grad():
        for chat in chats:
            text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            enc = tok(text, return_tensors="pt", add_special_tokens=False)
            # [layers + 1] x [1, T, 576]: the embeddings, then each layer's output (the last one after the norm)
            hs = model.model(**enc, output_hidden_states=True).hidden_states
            for k in MEAN_LAYERS:
                feats[f"mean{k}"].append(hs[k][0].mean(dim=0).numpy())
            for k in LAST_LAYERS:
                feats[f"last{k}"].append(hs[k][0, -1].numpy())
    seconds = (time.perf_counter() - t0) / len(ids)
    os.makedirs(CACHE, exist_ok=True)
    out = _cache_path(path)
    np.savez_compressed(out, ids=np.array(ids), seconds_per_row=np.array(seconds),
                        **{k: np.stack(v).astype(np.float32) for k, v in feats.items()})
    print(f"{len(ids)} prompts embedded with transformers in {seconds * 1e3:.0f} ms a row -> {out}")


class Probe:
    """Ridge on log length over one block of the pooled hidden states, for benchmarks/length_prediction.py."""

    def __init__(self, x: np.ndarray, seconds_per_row: Optional[float], caps: np.ndarray):
        self.x = x
        self.seconds_per_row = seconds_per_row
        self.caps = caps

    @classmethod
    def load_cached(cls, ids, path: str = DATA, block: str = "last") -> "Probe":
        """block: mean<k> or last<k> (transformers: mean-pooled, or the last token's state, after k layers;
        last is last30), cut<k> (the last token's state of the model cut to k layers, after its norm: `layers`), vllm or vllm_cut<layers> (vLLM's pooling runner, the last token's state, of the whole
        model or of its first layers). `embed` runs the whole model once for all of transformers' blocks, so only
        last30 has a cost a row here; `layers` times a model cut to its first layers."""
        if block.startswith("vllm"):
            cache = _cache_path(path).replace("probe-", "probe-vllm-")
            if not os.path.exists(cache):
                sys.exit(f"no vLLM features for {path}: run `python benchmarks/length_prediction_probe.py cost`")
            z = np.load(cache)
            where = {i: k for k, i in enumerate(z["ids"].tolist())}
            which = block[5:] if block.startswith("vllm_cut") else "whole"
            if which not in z.files:
                sys.exit(f"no vLLM features of the {which} model for {path}: `cost` did not get that far")
            x = z[which][[where[i] for i in ids]].astype(np.float64)
            return cls(x, float(z[f"seconds_{which}"]), np.full(len(ids), 512))
        cache = _cache_path(path)
        if not os.path.exists(cache):
            sys.exit(f"no cached hidden states for {path}: run `python benchmarks/length_prediction_probe.py "
                     f"embed` first")
        z = np.load(cache)
        block = "last30" if block == "last" else block
        if block.startswith("cut") and block not in z.files:
            sys.exit(f"no block {block} in {cache}: run `python benchmarks/length_prediction_probe.py layers`")
        if block not in z.files:
            sys.exit(f"no block {block} in {cache} (it has {', '.join(f for f in z.files if f[:4] in ('mean', 'last'))}"
                     f"): run `python benchmarks/length_prediction_probe.py embed` again")
        where = {i: k for k, i in enumerate(z["ids"].tolist())}
        x = z[block][[where[i] for i in ids]].astype(np.float64)
        # `embed` ran the whole model once for every block: its cost a row is the whole model's (last30) only;
        # `layers` timed each cut model
        seconds = (float(z["seconds_per_row"]) if block == "last30" else
                   float(z[f"seconds_{block}"]) if block.startswith("cut") else None)
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


def cost(path: str, layers_cut: int, whole: bool = True) -> None:
    """vLLM's pooling runner over every prompt of the data (the last token's hidden state, after the model's
    final norm, not normalised): seconds per row, whole and cut to its first layers_cut layers. The features
    are cached for the benchmark's probe blocks vllm and vllm_cut."""
    import gc

    import pyarrow.parquet as pq

    from overnight.pipeline.configio import resolve
    from overnight.pipeline.engine.vllm import _quiet_vllm, configure_cpu_env, engine_args, is_cpu_platform
    from overnight.pipeline.tools.models import resolve as resolve_model

    meta = json.loads(pq.read_table(path).schema.metadata[b"overnight_lengths"])
    runs = meta["runs"]
    job_s = sum(r["engine_seconds"] for r in runs) / sum(r["rows"] for r in runs)
    base = resolve({"input": {"path": "x.parquet"}, "output": {"path": "/tmp"}})
    model_dir = resolve_model(base.engine.model).path
    _quiet_vllm()
    if is_cpu_platform():
        configure_cpu_env(base.engine)
    from transformers import AutoTokenizer
    from vllm import LLM
    from vllm.config import PoolerConfig

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids, chats = _chats(path)
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    num_tokens = sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts)
    result = {"rows": len(texts), "prompt_tokens": num_tokens, "job_seconds_per_row": job_s}
    out = _cache_path(path).replace("probe-", "probe-vllm-")
    feats = dict(np.load(out)) if os.path.exists(out) else {}  # earlier measurements stay
    feats.pop("ids", None)
    cost_file = os.path.join(CACHE, "probe-cost.json")
    if os.path.exists(cost_file):
        result = {**json.load(open(cost_file)), **result}
    models = [("whole", model_dir)] if whole else []
    for name, folder in models + [(f"cut{layers_cut}", _cut_model(model_dir, layers_cut))]:
        kw = engine_args(base.engine, folder)
        for key in ("scheduling_policy", "enable_chunked_prefill", "enable_prefix_caching"):
            kw.pop(key, None)
        kw.update(runner="pooling", pooler_config=PoolerConfig(pooling_type="LAST", use_activation=False))
        llm = LLM(**kw)
        llm.embed(texts[:8], use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.embed(texts, use_tqdm=False)
        dt = time.perf_counter() - t0
        feats[name] = np.array([o.outputs.embedding for o in outs], dtype=np.float32)
        feats[f"seconds_{name}"] = np.array(dt / len(texts))
        result[f"seconds_per_row_{name}"] = dt / len(texts)
        print(f"vLLM pooling, {name} model{'' if name == 'whole' else f' ({layers_cut} layers)'}: {len(texts)} rows, "
              f"{num_tokens} prompt tokens in {dt:.1f} s: {dt / len(texts) * 1e3:.1f} ms a row, "
              f"{num_tokens / dt:.0f} prompt tokens/s; {dt / len(texts) / job_s:.1%} of the job's "
              f"{job_s:.2f} engine-seconds a row", flush=True)
        del llm
        gc.collect()
        os.makedirs(CACHE, exist_ok=True)
        np.savez_compressed(out, ids=np.array(ids), **feats)
        with open(cost_file, "w") as f:
            json.dump(result, f, indent=1)


def layers_cost(path: str, cuts=(1, 2, 4)) -> None:
    """transformers' model cut to its first k layers (the final norm kept), one prompt at a time on one thread, as
    an input thread beside the engine would run it: seconds a row, against the job's engine-seconds a row."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModel, AutoTokenizer

    from overnight.pipeline.tools.models import resolve as resolve_model

    torch.set_num_threads(1)
    meta = json.loads(pq.read_table(path).schema.metadata[b"overnight_lengths"])
    job_s = sum(r["engine_seconds"] for r in meta["runs"]) / sum(r["rows"] for r in meta["runs"])
    model_dir = resolve_model("smollm2-135m").path
    tok = AutoTokenizer.from_pretrained(model_dir)
    _, chats = _chats(path)
    ids = [tok(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"] for c in chats]
    cache = _cache_path(path)
    if not os.path.exists(cache):
        sys.exit(f"no cached hidden states for {path}: run `python benchmarks/length_prediction_probe.py embed` first")
    blocks = dict(np.load(cache))
    for k in cuts:
        model = AutoModel.from_pretrained(model_dir, num_hidden_layers=k, dtype=torch.float32).eval()
        with torch.inference_mode():
            for t in ids[:8]:  # warm-up
                model(input_ids=torch.tensor([t]))
            t0 = time.perf_counter()
            states = [model(input_ids=torch.tensor([t])).last_hidden_state[0, -1] for t in ids]
        dt = (time.perf_counter() - t0) / len(ids)
        # kept as block cut<k>: the state this cost buys (after the cut model's final norm)
        blocks[f"cut{k}"] = torch.stack(states).numpy().astype(np.float32)
        blocks[f"seconds_cut{k}"] = np.array(dt)
        np.savez_compressed(cache, **blocks)
        print(f"transformers, first {k} layers, 1 thread: {dt * 1e3:.1f} ms a row ({np.mean([len(t) for t in ids]):.0f} "
              f"prompt tokens); {dt / job_s:.1%} of the data's {job_s:.2f} engine-seconds a row", flush=True)


def _cut_model(model_dir: str, layers: int) -> str:
    """A copy of the model with only its first `layers` layers (the final norm kept), in the cache: vLLM's
    loader refuses a checkpoint with more layers than its config names."""
    import shutil

    folder = os.path.join(CACHE, f"{os.path.basename(model_dir.rstrip('/'))}-{layers}-layers")
    if os.path.exists(os.path.join(folder, "model.safetensors")):
        return folder
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(model_dir):
        if name not in ("model.safetensors", "config.json") and os.path.isfile(os.path.join(model_dir, name)):
            shutil.copy(os.path.join(model_dir, name), folder)
    config = json.load(open(os.path.join(model_dir, "config.json")))
    config["num_hidden_layers"] = layers
    json.dump(config, open(os.path.join(folder, "config.json"), "w"), indent=1)
    from safetensors.torch import load_file as load_torch, save_file as save_torch

    weights = load_torch(os.path.join(model_dir, "model.safetensors"))
    keep = {k: v for k, v in weights.items()
            if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= layers)}
    save_torch(keep, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder


def tokens(path: str) -> None:
    """Blocks of the input embeddings alone (what buckets/tokens.py reads), pooled over the user's words rather
    than the whole templated prompt (mean0): tok_last, the mean over the text the predictor reads (a chat's last
    user message: the product's); tok_users, over every user message; tok_sif, tok_last weighted a / (a + p) by a
    frequency guessed from the token's id (BPE merges come roughly in frequency order); tok_meanmax, tok_last
    beside the maximum over the tokens (not a mean, so no table could hold it). Added to `embed`'s cache."""
    from overnight.buckets.features import prompt_text
    from overnight.buckets.tokens import TokenInputs, token_ids

    inputs = TokenInputs.of_model("smollm2-135m")
    emb = inputs.emb.float().numpy()
    p = 1.0 / (np.arange(len(emb)) + 100.0)
    p /= p.sum()
    ids, chats = _chats(path)
    last = token_ids(inputs.tokenizer, [prompt_text(None, c) for c in chats])
    users = token_ids(inputs.tokenizer, ["\n".join(m["content"] for m in c if m["role"] == "user") for c in chats])
    feats = {"tok_last": [], "tok_users": [], "tok_sif": [], "tok_meanmax": []}
    for t, u in zip(last, users):
        t, u = t or [0], u or [0]  # an empty message: the first token's embedding stands in
        e = emb[t]
        w = 1e-3 / (1e-3 + p[t])
        feats["tok_last"].append(e.mean(0))
        feats["tok_users"].append(emb[u].mean(0))
        feats["tok_sif"].append((w[:, None] * e).sum(0) / w.sum())
        feats["tok_meanmax"].append(np.concatenate([e.mean(0), e.max(0)]))
    out = _cache_path(path)
    if not os.path.exists(out):
        sys.exit(f"no cache {out}: run `python benchmarks/length_prediction_probe.py embed` first")
    z = dict(np.load(out))
    if list(z["ids"]) != list(ids):
        sys.exit(f"{out} holds other rows: run `embed` again")
    z.update({k: np.stack(v).astype(np.float32) for k, v in feats.items()})
    np.savez_compressed(out, **z)
    print(f"{len(ids)} prompts: blocks {', '.join(feats)} -> {out}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["embed", "cost", "layers", "tokens"])
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--layers", type=int, default=15, help="cost: layers of the cut model")
    ap.add_argument("--no-whole", action="store_true", help="cost: only the cut model")
    args = ap.parse_args()
    if args.what == "embed":
        embed(args.data)
    elif args.what == "layers":
        layers_cost(args.data)
    elif args.what == "tokens":
        tokens(args.data)
    else:
        cost(args.data, args.layers, whole=not args.no_whole)


if __name__ == "__main__":
    main()
