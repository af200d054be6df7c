"""Which pending rows go to the engine next: a pure state machine, no engine, clock or I/O.

The runner reads input into a lookahead pool; the scheduler hands rows to vLLM, keeping its waiting queue topped up
a little above what it can run (``capacity``) but not flooded: rows not yet admitted stay cheap to reorder and need
no abort at a deadline. Which rows go first is the policy's call:

    fifo            input order
    longest-first   longest predicted output first: long answers start early, so the tail is short
    shortest-first  shortest predicted output first: the most rows finished soonest
    priority        the per-row `priority` column, lower first (as in vLLM), then input order
    auto            longest-first while the deadline is safe; once it is at risk, the most value per
                    predicted token first (the `value` column, else 1 per row: shortest-first)

Two rules apply under every policy. A row with a per-row `deadline` that is at risk (little time left for its
predicted length) goes first, earliest deadline first. And no row waits forever: one pending for longer than
``max_wait_s`` goes ahead of the policy's choice (aging).

Where the rows run by predicted length (``runs_by_length``), one admission by the policy in ``sample_every`` is a
pending row drawn at random (reason "sample"): the forecast learns from those what the rows left run
(scheduling/drawn.py). Under auto, vLLM's queue runs the rows in the order they were admitted, those admitted
after a mode switch first (``_engine_priority``).
"""

from __future__ import annotations

import enum
import heapq
import random
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional

from overnight.pipeline.config import Policy
from overnight.pipeline.records import Row

__all__ = ["Admission", "Mode", "Policy", "Scheduler", "SchedulerStats"]


# The engine priority of a row picked because it waited past --max-wait or its own deadline is at risk: ahead of
# every row in vLLM's waiting queue (the policy's priorities are far above it), or it would wait there behind rows
# admitted after it. Within int64, which vLLM's client sends.
URGENT_PRIORITY = -(2 ** 62)


class Mode(str, enum.Enum):  # auto's two regimes
    THROUGHPUT = "throughput"
    DEADLINE = "deadline"


class _Entry:
    __slots__ = ("seq", "row", "enqueued_at", "key", "is_taken")

    def __init__(self, seq: int, row: Row, enqueued_at: float, key: float):
        self.seq, self.row, self.enqueued_at, self.key, self.is_taken = seq, row, enqueued_at, key, False


@dataclass(slots=True)
class Admission:
    request_id: str
    row: Row
    # Priority for vLLM's own scheduler (lower runs sooner); 0 unless the policy orders vLLM's queue too.
    priority: int = 0
    # Why this row went now: "policy", "aged", "deadline" or "sample" (drawn at random: runs_by_length).
    reason: str = "policy"


@dataclass
class SchedulerStats:
    num_aged: int = 0
    num_deadline_first: int = 0
    num_mode_switches: int = 0
    num_sampled: int = 0  # rows drawn at random where the rows run by predicted length (sample_every)


class Scheduler:
    EPOCH = 2 ** 40  # auto's engine priorities: a mode's rows outrank the admissions of every mode before it

    def __init__(self, max_running: int, queue_factor: float = 1.0, policy: Policy | str = Policy.FIFO,
                 lookahead: int = 0, max_wait_s: Optional[float] = None, has_values: bool = False,
                 sample_every: int = 0, seed: int = 0):
        self.policy = Policy(policy)
        self.queue_factor, self.lookahead_rows = queue_factor, lookahead
        self.resize(max_running)
        self.max_wait_s, self.has_values = max_wait_s, has_values
        self.sample_every, self._rng, self._picked = sample_every, random.Random(seed), 0  # seeded: the same order
        self.mode = Mode.THROUGHPUT
        self.running: dict[str, Row] = {}
        # The forecast's currency: predicted tokens times this are what the deadline tracker's length models were
        # fitted in. A re-prediction (the online predictor's) moves the pool's predictions; this moves the other way
        # by the ratio of their sums, so rows finished under the old and pending under the new compare (repredict).
        self.forecast_scale = 1.0
        self.running_predicted = 0.0  # running rows' forecast_tokens (n times for n samples)
        # Sequences: a row that asks for n samples runs as n of them in the engine (what the forecast counts).
        self.running_samples = self.pending_samples = 0
        self.stats = SchedulerStats()
        self._heap: list[tuple[float, int, _Entry]] = []
        self._arrivals: deque[_Entry] = deque()  # pending rows in arrival order (aging)
        self._deadlines: list[tuple[float, int, _Entry]] = []
        self._max_predicted = 0  # the longest prediction of a row with a deadline (how far ahead one may be at risk)
        self._at_risk: Optional[deque] = None  # rows at risk found by this schedule() call
        self._num_pending = 0
        # Pending rows by predicted output tokens ({tokens: rows}): the deadline forecast reads it in O(distinct
        # lengths) instead of sorting the pool every time.
        self._lengths: dict[int, int] = {}
        self._next_seq = self._next_request = 0
        self._epoch = 0  # bumps at each mode switch (_engine_priority)
        self.per_seq_tokens_per_s: Optional[float] = None
        self.is_admitting = True
        # Rows in the engine at most, below capacity: the deadline tracker's shrinking cap, or its probe of the
        # step cost at the start; None: capacity alone.
        self.cap: Optional[int] = None

    def resize(self, max_running: int) -> None:
        """Fit the engine that started: what it runs at once (max_num_seqs)."""
        # Rows in the engine at once: what it can run plus a waiting margin.
        self.capacity = max(1, int(round(max_running * (1 + self.queue_factor))))
        # Rows held for reordering, beyond one full refill of the engine.
        self.lookahead = max(self.capacity, self.lookahead_rows)

    # -- state ---------------------------------------------------------------------------------
    @property
    def num_pending(self) -> int:
        return self._num_pending

    @property
    def num_running(self) -> int:
        return len(self.running)

    def wants_rows(self) -> bool:
        """True while the pool holds less than the lookahead."""
        return self._num_pending < self.lookahead

    def is_done(self) -> bool:
        return self._num_pending == 0 and not self.running

    # -- input ---------------------------------------------------------------------------------
    def add(self, rows: Iterable[Row], now: float = 0.0) -> None:
        heap, lengths, key = self._heap, self._lengths, self._key
        arrivals = self._arrivals if self.max_wait_s is not None else None
        seq = self._next_seq
        n = samples = 0
        for row in rows:
            samples += row.sampling.get("n", 1)
            e = _Entry(seq, row, now, key(row))
            heapq.heappush(heap, (e.key, seq, e))
            if arrivals is not None:
                arrivals.append(e)
            if row.deadline_at is not None:
                heapq.heappush(self._deadlines, (row.deadline_at, seq, e))
                self._max_predicted = max(self._max_predicted, row.predicted_tokens or 0)
            t = row.predicted_tokens or 0
            lengths[t] = lengths.get(t, 0) + 1
            seq += 1
            n += 1
        self._next_seq = seq
        self._num_pending += n
        self.pending_samples += samples

    def _take(self, e: _Entry) -> None:
        e.is_taken = True
        self._num_pending -= 1
        self.pending_samples -= e.row.sampling.get("n", 1)
        self._lengths[e.row.predicted_tokens or 0] -= 1

    def _key(self, row: Row) -> float:
        p = self.policy
        pred = float(row.predicted_tokens or 0)
        if p == Policy.FIFO:
            return 0.0
        if p == Policy.PRIORITY:
            return float(row.priority)
        if p == Policy.SHORTEST_FIRST:
            return pred
        if p == Policy.LONGEST_FIRST or self.mode == Mode.THROUGHPUT:
            return -pred
        # auto, deadline at risk: most value per predicted token first
        return -(row.value / max(pred, 1.0)) if self.has_values else pred

    def set_mode(self, mode: Mode, count: bool = True) -> bool:
        """Switch auto's regime; re-orders the pool. Returns True when the mode changed."""
        if mode == self.mode or self.policy != Policy.AUTO:
            return False
        self.mode = mode
        self._epoch += 1
        if count:
            self.stats.num_mode_switches += 1
        self.rekey()
        return True

    # -- output --------------------------------------------------------------------------------
    def schedule(self, now: float) -> list[Admission]:
        """Rows to admit now, each with its engine request id."""
        out: list[Admission] = []
        self._at_risk = None  # found at the first pick that asks, for every pick of this call (the same now)
        limit = self.capacity if self.cap is None else min(self.capacity, self.cap)
        while self.is_admitting and self._num_pending and len(self.running) < limit:
            entry, reason = self._pick(now)
            self._take(entry)
            request_id = str(self._next_request)
            self._next_request += 1
            self.running[request_id] = entry.row
            n = entry.row.sampling.get("n", 1)
            entry.row.forecast_tokens = (entry.row.predicted_tokens or 0) * self.forecast_scale
            self.running_predicted += entry.row.forecast_tokens * n
            self.running_samples += n
            entry.row.drawn = self.stats.num_sampled if reason == "sample" else 0
            priority = URGENT_PRIORITY if reason in ("aged", "deadline") else self._engine_priority(entry)
            out.append(Admission(request_id, entry.row, priority, reason))
        return out

    def _pick(self, now: float) -> tuple[_Entry, str]:
        # 1. aging: the oldest row, if it has waited too long
        if self.max_wait_s is not None:
            while self._arrivals and self._arrivals[0].is_taken:
                self._arrivals.popleft()
            if self._arrivals and now - self._arrivals[0].enqueued_at >= self.max_wait_s:
                self.stats.num_aged += 1
                return self._arrivals.popleft(), "aged"
        # 2. per-row deadlines at risk, earliest first
        while self._deadlines and self._deadlines[0][2].is_taken:
            heapq.heappop(self._deadlines)
        e = self._first_at_risk(now)
        if e is not None:
            self.stats.num_deadline_first += 1
            return e, "deadline"
        # 3. one row in sample_every drawn at random where the rows run by predicted length
        draws = bool(self.sample_every) and self.runs_by_length
        self._picked += draws
        if draws and self._picked % self.sample_every == 0:
            for _ in range(64):  # taken rows stay in the heap until they reach its head: draw again
                e = self._heap[self._rng.randrange(len(self._heap))][2]
                if not e.is_taken:
                    self.stats.num_sampled += 1
                    return e, "sample"
        # 4. the policy
        e = self._policy_head()
        heapq.heappop(self._heap)
        return e, "policy"

    def _policy_head(self) -> Optional[_Entry]:
        """The policy's next row."""
        while self._heap and self._heap[0][2].is_taken:
            heapq.heappop(self._heap)
        return self._heap[0][2] if self._heap else None

    def _first_at_risk(self, now: float) -> Optional[_Entry]:
        """The row of the earliest deadline among those at risk. Not only the heap's head: a long row due later
        may be at risk while a short one due sooner is not. The heap is walked in deadline order (a heap of its
        positions) as far as any row could be at risk (twice the longest prediction's time, and a second), at
        most WALK rows, once per schedule() call; its picks take the rows at risk it found in turn. (Taken rows
        leave the heap as they reach its head.)"""
        if not self._deadlines:
            return None
        if self._at_risk is None:
            self._at_risk = deque(self._walk_at_risk(now))
        while self._at_risk:
            e = self._at_risk.popleft()
            if not e.is_taken:
                return e
        return None

    WALK = 1024

    def _walk_at_risk(self, now: float) -> list[_Entry]:
        heap = self._deadlines
        rate = self.per_seq_tokens_per_s
        horizon = now + (2.0 * self._max_predicted / rate if rate else 0.0) + 1.0
        walk, found, seen = [(heap[0][0], heap[0][1], 0)], [], 0
        while walk and seen < self.WALK:
            deadline, _, i = heapq.heappop(walk)
            if deadline > horizon:
                break
            seen += 1
            e = heap[i][2]
            if not e.is_taken and self._is_at_risk(e.row, deadline, now):
                found.append(e)
            for c in (2 * i + 1, 2 * i + 2):
                if c < len(heap):
                    heapq.heappush(walk, (heap[c][0], heap[c][1], c))
        return found

    def _is_at_risk(self, row: Row, deadline: float, now: float) -> bool:
        rate = self.per_seq_tokens_per_s
        needed = (row.predicted_tokens or 0) / rate if rate else 0.0
        return deadline - now <= 2.0 * needed + 1.0  # twice the predicted time: for queueing and prediction error

    def _engine_priority(self, e: _Entry) -> int:
        """The row's priority in vLLM's queue (lower first). Under auto: the order of admission, the rows of a
        later mode first. The policy's order is the pool's, at each admission; a row's own key there (its
        prediction) made the rows admitted before the online predictor's re-prediction (which raised the pool's
        predictions) wait in vLLM's queue behind every row admitted after it: 246 s of a 412 s GSM8K job, and the
        rows drawn at random among them left the forecast's drawn rows uncounted for its second half."""
        if self.policy == Policy.PRIORITY:
            return int(e.row.priority)
        if self.policy == Policy.AUTO:
            return self._next_request - self._epoch * self.EPOCH
        return 0

    def finish(self, request_id: str) -> Row:
        row = self.running.pop(request_id)
        n = row.sampling.get("n", 1)
        self.running_predicted -= (row.forecast_tokens or 0.0) * n
        self.running_samples -= n
        return row

    def requeue_running(self, now: float) -> int:
        """Put every running row back in the pool (the engine lost them); returns how many."""
        rows = list(self.running.values())
        self.drain_running()
        self.add(rows, now)
        return len(rows)

    def drain_running(self) -> list[str]:
        """Forget every running row (they are being aborted); return their request ids."""
        ids = list(self.running)
        self.running.clear()
        self.running_predicted = self.running_samples = 0
        return ids

    def take_expired(self, now: float) -> list[Row]:
        """Pending rows whose own deadline has passed: they will not be run."""
        expired = []
        while self._deadlines and (self._deadlines[0][2].is_taken or self._deadlines[0][0] <= now):
            _, _, e = heapq.heappop(self._deadlines)
            if not e.is_taken:
                self._take(e)
                expired.append(e.row)
        return expired

    def pending_entries(self) -> list[_Entry]:
        """A snapshot of the pool for re-predicting it elsewhere (see repredict)."""
        return [e for _, _, e in self._heap if not e.is_taken]

    def repredict(self, entries: list[_Entry], tokens, buckets) -> int:
        """New predictions for a snapshot from pending_entries(); rows admitted since keep theirs (the engine
        has them). Re-orders the pool; returns how many rows changed. The forecast's scale moves by the ratio of
        the old predictions' sum to the new ones': a re-prediction re-orders the rows and changes their spread,
        and the level the forecast expects of them stays the one the tracker fitted on the rows finished. (An
        online predictor that learned the level from those rows would otherwise be corrected for it twice: on
        the GPU's GSM8K run the remaining tokens came out 1.3-1.5 times too many.)"""
        lengths = self._lengths
        n, old_sum, new_sum = 0, 0, 0
        for e, t, b in zip(entries, tokens, buckets):
            if e.is_taken:
                continue
            row = e.row
            old = row.predicted_tokens or 0
            if old > 0 and t > 0:
                old_sum, new_sum = old_sum + old, new_sum + t
            if t != old:
                lengths[old] -= 1
                lengths[t] = lengths.get(t, 0) + 1
                row.predicted_tokens = t
                n += 1
                if row.deadline_at is not None:
                    self._max_predicted = max(self._max_predicted, t)
            row.bucket = b
        if n:
            self.rekey()
        if old_sum and new_sum:
            self.forecast_scale *= old_sum / new_sum
        return n

    def pending_in_run_order(self) -> tuple[list[float], list[int]]:
        """Predicted lengths of the pending rows and how many rows have each, in the order this policy runs
        them (what the deadline forecast needs). Input and priority order are blind to length: every row is expected
        to have the pending mean. auto runs longest first while the deadline is safe (or none), shortest at risk."""
        lengths, counts = self.pending_lengths()
        if self.runs_longest_first:
            return lengths[::-1], counts[::-1]
        if self.policy in (Policy.FIFO, Policy.PRIORITY) and counts:
            n = sum(counts)
            return [sum(t * c for t, c in zip(lengths, counts)) / n], [n]
        return lengths, counts

    @property
    def runs_longest_first(self) -> bool:
        """Whether the pool runs the rows predicted longest first: longest-first, and auto while the deadline is
        safe (or there is none)."""
        return self.policy == Policy.LONGEST_FIRST or (self.policy == Policy.AUTO and self.mode == Mode.THROUGHPUT)

    @property
    def runs_by_length(self) -> bool:
        """Whether the pool runs by predicted length, either way, as the job's order: rows drawn at random tell the
        forecast how the rows left run. Not auto's deadline order, where they would cost rows done by then."""
        return self.runs_longest_first or self.policy == Policy.SHORTEST_FIRST

    def pending_lengths(self) -> tuple[list[int], list[int]]:
        """Predicted output tokens of the pending rows, as (distinct lengths ascending, rows of each)."""
        items = sorted((t, c) for t, c in self._lengths.items() if c > 0)
        return [t for t, _ in items], [c for _, c in items]

    def rekey(self) -> None:
        """Re-order the pool after rows' predictions changed."""
        heap = []
        for e in self.pending_entries():
            e.key = self._key(e.row)
            heap.append((e.key, e.seq, e))
        heapq.heapify(heap)
        self._heap = heap
