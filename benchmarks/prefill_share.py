"""The rows a deadline leaves, when prefills take part of the time: the forecast's count against the simulated run's.

On an H200 the step cost's fit gave the prompts' prefills about half of the time (docs/BENCHMARKS.md, "First runs
on a GPU"). This runs tests/test_forecast.py's simulated engine (the real Scheduler and DeadlineTracker) with a
GPU's step (2.7 ms) and a prefill as costly as a row's tokens (1.5e-4 s a prompt token, 50 a row), 2,000 rows,
deadlines at 50% and 30% of the fifo makespan, and prints the range of rows expected left in the warned forecasts
between 4% and 30% of the rows, against the rows actually left, and the median CPU time of a forecast (the loop
spaces forecasts by 500 times it).

    python benchmarks/prefill_share.py
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from test_forecast import simulate  # noqa: E402

from overnight.pipeline.scheduling.deadline import DeadlineTracker  # noqa: E402

CPU: list = []


def _timed(forecast_job):
    def run(self, *args, **kwargs):
        t0 = time.thread_time()
        out = forecast_job(self, *args, **kwargs)
        CPU.append(time.thread_time() - t0)
        return out
    return run


def main() -> None:
    DeadlineTracker.forecast_job = _timed(DeadlineTracker.forecast_job)
    cost, pf = (0.0027, 0.0), 1.5e-4
    full = simulate("fifo", cost, prefill=pf, n_rows=2000)
    for pol in ("fifo", "auto", "longest-first"):
        for share in (0.5, 0.3):
            CPU.clear()
            story = simulate(pol, cost, deadline_share=share, makespan=full.end, prefill=pf, n_rows=2000)
            cpu = sorted(CPU[2:])
            left = story.n - story.done
            w = [f.rows_expected_left for _, done, f in story.samples
                 if f.will_miss and 0.04 * story.n <= done <= 0.3 * story.n]
            first = next(done for _, done, f in story.samples if f.will_miss)
            print(f"{pol} {share}: {min(w)}-{max(w)} / {left} (n={len(w)}, warned at {first} rows); "
                  f"a forecast's CPU time: median {1000 * cpu[len(cpu) // 2]:.1f} ms")


if __name__ == "__main__":
    main()
