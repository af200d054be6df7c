from overnight.pipeline.records import Row
from overnight.pipeline.scheduler import Scheduler


def rows(n, start=0):
    return [Row(id=i, prompt_token_ids=[1, 2], sampling={"max_tokens": 8}, passthrough={}, origin=f"f#{i}")
            for i in range(start, start + n)]


def test_keeps_the_engine_topped_up_but_not_flooded():
    s = Scheduler(max_running=4, queue_factor=0.5)
    assert s.capacity == 6
    assert s.wants_rows()
    s.add(rows(10))
    assert not s.wants_rows()
    admitted = s.schedule()
    assert [r.id for _, r in admitted] == [0, 1, 2, 3, 4, 5]
    assert s.schedule() == []          # full: nothing more until something finishes
    s.finish(admitted[0][0])
    s.finish(admitted[1][0])
    assert [r.id for _, r in s.schedule()] == [6, 7]
    assert s.num_pending == 2 and s.num_running == 6
    assert s.wants_rows()


def test_request_ids_are_unique_and_drain_forgets_running():
    s = Scheduler(max_running=2, queue_factor=0)
    s.add(rows(3))
    first = [rid for rid, _ in s.schedule()]
    assert len(set(first)) == 2
    assert sorted(s.drain_running()) == sorted(first)
    assert s.num_running == 0 and not s.is_done()
    (rid, row), = s.schedule()
    assert rid not in first and row.id == 2
    s.finish(rid)
    assert s.is_done()
