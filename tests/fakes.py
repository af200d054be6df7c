"""A fake engine with vLLM's add/step/abort shape, for fast runner and scheduler tests."""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict

from overnight.pipeline.records import Finished


class FakeClock:
    def __init__(self, t: float = 1_900_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeEngine:
    """Each request produces one token per step, up to min(max_tokens, length_of(prompt))."""

    def __init__(self, max_num_seqs: int = 4, max_model_len: int = 2048, length_of=None, fail_after_steps=None,
                 clock=None, step_seconds: float = 0.0, step_sleep: float = 0.0):
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.length_of = length_of or (lambda ids: 3 + len(ids) % 5)
        self.fail_after_steps = fail_after_steps
        self.waiting: dict[str, dict] = {}
        self._queue: list = []  # (priority, arrival, request id), as vLLM's priority queue
        self.running: OrderedDict[str, dict] = OrderedDict()
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.num_steps = 0
        self.supports_priority = True
        self.clock = clock
        self.step_seconds = step_seconds
        # Real seconds each step takes, like a GPU step: the loop's thread waits (GIL released) meanwhile.
        self.step_sleep = step_sleep
        self.step_total = 0.0  # real seconds spent inside step(): the engine's share of the wall time
        self.priorities: dict[str, int] = {}

    def add(self, request_id, prompt_token_ids, sampling, priority=0):
        target = min(sampling["max_tokens"], self.length_of(prompt_token_ids))
        self.waiting[request_id] = {"n": len(prompt_token_ids), "target": target, "done": 0,
                                    "length": target == sampling["max_tokens"]}
        heapq.heappush(self._queue, (priority, len(self.added), request_id))
        self.added.append(request_id)
        self.priorities[request_id] = priority

    def step(self):
        t0 = time.perf_counter()
        try:
            return self._step()
        finally:
            self.step_total += time.perf_counter() - t0

    def _step(self):
        self.num_steps += 1
        if self.clock is not None:
            self.clock.t += self.step_seconds
        if self.step_sleep:
            time.sleep(self.step_sleep)
        if self.fail_after_steps is not None and self.num_steps > self.fail_after_steps:
            raise RuntimeError("engine died")
        while self._queue and len(self.running) < self.max_num_seqs:
            _, _, rid = heapq.heappop(self._queue)
            if rid in self.waiting:  # else aborted
                self.running[rid] = self.waiting.pop(rid)
        out = []
        for rid in list(self.running):
            req = self.running[rid]
            req["done"] += 1
            if req["done"] >= req["target"]:
                del self.running[rid]
                now = time.time()
                out.append(Finished(rid, f"answer {req['n']}", "length" if req["length"] else "stop", req["n"],
                                    req["done"], now, now))
        return out

    def abort(self, request_ids):
        for rid in request_ids:
            self.waiting.pop(rid, None)
            self.running.pop(rid, None)
            self.aborted.append(rid)

    def has_unfinished(self):
        return bool(self.waiting or self.running)
