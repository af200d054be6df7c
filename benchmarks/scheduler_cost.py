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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--policy", default="auto")
    ap.add_argument("--predictor", default="online")
    ap.add_argument("--step-ms", type=float, default=5.0, help="Real time of one fake engine step.")
    ap.add_argument("--max-num-seqs", type=int, default=256)
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
    t0 = time.perf_counter()
    summary = run_job(cfg, engine_factory=lambda job: engine, is_tty=False)
    wall = time.perf_counter() - t0
    by_thread = summary.extra["scheduler"]["predictor_seconds_by_thread"]
    reader_s = by_thread["input"]  # predicting new rows, in the input thread
    predictor_s = by_thread["loop"]  # learning and refreshing, in the engine loop (none with a learner)
    learner_s = by_thread["learner"]  # learning and re-predicting the pool, in the learner thread
    sched_s = timers["scheduler"]
    ours = sched_s + predictor_s
    engine_s = engine.step_total  # the fake's own bookkeeping is the engine's time, as vLLM's is
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
    print(f"wall {wall:.1f} s, engine {engine_s:.1f} s: overnight's share of wall time (wall - engine) / wall = "
          f"{100 * (wall - engine_s) / wall:.2f}%")


if __name__ == "__main__":
    main()
