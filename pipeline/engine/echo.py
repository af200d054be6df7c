"""A stand-in engine with vLLM's add/step/abort shape that generates no model output.

For testing the pipeline around the engine: fault injection (a job killed
twenty times needs a fast engine), scheduler and runner tests, and trying a
config without a GPU. Each request produces one token per step up to its
length; a step can be made to take real time, as a GPU step does.

Selected with ``engine.kind: echo`` (``--engine echo``, ``--echo-step-ms 20``), or the environment alias
OVERNIGHT_ENGINE=echo (or echo:step_ms=20); never by default.
"""

from __future__ import annotations

import heapq
import time
from typing import Callable, Optional

from overnight.pipeline.records import Finished, Sample


class EchoEngine:
    supports_priority = True
    # Seconds from the last row to `overnight run`'s return (clockwork.FINISH_S is vLLM's, 2 s): the last writes
    # and the interpreter's exit, with no vLLM to shut down. 0.13-0.18 s for 2,000 rows on this 2-core machine.
    finish_s = 0.2

    def __init__(self, max_num_seqs: int = 64, max_model_len: int = 2048,
                 length_of: Optional[Callable[[list], int]] = None, step_sleep: float = 0.0, record: bool = True):
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.kv_cache_tokens = None
        self.num_preemptions = 0
        self.length_of = length_of or (lambda ids: 8 + len(ids) % 56)
        self.step_sleep = step_sleep
        self.waiting: dict[str, dict] = {}
        self._queue: list = []  # (priority, arrival, request id), as vLLM's priority queue
        self.running: dict[str, dict] = {}
        # What was added and aborted, and each request's priority, for tests to read; off for `--engine echo`,
        # where they would grow with the rows (10M rows: some 1.5 GB).
        self.record = record
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.priorities: dict[str, int] = {}
        self._arrivals = 0
        self.num_steps = 0
        self.step_total = 0.0  # seconds spent inside step(): the engine's share of a run's wall time

    @classmethod
    def from_config(cls, cfg) -> "EchoEngine":
        """Limits from the engine config, as vLLM's are; ``echo_step_ms`` makes each step take real time."""
        from overnight.pipeline.input.stage import FALLBACK_CONTEXT

        return cls(max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len or FALLBACK_CONTEXT,
                   step_sleep=cfg.echo_step_ms / 1000, record=False)

    def add(self, request_id, prompt_token_ids, sampling, priority=0):
        if (sampling.get("min_tokens") or 0) > sampling["max_tokens"]:  # as vLLM's SamplingParams refuses it
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={sampling['max_tokens']}, got "
                             f"{sampling['min_tokens']}.")
        target = min(sampling["max_tokens"], self.length_of(prompt_token_ids))
        self.waiting[request_id] = {"n": len(prompt_token_ids), "target": target, "done": 0,
                                    "length": target == sampling["max_tokens"], "samples": sampling.get("n", 1),
                                    "top_k": sampling.get("logprobs"), "lora": sampling.get("lora")}
        heapq.heappush(self._queue, (priority, self._arrivals, request_id))
        self._arrivals += 1
        if self.record:
            self.added.append(request_id)
            self.priorities[request_id] = priority

    def step(self):
        t0 = time.perf_counter()
        try:
            return self._step()
        finally:
            self.step_total += time.perf_counter() - t0

    def _step(self):
        self._step_begin()
        if self.step_sleep:
            time.sleep(self.step_sleep)
        return self._step_end()

    def _step_begin(self) -> None:
        """Start a step: waiting requests take the free slots, in priority and arrival order."""
        self.num_steps += 1
        while self._queue and len(self.running) < self.max_num_seqs:
            _, _, rid = heapq.heappop(self._queue)
            if rid in self.waiting:  # else aborted
                self.running[rid] = self.waiting.pop(rid)

    def _step_end(self) -> list[Finished]:
        """End a step: each running request has one more token; the ones done are returned."""
        out = []
        for rid in list(self.running):
            req = self.running[rid]
            req["done"] += 1
            if req["done"] >= req["target"]:
                del self.running[rid]
                now = time.time()
                out.append(_finished(rid, req, now))
        return out

    def abort(self, request_ids):
        for rid in request_ids:
            self.waiting.pop(rid, None)
            self.running.pop(rid, None)
            if self.record:
                self.aborted.append(rid)

    def has_unfinished(self):
        return bool(self.waiting or self.running)

    def shutdown(self) -> None:
        pass


def _finished(rid: str, req: dict, now: float) -> Finished:
    """The echo's answer: its text names the prompt's length (and the adapter); with n > 1 or logprobs, each
    completion has the same length and made-up logprobs."""
    text = f"echo of {req['n']} prompt tokens" + (f" through {req['lora']}" if req["lora"] else "")
    reason = "length" if req["length"] else "stop"
    n, top_k, done = req["samples"], req["top_k"], req["done"]
    samples = None
    if n > 1 or top_k is not None:
        samples = [Sample(i, text if i == 0 else f"{text}, sample {i}", reason, done,
                          None if top_k is None else _logprobs(done, top_k)) for i in range(n)]
    return Finished(rid, text, reason, req["n"], done * n, now, now, samples)


def _logprobs(num_tokens: int, top_k: int) -> list[dict]:
    """Made-up logprobs in the output's shape: token j is id j, and the chosen one is the most likely."""
    return [{"token_id": j, "token": f"t{j}", "logprob": -0.5,
             "top_logprobs": [{"token_id": j + r, "token": f"t{j + r}", "logprob": -0.5 - r} for r in range(top_k)]}
            for j in range(num_tokens)]
