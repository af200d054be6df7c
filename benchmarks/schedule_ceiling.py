"""How much can ordering gain on this hardware at best? A simulation, not a measurement.

It replays half B of a finished `scheduling.py` run through a model of the
engine's step cost, measured by `concurrency.py`:

    step seconds = fixed + per_seq * running sequences + prefill * prompt tokens started in the step

and asks what makespan and deadline goodput each ordering would give, up to
`--max-seqs` sequences at once. Two samplings of the same prompts exist in that
run (the longest-first runs with the trained and with the online predictor);
each serves as the truth in turn, and the other as the best predictor a
sampling model allows (tau between them is the noise ceiling that
`length_noise.py` measures). "exact" knows the very lengths it is scored on:
no predictor can do better. Deadline goodput is also shown with fewer
sequences in flight: the best fixed cap in hindsight, and a cap that shrinks
as the deadline nears, from the step-cost model (see shrinking_cap).

    python benchmarks/schedule_ceiling.py --run /tmp/bench/sched-final --fixed-ms 38 --per-seq-ms 3.4 --prefill-ms 1.55
"""

from __future__ import annotations

import argparse
import os

import numpy as np


def shrinking_cap(fixed: float, per_seq: float, predicted, max_seqs: int):
    """Rows in flight as the deadline nears: with R(c) = c / (fixed + per_seq * c) tokens/s and about half a
    row's tokens lost per row still in flight at the stop, tokens finished by then are about
    R(c) * time_left - c * mean_length / 2, largest at c = (sqrt(2 * time_left * fixed / mean_length) - fixed)
    / per_seq. mean_length: predicted, over the next max_seqs rows in line."""
    def cap(time_left: float, queue: list[int]) -> int:
        nxt = queue[-max_seqs:]
        mean = float(np.mean([predicted[i] for i in nxt])) if nxt else 1.0
        c = (np.sqrt(2 * max(time_left, 0.0) * fixed / max(mean, 1.0)) - fixed) / per_seq
        return int(max(1, min(max_seqs, c)))
    return cap


def simulate(order, lengths, prompts, cost, max_seqs: int, budget: float = float("inf"),
             cap=None) -> tuple[int, float]:
    """(rows finished, seconds) running rows in `order`, at most max_seqs at once (or cap(time_left, queue)),
    until done or the budget."""
    fixed, per_seq, prefill = cost
    queue = list(order)[::-1]
    running: dict[int, int] = {}
    t, done = 0.0, 0
    while True:
        started = 0
        limit = max_seqs if cap is None else cap(budget - t, queue)
        while len(running) < limit and queue:
            i = queue.pop()
            running[i] = 0
            started += prompts[i]
        if not running:
            return done, t
        dt = fixed + per_seq * len(running) + prefill * started
        if t + dt > budget:
            return done, t
        t += dt
        for i in list(running):
            running[i] += 1
            if running[i] >= lengths[i]:
                del running[i]
                done += 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True, help="The --out folder of a finished scheduling.py run.")
    ap.add_argument("--fixed-ms", type=float, required=True)
    ap.add_argument("--per-seq-ms", type=float, required=True)
    ap.add_argument("--prefill-ms", type=float, required=True, help="Milliseconds per prompt token prefilled.")
    ap.add_argument("--max-seqs", type=int, default=64)
    ap.add_argument("--deadline-share", type=float, default=0.3)
    args = ap.parse_args()

    import duckdb
    import pyarrow.parquet as pq

    needed = ["b.parquet", "b-lf-trained", "b-lf-online"]
    missing = [n for n in needed if not os.path.exists(os.path.join(args.run, n))]
    if missing:
        raise SystemExit(f"{args.run} lacks {', '.join(missing)}: pass the --out folder of a finished full run of "
                         f"benchmarks/scheduling.py (not a --deadline-only run).")
    ids = pq.read_table(os.path.join(args.run, "b.parquet"), columns=["id"]).column(0).to_pylist()

    def column(side: str, name: str) -> np.ndarray:
        path = os.path.join(args.run, side, "**", "*.parquet")
        got = dict(duckdb.sql(f"select id, {name} from read_parquet('{path}') where status = 'ok'").fetchall())
        lacking = [i for i in ids if got.get(i) is None]
        if lacking:
            raise SystemExit(f"{os.path.join(args.run, side)} has no finished row (status 'ok') for {len(lacking)} "
                             f"of half B's ids, e.g. {lacking[0]!r}: the run did not complete; rerun scheduling.py.")
        return np.array([got[i] for i in ids], dtype=float)

    samples = {"trained run": column("b-lf-trained", "output_tokens"),
               "online run": column("b-lf-online", "output_tokens")}
    predicted = {"trained": column("b-lf-trained", "predicted_tokens"),
                 "online": column("b-lf-online", "predicted_tokens")}
    prompts = column("b-lf-trained", "prompt_tokens")
    cost = (args.fixed_ms / 1000, args.per_seq_ms / 1000, args.prefill_ms / 1000)
    m = args.max_seqs
    fifo = list(range(len(ids)))
    print(f"step cost: {args.fixed_ms} ms + {args.per_seq_ms} ms per sequence + {args.prefill_ms} ms per prompt "
          f"token; up to {m} sequences; {len(ids)} rows")
    for truth, lengths in samples.items():
        other = next(v for k, v in samples.items() if k != truth)
        orders = {**{f"{k} predictor": v for k, v in predicted.items()}, "other sampling": other, "exact": lengths}
        _, t_fifo = simulate(fifo, lengths, prompts, cost, m)
        print(f"\ntruth: the {truth}'s lengths ({int(lengths.sum())} tokens); input order finishes in {t_fifo:.1f} s")
        for name, pred in orders.items():
            _, t = simulate(np.argsort(-pred, kind="stable"), lengths, prompts, cost, m)
            print(f"  makespan, longest-first by {name:18s} {t:6.1f} s  ({(t_fifo - t) / t_fifo:+.1%} vs input order)")
        budget = args.deadline_share * t_fifo
        base, _ = simulate(fifo, lengths, prompts, cost, m, budget)
        print(f"  deadline {budget:.1f} s: input order finishes {base} rows")
        for name, pred in orders.items():
            order = np.argsort(pred, kind="stable")
            n, _ = simulate(order, lengths, prompts, cost, m, budget)
            capped = max((simulate(order, lengths, prompts, cost, c, budget)[0], c) for c in range(8, m + 1, 8))
            shrink, _ = simulate(order, lengths, prompts, cost, m, budget, shrinking_cap(cost[0], cost[1], pred, m))
            print(f"  goodput, shortest-first by {name:18s} {n:4d} rows ({n / base:.2f}x); best fixed cap "
                  f"{capped[1]:2d} in flight: {capped[0]} rows ({capped[0] / base:.2f}x); shrinking cap: {shrink} "
                  f"rows ({shrink / base:.2f}x)")


if __name__ == "__main__":
    main()
