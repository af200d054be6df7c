"""The drain's end under the very lengths it is given: the two ways scheduling/forecast.drain() counts it, against
a brute-force Monte Carlo of the engine's slots.

Every row's length is drawn from one distribution, the embedded model's own output lengths (benchmarks/data/
lengths.parquet: the MT-bench and Vicuna rows for --workload open, every row for mixed; both samplings). A job of
--rows rows runs over --slots slots, the first slot free taking the next row (as vLLM's continuous batching does),
one token a step. When 10%, 25% and 50% of its rows have finished, the forecast is given the state (the rows
running and their tokens so far, the rows still to start) and a length model that knows the distribution exactly
(the empirical one; a running row's, conditioned on what it has run). What is left to know is luck, and a fair
forecast of the drain's end averages over it:

    truth       the mean end of --mc Monte Carlo drains from that state (what a fair forecast says)
    actual      the end that came in the job drawn (truth's check: its median over the jobs is about 1)
    last rows   the product's layout at the expected lengths, plus the spread of each slot's last row at its
                expected start (forecast._tail_steps), the product's before stop 71 and beyond DRAWN_ROUNDS
    drawn       the product's from stop 71 (forecast._drawn_steps): every row drawn DRAWS times, laid over the slots
                (forced at any number of rounds here, but past DRAWN_ROWS rows to start: the last rows' spread)

Prints, per job size and point, the rounds of the slots still to start, and the median over --jobs jobs of each
over truth, with the drawn one's 10th-90th percentile and its time.

    python benchmarks/drain_tail.py [--workload open] [--rows 150 300 450 900] [--jobs 12] [--slots 64]
"""

from __future__ import annotations

import argparse
import heapq
import os
import time

import numpy as np

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "lengths.parquet")
CAP = 512


class Empirical:
    """A length model (the drain's interface: cap, expected, quantile_cdf) that knows the lengths' distribution:
    the values given, whatever the prediction."""

    def __init__(self, values: np.ndarray):
        self.values, self.cap = np.sort(values), float(CAP)

    def _above(self, x):
        return 1.0 - np.searchsorted(self.values, x, side="right") / len(self.values)

    def expected(self, predicted, generated=None, shift: float = 0.0) -> np.ndarray:
        g = np.zeros(len(predicted)) if generated is None else np.asarray(generated, np.float64)
        return np.array([(v.mean() - x) if len(v := self.values[self.values > x]) else 1.0 for x in g])

    def quantile_cdf(self, x, predicted, generated, shift: float = 0.0) -> np.ndarray:
        shape = np.broadcast(x, predicted, generated).shape
        g, x = np.broadcast_to(np.asarray(generated, np.float64), shape), np.broadcast_to(x, shape)
        alive = self._above(g)
        cdf = np.where(alive > 0, 1.0 - self._above(g + np.maximum(x, 0.0)) / np.maximum(alive, 1e-12), 1.0)
        return np.where(g + x >= CAP, 1.0, np.clip(cdf, 0.0, 1.0))

    def draw_left(self, g: np.ndarray, rng) -> np.ndarray:
        return np.array([rng.choice(self.values[self.values > x]) - x for x in g])


def greedy(slots: int, running_left: np.ndarray, to_start: np.ndarray) -> float:
    heap = list(np.concatenate([running_left, np.zeros(slots - len(running_left))]))
    heapq.heapify(heap)
    for length in to_start:
        heapq.heappush(heap, heapq.heappop(heap) + length)
    return max(heap)


def main() -> None:
    import pyarrow.parquet as pq

    from overnight.pipeline.scheduling import forecast as fc

    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", choices=["open", "mixed"], default="open")
    ap.add_argument("--rows", type=int, nargs="*", default=[150, 300, 450, 900])
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--mc", type=int, default=60)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    t = pq.read_table(DATA, columns=["source", "out_1", "out_2"]).to_pydict()
    keep = [args.workload == "mixed" or s in ("mt_bench", "vicuna") for s in t["source"]]
    lengths = np.minimum(np.array([x for k, a, b in zip(keep, t["out_1"], t["out_2"]) if k for x in (a, b)],
                                  np.float64), CAP)
    model, rng, k = Empirical(lengths), np.random.default_rng(args.seed), args.slots
    print(f"{args.workload}: {len(lengths)} lengths, mean {lengths.mean():.0f}, {np.mean(lengths >= CAP):.0%} at "
          f"max_tokens {CAP}; {k} slots; medians over {args.jobs} jobs, each over truth ({args.mc} drains)")
    for n in args.rows:
        for share in (0.10, 0.25, 0.50):
            out = []
            for _ in range(args.jobs):
                job = rng.choice(lengths, n)
                heap, starts, ends = [(0.0, j) for j in range(k)], np.zeros(n), np.zeros(n)
                for i in range(n):
                    starts[i], slot = heapq.heappop(heap)
                    ends[i] = starts[i] + job[i]
                    heapq.heappush(heap, (ends[i], slot))
                now = np.sort(ends)[int(np.ceil(share * n)) - 1]
                running, later = (starts < now) & (ends > now), starts >= now
                g = now - starts[running]
                run_e, later_e = model.expected(g, g), model.expected(np.zeros(later.sum()))
                tail = (model, np.ones(running.sum()), g, np.ones(later.sum()), 0.0)
                ends_by = {}
                for rounds in (0, n):  # the last rows' spread; drawn
                    fc.DRAWN_ROUNDS = rounds
                    t0 = time.perf_counter()
                    d = fc.drain(k, run_e, later_e, np.ones(later.sum()), tail=tail)
                    ends_by[rounds] = (d.steps + d.tail_steps, time.perf_counter() - t0)
                truth = np.mean([greedy(k, model.draw_left(g, rng), rng.choice(lengths, later.sum()))
                                 for _ in range(args.mc)])
                out.append((later.sum() / k, (ends.max() - now) / truth, ends_by[0][0] / truth,
                            ends_by[n][0] / truth, 1000 * ends_by[n][1]))
            e = np.array(out)
            print(f"  {n} rows at {share:.0%} ({e[:, 0].mean():.1f} rounds to start): actual x{np.median(e[:, 1]):.3f}"
                  f", last rows x{np.median(e[:, 2]):.3f}, drawn x{np.median(e[:, 3]):.3f} (p10-p90 "
                  f"{np.percentile(e[:, 3], 10):.3f}-{np.percentile(e[:, 3], 90):.3f}, {e[:, 4].mean():.1f} ms)",
                  flush=True)


if __name__ == "__main__":
    main()
