"""The split rule a shard's manifest records: OUTs begun before stop 42 keep the old rule (whole files, else
row groups, else a hash of the id), and shards of two rules in one OUT are refused."""

from __future__ import annotations

import json

import pytest

from fakes import FakeEngine, given
from overnight.pipeline.api import run_job
from overnight.pipeline.input.shards import FRAGMENTS, ROWS, Shard, hash_shard, split
from overnight.pipeline.output.checkpoint import OutputError
from overnight.pipeline.tools.inspection import open_results
from test_shards import _done_per_shard, listing, write_input


@pytest.mark.parametrize("sizes,n", [([100, 137, 174, 211, 248], 3), ([1000, 1, 1, 1], 3), ([5] * 7, 7),
                                     ([300, 10, 10, 10, 10, 10, 10], 2)])
def test_old_rule_files_split_into_disjoint_shares_that_cover_the_input(sizes, n):
    files = listing(sizes)
    shares = [split(files, Shard(k, n), FRAGMENTS) for k in range(n)]
    picked = [f.file_index for s in shares for f in s.fragments]
    assert sorted(picked) == list(range(len(sizes)))             # every file once
    assert all(s.fragments for s in shares)                      # no shard empty
    assert all(s.hash_of is None and "files" in s.how for s in shares)
    loads = [s.num_rows for s in shares]
    assert max(loads) - min(loads) <= max(sizes)                 # greedy: within one fragment of balanced
    for s in shares:                                             # each reads in input order
        assert [f.file_index for f in s.fragments] == sorted(f.file_index for f in s.fragments)
    assert shares == [split(listing(sizes), Shard(k, n), FRAGMENTS) for k in range(n)]  # a pure function


def test_old_rule_fewer_files_than_shards_split_by_row_groups():
    files = listing([400, 400], groups=4)
    shares = [split(files, Shard(k, 4), FRAGMENTS) for k in range(4)]
    assert all("row groups" in s.how for s in shares)
    got = sorted((f.file_index, f.row_group) for s in shares for f in s.fragments)
    assert got == [(i, g) for i in range(2) for g in range(4)]
    assert [s.num_rows for s in shares] == [200] * 4


def test_old_rule_fewer_fragments_than_shards_fall_back_to_a_hash_of_the_id():
    s = split(listing([10, 10]), Shard(1, 3), FRAGMENTS)
    assert s.hash_of == Shard(1, 3) and "hash of the id" in s.how and s.num_rows is None
    # the hash is stable (not Python's per-process hash) and spreads ids
    assert hash_shard("abc", 3) == hash_shard("abc", 3)
    assert {hash_shard(i, 3) for i in range(100)} == {0, 1, 2}


def test_a_row_without_an_id_goes_to_the_shard_of_its_origin(tmp_path):
    """Under the old rule's hash fallback, a row without an id (a request line without a custom_id) is keyed by its origin,
    "<file>#<row>" with the row number the error row names: after blank lines too."""
    from overnight.pipeline.config import InputConfig
    from overnight.pipeline.input.source import open_source

    lines = []
    for i in range(60):
        lines.append("" if i % 3 == 0 else "not a request")   # blank lines shift the line numbers
        lines.append(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                 "body": {"prompt": "hi"}}))
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    origins = []
    for k in range(3):
        src = open_source(InputConfig(path=str(path), batch_rows=16), Shard(k, 3), FRAGMENTS)
        assert src.selection.hash_of == Shard(k, 3)
        for sb in src.batches():
            ids = sb.batch.column("id").to_pylist()
            for i, x in enumerate(ids):
                if x is None:
                    origin = f"requests.jsonl#{sb.row_number(i)}"
                    assert hash_shard(origin, 3) == k, origin
                    origins.append(origin)
    assert len(origins) == len(set(origins)) == 40


def test_an_out_begun_with_the_old_split_keeps_it(tmp_path, cfg, monkeypatch):
    """A shard of an OUT whose shards began before stop 42 splits as they did: with the new rule, shards 1-3
    would answer again most of the 400 rows shard 0 holds, and never some of the small files' rows."""
    import overnight.pipeline.job as job

    inp = write_input(tmp_path / "in", [400, 10, 10, 10], row_group_size=100)
    out = tmp_path / "out"
    with monkeypatch.context() as m:       # shard 0 runs as the code before stop 42 did
        m.setattr(job, "recorded_split", lambda url, shard, fresh: FRAGMENTS)
        assert run_job(cfg(inp, out, cluster={"shard": "0/4"}), engine_factory=given(FakeEngine()),
                       is_tty=False).exit_code == 0
    path = out / "shards" / "00000-of-00004" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["input"]["split_rule"]    # which that code never wrote
    path.write_text(json.dumps(manifest))
    for k in range(1, 4):
        assert run_job(cfg(inp, out, cluster={"shard": f"{k}/4"}), engine_factory=given(FakeEngine()),
                       is_tty=False).exit_code == 0
    assert _done_per_shard(out, 4) == [400, 10, 10, 10]
    con, _ = open_results(str(out))
    assert con.execute("select count(*), count(distinct id) from results").fetchone() == (430, 430)
    # its shards keep the old rule, a shard started over with --fresh too (it splits as the others do); a new
    # OUT splits by equal ranges
    assert job.recorded_split(str(out), Shard(0, 4), fresh=False) == FRAGMENTS
    assert job.recorded_split(str(out), Shard(2, 4), fresh=True) == FRAGMENTS
    assert job.recorded_split(str(tmp_path / "new"), Shard(0, 4), fresh=False) == ROWS


def _legacy_shard(tmp_path, cfg, monkeypatch, inp, out, k, n):
    """Shard k of n as the code before stop 42 ran it: the old rule, and no split_rule in its manifest."""
    import overnight.pipeline.job as job

    with monkeypatch.context() as m:
        m.setattr(job, "recorded_split", lambda url, shard, fresh: FRAGMENTS)
        assert run_job(cfg(inp, out, cluster={"shard": f"{k}/{n}"}), engine_factory=given(FakeEngine()),
                       is_tty=False).exit_code == 0
    path = out / "shards" / f"{k:05d}-of-{n:05d}" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["input"]["split_rule"]
    path.write_text(json.dumps(manifest))


def test_shards_of_two_rules_are_refused(tmp_path, cfg, monkeypatch):
    """Shards of two rules together miss rows and answer others twice. Shard 1 started over with --fresh while
    shard 0 did too, each from the other's old manifest (a race): shard 0 wrote first, as equal ranges, and
    shard 1's resume is refused, until it starts over with --fresh, alone, and splits as shard 0 does."""
    import overnight.pipeline.job as job

    inp = write_input(tmp_path / "in", [400, 10, 10, 10], row_group_size=100)
    out = tmp_path / "out"
    _legacy_shard(tmp_path, cfg, monkeypatch, inp, out, 1, 2)
    one = out / "shards" / "00001-of-00002"
    one.rename(tmp_path / "aside")        # shard 0 sees no other manifest: shard 1's folder was being cleared
    assert run_job(cfg(inp, out, cluster={"shard": "0/2"}), fresh=True, engine_factory=given(FakeEngine()),
                   is_tty=False).exit_code == 0
    (tmp_path / "aside").rename(one)
    assert job.recorded_split(str(out), Shard(1, 2), fresh=False) == FRAGMENTS   # its own, as it began
    with pytest.raises(OutputError, match=r"Shard 0/2 of this job .* split the input by equal row ranges, and "
                                          r"shard 1/2 by whole files and row groups .*: together they would miss "
                                          r"some rows and answer others twice. Run shard 1/2 again with --fresh"):
        run_job(cfg(inp, out, cluster={"shard": "1/2"}), engine_factory=given(FakeEngine()), is_tty=False)
    assert run_job(cfg(inp, out, cluster={"shard": "1/2"}), fresh=True, engine_factory=given(FakeEngine()),
                   is_tty=False).exit_code == 0
    con, _ = open_results(str(out))
    assert con.execute("select count(*), count(distinct id) from results").fetchone() == (430, 430)


def test_a_shard_that_meets_another_rule_after_writing_its_manifest_leaves_nothing(tmp_path, cfg, monkeypatch):
    """The check after the manifest's write: the other shard's manifest came while this one opened. A shard just
    begun removes its manifest again, so that the other, which wrote first, runs on unrefused."""
    import overnight.pipeline.job as job

    inp = write_input(tmp_path / "in", [400, 10, 10, 10], row_group_size=100)
    out = tmp_path / "out"
    _legacy_shard(tmp_path, cfg, monkeypatch, inp, out, 1, 2)
    monkeypatch.setattr(job, "recorded_split", lambda url, shard, fresh: ROWS)
    real = job._check_other_shards
    monkeypatch.setattr(job, "_check_other_shards", lambda *a, **k: None)   # shard 1's manifest not there yet
    with pytest.raises(OutputError, match="together they would miss some rows"):
        run_job(cfg(inp, out, cluster={"shard": "0/2"}), engine_factory=given(FakeEngine()), is_tty=False)
    assert not (out / "shards" / "00000-of-00002" / "manifest.json").exists()
    monkeypatch.setattr(job, "_check_other_shards", real)
    monkeypatch.setattr(job, "recorded_split", lambda url, shard, fresh: FRAGMENTS)  # (shard 1's, as it finds)
    assert run_job(cfg(inp, out, cluster={"shard": "1/2"}), engine_factory=given(FakeEngine()),
                   is_tty=False).exit_code == 0


def test_an_unsharded_run_and_a_shard_begun_together_do_not_both_write(tmp_path, cfg, monkeypatch):
    """Both found OUT empty at the layout's check, before either held its lock (two locks: OUT's and the shard
    folder's); the unsharded run wrote its manifest first. The shard, just begun, meets it at the check after its
    own manifest's write, removes its manifest and is refused: every id is answered once, by the unsharded run."""
    import overnight.pipeline.job as job

    inp = write_input(tmp_path / "in", [30, 30])
    out = tmp_path / "out"
    real = job.check_layout
    calls = []

    def first_passes(url, shard, ray=False):  # the shard's first check ran before the unsharded run began
        calls.append(shard)
        if len(calls) > 1:
            real(url, shard, ray)

    job_out = out / "shards" / "00000-of-00002"
    (out / "shards").mkdir(parents=True)
    run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)  # the unsharded run, first
    monkeypatch.setattr(job, "check_layout", first_passes)
    with pytest.raises(OutputError, match="holds the results of an unsharded run, and this run is shard 0/2"):
        run_job(cfg(inp, out, cluster={"shard": "0/2"}), engine_factory=given(FakeEngine()), is_tty=False)
    assert not (job_out / "manifest.json").exists() and not list(job_out.glob("parts/*.parquet"))
    monkeypatch.setattr(job, "check_layout", real)
    con, _ = open_results(str(out))
    assert con.execute("select count(*), count(distinct id) from results").fetchone() == (60, 60)
    assert run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False).exit_code == 0


def test_a_shard_refuses_an_out_a_live_ray_driver_holds_before_its_workers_wrote(tmp_path, cfg):
    """A Ray driver marks OUT as Ray's by its workers' folders, written only as the workers start (after Ray's own
    start): meanwhile its lock says so. A shard run refuses it then, and runs once the driver has let go."""
    from overnight.pipeline.output.checkpoint import OutputDir
    from overnight.pipeline.output.lock import RunLock

    inp = write_input(tmp_path / "in", [30, 30])
    out = tmp_path / "out"
    driver = RunLock(OutputDir(str(out)), split="ray")
    driver.acquire()
    try:
        with pytest.raises(OutputError, match="a run on Ray workers, running now, and this run is shard 0/2"):
            run_job(cfg(inp, out, cluster={"shard": "0/2"}), engine_factory=given(FakeEngine()), is_tty=False)
        assert not (out / "shards").exists()
    finally:
        driver.release()
    assert run_job(cfg(inp, out, cluster={"shard": "0/2"}), engine_factory=given(FakeEngine()),
                   is_tty=False).exit_code == 0


def test_the_ray_driver_checks_the_layout_again_once_it_holds_the_lock(tmp_path, cfg, monkeypatch):
    """An unsharded run that ended between the Ray driver's first check and its lock: the check under the lock
    refuses before Ray starts, and leaves the lock free."""
    import overnight.pipeline.cluster.ray_job as ray_job
    from overnight.pipeline.output.lock import LOCK

    inp = write_input(tmp_path / "in", [30, 30])
    out = tmp_path / "out"
    real = ray_job.RunLock

    class LateLock(real):
        def acquire(self):
            run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)  # the unsharded run, meanwhile
            super().acquire()

    monkeypatch.setattr(ray_job, "RunLock", LateLock)
    class NoRay:
        def __getattr__(self, name):
            pytest.fail(f"Ray was used: ray.{name}")

    monkeypatch.setattr(ray_job, "_ray", NoRay)
    with pytest.raises(OutputError, match="holds the results of an unsharded run, and this run is on Ray workers"):
        ray_job.run_on_ray(cfg(inp, out), False, 2, is_tty=False)
    assert not (out / "workers").exists() and not (out / LOCK).exists()


def test_a_shard_refuses_an_input_rewritten_with_the_same_row_groups_even_with_fresh(tmp_path, cfg):
    """A file rewritten with its ids reversed, in row groups of the same sizes: the listing without the files'
    versions was the same, and shard 1 answered shard 0's ids again while half the ids were never answered (a
    completed job). --fresh clears one shard's folder only, so it is refused too: a shard not run again would keep
    the old split's rows. The new input is answered in an emptied OUT."""
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    from overnight.pipeline.output.checkpoint import OutputUsageError

    inp = tmp_path / "in.parquet"
    ids = [f"r{i:03d}" for i in range(100)]
    pq.write_table(pa.table({"id": ids, "prompt": [f"q {i}" for i in ids]}), inp, row_group_size=50)
    out = tmp_path / "out"

    def shard(k, fresh=False):
        return run_job(cfg(inp, out, cluster={"shard": f"{k}/2"}), engine_factory=given(FakeEngine()), is_tty=False,
                       fresh=fresh)

    assert shard(0).num_done == 50
    before = os.stat(inp).st_mtime_ns
    pq.write_table(pa.table({"id": ids[::-1], "prompt": [f"q {i}" for i in ids[::-1]]}), inp, row_group_size=50)
    os.utime(inp, ns=(before + 10**9, before + 10**9))    # (a rewrite within the clock's tick is seen by size only)
    with pytest.raises(OutputUsageError, match="has changed since shard 0/2 of this job ran .* another --out "
                                               f"\\(or after removing {out}\\)"):
        shard(1)
    # shard 0 alone had run: its --fresh starts the job over, and shard 1 follows
    assert shard(0, fresh=True).num_done == 50 and shard(1).num_done == 50
    con, _ = open_results(str(out))
    assert con.execute("select count(*), count(distinct id) from results").fetchone() == (100, 100)
    pq.write_table(pa.table({"id": ids, "prompt": ids}), inp, row_group_size=50)
    os.utime(inp, ns=(before + 2 * 10**9, before + 2 * 10**9))
    with pytest.raises(OutputUsageError, match="has changed since shard 1/2"):   # the other shard's folder
        shard(0, fresh=True)
