"""The scheduler as a pure state machine: hand-built rows, a fake clock, no engine."""

import pytest

from overnight.pipeline.records import Row
from overnight.pipeline.scheduling.scheduler import URGENT_PRIORITY, Mode, Policy, Scheduler


def row(i, pred=100, priority=0, value=1.0, deadline=None):
    return Row(id=i, prompt_token_ids=[1, 2], sampling={"max_tokens": 512}, passthrough={}, origin=f"f#{i}",
               predicted_tokens=pred, priority=priority, value=value, deadline_at=deadline)


def admit_ids(s, now=0.0):
    return [a.row.id for a in s.schedule(now)]


def drain(s, now=0.0):
    """Admit and finish one row at a time; the full admission order."""
    order = []
    while s.num_pending:
        (a,) = s.schedule(now)
        order.append(a.row.id)
        s.finish(a.request_id)
    return order


def one_at_a_time(policy, **kw):
    return Scheduler(max_running=1, queue_factor=0, policy=policy, **kw)


PREDS = {"a": 50, "b": 400, "c": 10, "d": 200}


@pytest.mark.parametrize("policy,expected", [
    ("fifo", ["a", "b", "c", "d"]),
    ("longest-first", ["b", "d", "a", "c"]),
    ("shortest-first", ["c", "a", "d", "b"]),
    ("auto", ["b", "d", "a", "c"]),  # throughput-first while the deadline is safe
])
def test_policies_order(policy, expected):
    s = one_at_a_time(policy)
    s.add([row(k, p) for k, p in PREDS.items()])
    assert drain(s) == expected


def test_the_orders_by_length_draw_one_row_in_eight_at_random():
    """With sample_every 8, under longest-first and shortest-first (and auto while the deadline is safe) every
    eighth admission is a pending row drawn at random, the same each run (seeded), and marked with the draw's number
    (1, 2, ...); the others go in the policy's order. fifo, auto near a deadline and sample_every 0 draw none."""
    preds = [1000 - i for i in range(200)]  # row i: the i-th longest

    def order(policy, mode=None, sample_every=8):
        s = one_at_a_time(policy, sample_every=sample_every)
        s.add([row(i, p) for i, p in enumerate(preds)])
        if mode is not None:
            s.set_mode(mode)
        reasons, drawn = [], []
        while s.num_pending:
            (a,) = s.schedule(0.0)
            reasons.append(a.reason)
            drawn.append(a.row.drawn)
            s.finish(a.request_id)
        samples = [i for i, r in enumerate(reasons) if r == "sample"]
        assert [drawn[i] for i in samples] == list(range(1, len(samples) + 1))
        assert not any(d for i, d in enumerate(drawn) if i not in samples)
        return reasons, s

    for policy in ("longest-first", "auto", "shortest-first"):
        reasons, s = order(policy)
        assert [i for i, r in enumerate(reasons) if r == "sample"][:5] == [7, 15, 23, 31, 39]
        assert s.stats.num_sampled == reasons.count("sample") >= 20
    s = one_at_a_time("shortest-first", sample_every=8)
    s.add([row(i, p) for i, p in enumerate(preds)])
    first = drain(s)
    assert first[:7] == list(range(199, 192, -1)) and first[7] < 191  # shortest first, the eighth drawn
    s = one_at_a_time("longest-first", sample_every=8)
    s.add([row(i, p) for i, p in enumerate(preds)])
    first = drain(s)
    assert first[:7] == list(range(7)) and first[7] > 8  # the eighth: drawn from the 193 left
    s2 = one_at_a_time("longest-first", sample_every=8)
    s2.add([row(i, p) for i, p in enumerate(preds)])
    assert drain(s2) == first  # seeded
    assert order("longest-first", sample_every=0)[0].count("sample") == 0
    for policy, mode in (("fifo", None), ("auto", Mode.DEADLINE)):
        assert order(policy, mode)[0].count("sample") == 0


def test_a_drawn_row_goes_to_the_engine_in_its_turn():
    """Under auto, a row drawn at random goes to vLLM's queue in the order it was admitted, as every row does: with
    its own prediction as its priority it waited there behind every longer row admitted after it. Nor ahead of
    every row, as an aged one does."""
    drawn = 0
    for seed in range(4):
        s = Scheduler(max_running=8, queue_factor=0, policy="auto", sample_every=2, seed=seed)
        s.add([row(str(i), 100 + 10 * i) for i in range(40)])
        admitted = s.schedule(0.0)
        priorities = [a.priority for a in admitted]
        assert priorities == sorted(priorities) and len(set(priorities)) == len(priorities), seed
        assert all(p > URGENT_PRIORITY for p in priorities)
        drawn += sum(a.reason == "sample" for a in admitted)
    assert drawn >= 8


def test_rows_repredicted_longer_do_not_overtake_those_waiting_in_vllms_queue():
    """The online predictor's re-prediction raised the pool's predictions (GSM8K under auto: 135-155 tokens before,
    255-257 after). With its prediction as each row's priority in vLLM's queue, the rows admitted before it waited
    there behind every row admitted after it, 246 s of a 412 s job. They keep their turn; a mode switch's rows
    still go first."""
    s = Scheduler(max_running=2, queue_factor=1, policy="auto")
    s.add([row(i, 150) for i in range(20)])
    before = s.schedule(0)
    s.finish(before[0].request_id)
    pool = s.pending_entries()
    assert s.repredict(pool, [256] * len(pool), [0] * len(pool)) == len(pool)
    (after,) = s.schedule(0)
    assert after.priority > max(a.priority for a in before)
    s.set_mode(Mode.DEADLINE)
    s.finish(before[1].request_id)
    (switched,) = s.schedule(0)
    assert switched.priority < min(a.priority for a in before + [after])


def test_priority_policy_lower_first_then_input_order():
    s = one_at_a_time("priority")
    s.add([row("a", priority=5), row("b", priority=1), row("c", priority=5), row("d", priority=-2)])
    assert drain(s) == ["d", "b", "a", "c"]


def test_auto_deadline_mode_is_shortest_first_and_switches_back():
    s = one_at_a_time("auto")
    s.add([row(k, p) for k, p in PREDS.items()])
    assert s.set_mode(Mode.DEADLINE) is True
    assert s.set_mode(Mode.DEADLINE) is False
    (a,) = s.schedule(0)
    assert a.row.id == "c"
    s.finish(a.request_id)
    s.set_mode(Mode.THROUGHPUT)
    assert drain(s) == ["b", "d", "a"]
    assert s.stats.num_mode_switches == 2


def test_auto_deadline_mode_uses_value_per_token_when_values_exist():
    s = one_at_a_time("auto", has_values=True)
    # value per predicted token: a 1/50=0.02, b 100/400=0.25, c 0.1/10=0.01, d 30/200=0.15
    s.add([row("a", 50, value=1), row("b", 400, value=100), row("c", 10, value=0.1), row("d", 200, value=30)])
    s.set_mode(Mode.DEADLINE)
    assert drain(s) == ["b", "d", "a", "c"]


def test_engine_priority_keeps_the_value_per_token_order_for_vllms_queue():
    # values per predicted token 0.8, 0.02, 0.25, 0.0: vLLM's queue (lower first) must keep their order
    s = Scheduler(max_running=4, queue_factor=0, policy="auto", has_values=True)
    s.add([row("a", 10, value=8), row("b", 50, value=1), row("c", 400, value=100), row("d", 20, value=0)])
    s.set_mode(Mode.DEADLINE)
    admitted = s.schedule(0)
    assert [a.row.id for a in admitted] == ["a", "c", "b", "d"]
    priorities = [a.priority for a in admitted]
    assert priorities == sorted(priorities) and len(set(priorities)) == 4


def test_engine_priority_lets_rows_admitted_after_a_switch_overtake_waiting_ones():
    s = Scheduler(max_running=2, queue_factor=1, policy="auto")
    s.add([row(i, p) for i, p in enumerate([100, 300, 200, 50, 20, 10])])
    before = s.schedule(0)
    s.set_mode(Mode.DEADLINE)
    s.finish(before[0].request_id)
    (after,) = s.schedule(0)
    assert after.row.id == 5  # the shortest left
    assert after.priority < min(a.priority for a in before)
    assert [a.priority for a in one_at_a_time("fifo").schedule(0)] == []


def test_fifo_engine_priority_is_zero():
    s = Scheduler(max_running=2, queue_factor=0, policy="fifo")
    s.add([row(1), row(2)])
    assert {a.priority for a in s.schedule(0)} == {0}


def test_keeps_the_engine_topped_up_but_not_flooded():
    s = Scheduler(max_running=4, queue_factor=0.5, policy="fifo")
    assert s.capacity == 6 and s.lookahead == 6
    s.add([row(i) for i in range(10)])
    assert not s.wants_rows()
    admitted = s.schedule(0)
    assert [a.row.id for a in admitted] == [0, 1, 2, 3, 4, 5]
    assert s.schedule(0) == []          # full: nothing more until something finishes
    s.finish(admitted[0].request_id)
    s.finish(admitted[1].request_id)
    assert admit_ids(s) == [6, 7]
    assert s.num_pending == 2 and s.num_running == 6


def test_lookahead_holds_more_rows_than_one_refill():
    s = Scheduler(max_running=2, queue_factor=0, policy="longest-first", lookahead=100)
    s.add([row(i) for i in range(50)])
    assert s.wants_rows()


def test_aging_promotes_a_row_that_waited_too_long():
    s = one_at_a_time("longest-first", max_wait_s=10)
    s.add([row("short", 5)], now=0)
    s.add([row(f"long{i}", 500) for i in range(3)], now=1)
    order = []
    for t in (2, 3, 12):
        (a,) = s.schedule(t)
        order.append((a.row.id, a.reason))
        s.finish(a.request_id)
    assert order == [("long0", "policy"), ("long1", "policy"), ("short", "aged")]
    assert s.stats.num_aged == 1
    (a,) = s.schedule(13)
    assert (a.row.id, a.reason) == ("long2", "aged")  # waited 12 s by now, more than the 10 s limit


@pytest.mark.parametrize("policy", ["priority", "auto"])
def test_rows_picked_for_their_wait_or_deadline_go_ahead_in_vllms_queue(policy):
    # the engine's waiting queue is ordered by the priorities sent: an aged row, or one whose deadline is at
    # risk, must come before every row the policy admits, whatever its own priority
    s = Scheduler(max_running=2, queue_factor=2, policy=policy, max_wait_s=10)
    s.per_seq_tokens_per_s = 10.0
    s.add([row("old", 50, priority=9)], now=0)
    s.add([row(f"p{i}", 50) for i in range(4)] + [row("due", 100, priority=9, deadline=30.0)], now=5)
    admitted = s.schedule(12.0)
    by_reason = {a.row.id: (a.reason, a.priority) for a in admitted}
    assert by_reason["old"][0] == "aged" and by_reason["due"][0] == "deadline"
    policy_priorities = [p for r, p in by_reason.values() if r == "policy"]
    assert policy_priorities and max(by_reason["old"][1], by_reason["due"][1]) < min(policy_priorities)


def test_without_aging_shortest_first_can_starve_a_long_row():
    s = one_at_a_time("shortest-first")
    s.add([row("long", 500)], now=0)
    for t in range(5):
        s.add([row(f"s{t}", 5)], now=t)
        (a,) = s.schedule(t)
        assert a.row.id == f"s{t}"
        s.finish(a.request_id)


def test_per_row_deadline_at_risk_goes_first_earliest_first():
    s = one_at_a_time("longest-first")
    s.per_seq_tokens_per_s = 10.0  # a 100-token row needs ~10 s: at risk within 2 x 10 + 1 s of its deadline
    s.add([row("big", 400), row("late", 100, deadline=1000.0), row("soon", 100, deadline=50.0),
           row("sooner", 100, deadline=30.0)])
    got = []
    for now in (10.0, 10.0, 30.0, 30.0):
        (a,) = s.schedule(now)
        got.append((a.row.id, a.reason))
        s.finish(a.request_id)
    # at 10 s only "sooner" is at risk; "soon" becomes at risk by 30 s; "late" never is
    assert got == [("sooner", "deadline"), ("big", "policy"), ("soon", "deadline"), ("late", "policy")]
    assert s.stats.num_deadline_first == 2


def test_a_long_row_at_risk_goes_first_though_a_short_one_is_due_sooner():
    s = Scheduler(max_running=1, queue_factor=0, policy="fifo")
    s.per_seq_tokens_per_s = 50.0
    # "short" is due at 100 s and needs 0.2 s: safe. "long" is due at 150 s and needs 80 s (x2, +1): at risk.
    s.add([row("first", 10), row("short", 10, deadline=100.0), row("long", 4000, deadline=150.0)])
    got = [(a.row.id, a.reason) for a in s.schedule(0.0)]
    assert got == [("long", "deadline")] and s.stats.num_deadline_first == 1
    for rid in list(s.running):
        s.finish(rid)
    assert [(a.row.id, a.reason) for a in s.schedule(0.0)] == [("first", "policy")]


def test_the_deadline_heap_is_walked_once_per_schedule_call():
    # 500 rows due at once and not at risk, one long row at risk: a refill of 64 walks the heap once, not 64 times
    # (and at most Scheduler.WALK rows of it)
    s = Scheduler(max_running=64, queue_factor=0, policy="fifo")
    s.per_seq_tokens_per_s = 50.0
    s.add([row(f"r{i}", 10, deadline=100.0) for i in range(500)] + [row("long", 4000, deadline=150.0)])
    walks = []
    walk = s._walk_at_risk
    s._walk_at_risk = lambda now: walks.append(now) or walk(now)
    got = s.schedule(0.0)
    assert len(got) == 64 and (got[0].row.id, got[0].reason) == ("long", "deadline") and len(walks) == 1


def test_rows_whose_deadline_passed_are_taken_out():
    s = one_at_a_time("fifo")
    s.add([row("ok"), row("gone", deadline=5.0), row("later", deadline=100.0)])
    expired = s.take_expired(10.0)
    assert [r.id for r in expired] == ["gone"]
    assert s.num_pending == 2
    assert drain(s, 10.0) == ["ok", "later"]


def test_stop_admitting():
    s = Scheduler(max_running=2, queue_factor=0, policy="fifo")
    s.add([row(1), row(2), row(3)])
    s.is_admitting = False
    assert s.schedule(0) == []


def test_repredict_reorders_the_pool_and_leaves_admitted_rows_alone():
    s = Scheduler(max_running=1, queue_factor=0, policy="longest-first")
    s.add([row("a", 10), row("b", 20), row("c", 5)])
    snapshot = s.pending_entries()
    (first,) = s.schedule(0)  # b is admitted after the snapshot was taken
    assert first.row.id == "b"
    new = {"a": 99, "b": 1, "c": 300}
    changed = s.repredict(snapshot, [new[e.row.id] for e in snapshot], [7] * len(snapshot))
    assert changed == 2 and first.row.predicted_tokens == 20  # the engine has b: its prediction stays
    assert s.pending_lengths() == ([99, 300], [1, 1])
    s.finish(first.request_id)
    assert drain(s) == ["c", "a"]
    assert s.pending_lengths() == ([], [])


def test_pending_lengths_follow_adds_admissions_and_expiry():
    s = Scheduler(max_running=1, queue_factor=0, policy="shortest-first")
    s.add([row("x", 30), row("y", 10), row("z", 30), row("w", 50, deadline=5.0)])
    assert s.pending_lengths() == ([10, 30, 50], [1, 2, 1])
    (a,) = s.schedule(0)
    assert a.row.id == "y" and s.pending_lengths() == ([30, 50], [2, 1])
    assert [r.id for r in s.take_expired(now=6.0)] == ["w"]
    assert s.pending_lengths() == ([30], [2])
    assert s.drain_running() == [a.request_id] and s.num_running == 0
    assert Policy("auto") is Policy.AUTO

