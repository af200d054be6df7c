"""Scheduler cost: the scheduler's and predictor's share of wall time at 100k rows, with a fake engine.

Runs the real pipeline (Parquet source, validation, tokenizer, predictor,
scheduler, deadline forecast, checkpoint writer) over 100k real prompts with
a fake engine whose every step takes --step-ms of real time, as a GPU step
does (the loop's thread waits, the GIL released, as it does on vLLM's engine
process). 256 sequences per 5 ms step is about 50k output tokens/s, a
small model on an H100. It reports:

* the CPU time of the scheduler (add, schedule, finish, re-keying, forecasts)
  and of the predictor (features, predictions, online learning, refreshes),
  per row, as if none of it overlapped the engine;
* the share of wall time that is not the engine's: (wall - engine) / wall,
  which is what overnight adds, with the input stage running in its
  background thread while the engine steps.

    python benchmarks/scheduler_cost.py --rows 100000 --step-ms 5
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))


class EngineCoreProcess:
    """The fake engine as vLLM V1 runs its engine: the core steps on its own (vLLM: in its own process, a busy
    loop that schedules and runs a step whenever it has requests, and queues each step's outputs), and
    ``step()`` in overnight's loop waits for the outputs queued since it last asked. The loop's own work then
    overlaps the engine's steps; what it costs the engine is the time the core sat with nothing to run, or ran
    fewer rows than it could because the loop had not refilled it yet. Here the core is a thread (its steps
    sleep, so the GIL is free while they run); its bookkeeping counts as the engine's time."""

    def __init__(self, engine):
        import threading

        self.engine = engine
        self.max_num_seqs, self.max_model_len = engine.max_num_seqs, engine.max_model_len
        self.kv_cache_tokens, self.num_preemptions, self.supports_priority = None, 0, True
        self.cond = threading.Condition()
        self.outbox: list = []
        self.num_batches = 0
        self.busy = 0.0  # seconds the core spent in steps
        self.steps: list[tuple[float, float, int]] = []  # (start, end, free slots) of each step
        self.idle: list[tuple[float, float]] = []  # when the core had nothing to run
        self.last_add = 0.0
        self.closed = False
        self.thread = threading.Thread(target=self._core, name="engine-core", daemon=True)
        self.thread.start()

    def _core(self) -> None:
        while True:
            with self.cond:
                if not self.engine.has_unfinished():
                    i0 = time.perf_counter()
                    while not self.closed and not self.engine.has_unfinished():
                        self.cond.wait()
                    self.idle.append((i0, time.perf_counter()))
                if self.closed:
                    return
            t0 = time.perf_counter()
            with self.cond:  # the core takes new requests between steps
                self.engine._step_begin()
                free = self.max_num_seqs - len(self.engine.running)
            time.sleep(self.engine.step_sleep)
            with self.cond:
                out = self.engine._step_end()
                t1 = time.perf_counter()
                self.busy += t1 - t0
                self.steps.append((t0, t1, free))
                self.outbox.extend(out)
                self.num_batches += 1
                self.cond.notify_all()

    def add(self, *a, **kw):
        with self.cond:
            self.engine.add(*a, **kw)
            self.last_add = time.perf_counter()
            self.cond.notify_all()

    def lost(self, t_start: float, t_end: float) -> dict:
        """Where the wall time went besides the engine's steps: before its first step (opening the job, the first
        rows), idle or with free slots while overnight still had rows to give it (until the last row went in;
        after that the engine drains, as it would under LLM.generate), and after its last step."""
        first, last = self.steps[0][0], self.steps[-1][1]
        idle = sum(min(b, self.last_add) - a for a, b in self.idle if a < self.last_add and a > first)
        starved = sum((e - b) * free / self.max_num_seqs for b, e, free in self.steps if e <= self.last_add)
        return {"before": first - t_start, "idle": idle, "starved": starved, "after": t_end - last}

    def abort(self, ids):
        with self.cond:
            self.engine.abort(ids)

    def has_unfinished(self) -> bool:
        with self.cond:
            return self.engine.has_unfinished() or bool(self.outbox)

    def step(self):
        with self.cond:
            seen = self.num_batches
            while self.num_batches == seen and self.engine.has_unfinished():
                self.cond.wait()
            out, self.outbox = self.outbox, []
            return out

    def shutdown(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--policy", default="auto")
    ap.add_argument("--predictor", default="online")
    ap.add_argument("--step-ms", type=float, default=5.0, help="Real time of one fake engine step.")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--engine-core", choices=["inline", "process"], default="inline",
                    help="inline: each step runs inside step(), so the loop's work adds to it (the default, an upper "
                         "bound); process: the steps run on their own as vLLM V1's engine core does, and the loop's "
                         "work overlaps them.")
    args = ap.parse_args()

    import pyarrow as pa
    import pyarrow.parquet as pq

    from fakes import FakeEngine
    from overnight.pipeline.api import run_job
    from overnight.pipeline.configio import resolve
    from overnight.pipeline.scheduling.deadline import DeadlineTracker
    from overnight.pipeline.scheduling.scheduler import Scheduler

    tmp = tempfile.mkdtemp(prefix="overnight-cost-")
    base = pq.read_table(os.path.join(REPO, "examples", "prompts.parquet"), columns=["id", "prompt"])
    reps = -(-args.rows // base.num_rows)
    table = pa.concat_tables([base] * reps).slice(0, args.rows)
    table = table.set_column(0, "id", pa.array([f"row-{i:07d}" for i in range(args.rows)]))
    inp = os.path.join(tmp, "in.parquet")
    pq.write_table(table, inp)

    # Wall time inside the scheduler's calls includes waiting for the GIL while another thread holds it; CPU time
    # of the loop's thread does not: both are reported.
    timers = {"scheduler": 0.0, "scheduler_cpu": 0.0}
    by_name: dict[str, float] = {}  # CPU seconds per method

    def timed(fn):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                timers["scheduler"] += time.perf_counter() - t0
                cpu = time.thread_time() - c0
                timers["scheduler_cpu"] += cpu
                by_name[fn.__name__] = by_name.get(fn.__name__, 0.0) + cpu
        return wrapper

    # The scheduler's public interface, and the forecast the loop makes from it every 2 s.
    # (Not the ones these call, or their time would count twice: requeue_running -> add,
    # forecast_job -> pending_in_run_order, set_mode -> rekey.)
    for name in ("add", "schedule", "finish", "drain_running", "repredict", "pending_entries", "set_mode",
                 "take_expired"):
        setattr(Scheduler, name, timed(getattr(Scheduler, name)))
    DeadlineTracker.forecast_job = timed(DeadlineTracker.forecast_job)

    # The fake engine answers with as many tokens as the heuristic would guess for prompts of that length,
    # so the online predictor has something real to learn; its steps cost nothing.
    engine = FakeEngine(max_num_seqs=args.max_num_seqs, length_of=lambda ids: 20 + len(ids) % 200,
                        step_sleep=args.step_ms / 1000)
    cfg = resolve({"input": {"path": inp}, "output": {"path": os.path.join(tmp, "out"), "flush_rows": 5000},
                   "scheduler": {"policy": args.policy}, "buckets": {"predictor": args.predictor},
                   "sampling": {"max_tokens": 512}})
    # One-time start-up (imports, loading the tokenizer) is not per-row cost; a real job hides it behind the
    # engine's own start-up.
    from overnight.pipeline.tools.models import load_tokenizer, resolve as resolve_model
    load_tokenizer(resolve_model(cfg.engine.model))
    import overnight.buckets.trained  # noqa: F401
    core = EngineCoreProcess(engine) if args.engine_core == "process" else None
    t0 = time.perf_counter()
    summary = run_job(cfg, engine_factory=lambda job: core or engine, is_tty=False)
    wall = time.perf_counter() - t0
    t_end = t0 + wall
    if core is not None:
        core.shutdown()
    by_thread = summary.extra["scheduler"]["predictor_seconds_by_thread"]
    reader_s = by_thread["input"]  # predicting new rows, in the input thread
    predictor_s = by_thread["loop"]  # learning and refreshing, in the engine loop (none with a learner)
    learner_s = by_thread["learner"]  # learning and re-predicting the pool, in the learner thread
    sched_s = timers["scheduler"]
    ours = sched_s + predictor_s
    engine_s = core.busy if core is not None else engine.step_total  # the fake's bookkeeping is the engine's time, as vLLM's is
    n = summary.num_done
    print(f"{n} rows, {summary.num_output_tokens} output tokens, {engine.num_steps} fake steps of "
          f"{args.step_ms} ms ({summary.num_output_tokens / engine_s:.0f} tok/s of engine time), policy "
          f"{args.policy}, predictor {args.predictor}, max_num_seqs {args.max_num_seqs}")
    cpu_s = timers["scheduler_cpu"]
    print(f"in the engine loop: scheduler {sched_s:.2f} s ({1e6 * sched_s / n:.1f} us per row; {cpu_s:.2f} s of it CPU, "
          f"{1e6 * cpu_s / n:.1f} us per row, {100 * cpu_s / wall:.2f}% of wall time), predictor learning "
          f"and refreshing {predictor_s:.2f} s ({1e6 * predictor_s / n:.1f} us per row): together "
          f"{100 * ours / wall:.2f}% of wall time")
    print("  by method, CPU s: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(by_name.items(), key=lambda x: -x[1])))
    print(f"in the input thread, overlapping the engine: predicting new rows {reader_s:.2f} s "
          f"({1e6 * reader_s / n:.1f} us per row)")
    print(f"in the learner thread, overlapping the engine: learning and re-predicting the pool {learner_s:.2f} s "
          f"({1e6 * learner_s / n:.1f} us per row)")
    if core is None:
        print(f"wall {wall:.1f} s, engine {engine_s:.1f} s: overnight's share of wall time (wall - engine) / wall = "
              f"{100 * (wall - engine_s) / wall:.2f}%")
        return
    lost = core.lost(t0, t_end)
    full = sum(1 for _, _, free in core.steps if free == 0)
    print(f"engine core on its own: wall {wall:.1f} s, steps {core.busy:.1f} s ({len(core.steps)} steps, {full} of them "
          f"full); lost to overnight: before the first step {lost['before']:.2f} s, idle {lost['idle']:.2f} s, "
          f"free slots while rows were left {lost['starved']:.2f} s, after the last step {lost['after']:.2f} s")
    per_row = lost["idle"] + lost["starved"]
    print(f"overnight's share of wall time: per-row work (idle + free slots) {100 * per_row / wall:.2f}%, with the "
          f"start and end {100 * sum(lost.values()) / wall:.2f}%")


if __name__ == "__main__":
    main()
