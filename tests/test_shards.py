"""Shards: --shard K/N reads only its share of the input (equal ranges of rows; the rule an older OUT keeps is in
test_shard_rules.py), writes its own folder in OUT, and all of them together answer every id exactly once;
`overnight status` and `inspect` read every shard."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import overnight_cmd
from fakes import FakeEngine, given
from overnight.pipeline.api import run_job
from overnight.pipeline.config import ConfigError
from overnight.pipeline.input.shards import ROWS, Shard, assign, fragments_of, parse_shard, split
from overnight.pipeline.input.source import InputFile
from overnight.pipeline.output.checkpoint import OutputError
from overnight.pipeline.tools.inspection import open_results
from overnight.pipeline.tools.status import job_status


def listing(sizes, groups=1):
    """InputFiles of the given row counts, each in ``groups`` row groups."""
    files = []
    for i, n in enumerate(sizes):
        per = [n // groups + (1 if g < n % groups else 0) for g in range(groups)]
        files.append(InputFile(f"/in/f{i}.parquet", f"f{i}.parquet", n, pa.schema([]), tuple(per)))
    return files


def write_input(folder: Path, sizes, row_group_size=None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for f, n in enumerate(sizes):
        t = pa.table({"id": [f"f{f}-{i}" for i in range(n)], "prompt": [f"question {f} {i}" for i in range(n)]})
        pq.write_table(t, folder / f"part-{f}.parquet", row_group_size=row_group_size)
    return folder


# -- the split ------------------------------------------------------------------------------------------

def rows_of(files, share):
    """(file, row) of every row a share reads."""
    out = []
    for f in share.fragments:
        start = 0 if f.row_group is None else sum(files[f.file_index].row_groups[:f.row_group])
        lo, hi = f.rows if f.rows else (0, f.num_rows)
        out += [(f.file_index, start + r) for r in range(lo, hi)]
    return out


@pytest.mark.parametrize("sizes,n,groups", [([100, 137, 174, 211, 248], 3, 1), ([1000, 1, 1, 1], 3, 1),
                                            ([4000, 10, 10, 10], 4, 4), ([5] * 7, 7, 1), ([5] * 7, 3, 2),
                                            ([300, 10, 10, 10, 10, 10, 10], 2, 3), ([10, 10], 3, 1),
                                            ([0, 7, 0, 5], 4, 1), ([2], 5, 1)])
def test_shards_are_equal_ranges_of_rows_that_cover_the_input_once(sizes, n, groups):
    files = listing(sizes, groups)
    shares = [split(files, Shard(k, n)) for k in range(n)]
    assert all(s.rule == ROWS and s.hash_of is None for s in shares)
    rows = [rows_of(files, s) for s in shares]
    every = [(i, r) for i, size in enumerate(sizes) for r in range(size)]
    assert [x for share in rows for x in share] == every        # each row once, the shards in input order
    loads = [s.num_rows for s in shares]
    assert loads == [len(r) for r in rows] and max(loads) - min(loads) <= 1
    assert shares == [split(listing(sizes, groups), Shard(k, n)) for k in range(n)]  # a pure function


def test_a_range_takes_whole_files_and_row_groups_and_slices_only_at_its_ends():
    files = listing([4000, 10, 10, 10], groups=4)   # one large file and three small ones: 1007 or 1008 rows each
    first, last = split(files, Shard(0, 4)), split(files, Shard(3, 4))
    assert [(f.file_index, f.row_group, f.rows) for f in first.fragments] == [(0, 0, None), (0, 1, (0, 7))]
    assert [(f.file_index, f.row_group, f.rows) for f in last.fragments] == [(0, 3, (22, 1000)), (1, None, None),
                                                                             (2, None, None), (3, None, None)]
    assert "rows 3022 to 4029" in last.how and "in 4 files" in last.how


def test_largest_first_to_the_least_loaded():
    whole, _ = fragments_of(listing([1, 9, 5, 5]))
    assert [[f.num_rows for f in share] for share in assign(whole, 2)] == [[1, 9], [5, 5]]


@pytest.mark.parametrize("text,env,shards,expected", [
    ("2/4", {}, None, Shard(2, 4)),
    ("auto", {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "4"}, None, Shard(3, 4)),
    ("auto", {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "1"}, None,
     Shard(0, 4)),
    ("auto", {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_MIN": "0",
              "SLURM_ARRAY_TASK_STEP": "2"}, None, Shard(2, 3)),
    ("auto", {"JOB_COMPLETION_INDEX": "5"}, 8, Shard(5, 8)),
    ("auto", {"JOB_COMPLETION_INDEX": "0", "OVERNIGHT_SHARDS": "2"}, None, Shard(0, 2)),
])
def test_shard_spec(text, env, shards, expected):
    assert parse_shard(text, shards, env) == expected


@pytest.mark.parametrize("text,env,shards,message", [
    ("auto", {}, None, "looks for $SLURM_ARRAY_TASK_ID and $SLURM_ARRAY_TASK_COUNT"),
    ("auto", {"JOB_COMPLETION_INDEX": "1"}, None, "pass --shards N"),
    ("auto", {"JOB_COMPLETION_INDEX": "4"}, 4, "must be below N"),
    ("4/4", {}, None, "must be below N"),
    ("1of4", {}, None, "give K/N"),
])
def test_bad_shard_specs_say_what_was_looked_for(text, env, shards, message):
    with pytest.raises(ConfigError) as e:
        parse_shard(text, shards, env)
    assert message in str(e.value)


def test_what_only_the_job_resolves_exits_2_as_bad_usage(tmp_path, write_parquet, tiny_model):
    """--shard auto and a deadline are resolved by the job, not by the options' checks: their errors are bad usage
    (2) still, as a bad --shard K/N's are, which a scheduler does not retry."""
    import subprocess

    from conftest import overnight_cmd

    inp = write_parquet({"id": ["a"], "prompt": ["hi"]})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_ARRAY", "JOB_COMPLETION", "OVERNIGHT_"))}
    for extra, more in (({}, []), ({"JOB_COMPLETION_INDEX": "4"}, ["--shards", "4"])):
        r = subprocess.run([*overnight_cmd(), "run", inp, "--out", str(tmp_path / "out"), "--model", tiny_model,
                            "--engine", "echo", "--shard", "auto", *more], env={**env, **extra},
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "Error: " in r.stderr, (r.returncode, r.stderr[-1000:])
    # as a deadline's, which the job resolves too
    for bad in (["--time-budget", "5x"], ["--deadline", "2020-01-01T00:00"]):
        r = subprocess.run([*overnight_cmd(), "run", inp, "--out", str(tmp_path / "out"), "--model", tiny_model,
                            "--engine", "echo", *bad], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "Error: " in r.stderr, (r.returncode, r.stderr[-1000:])


# -- shards as jobs -------------------------------------------------------------------------------------

def test_shards_read_only_their_fragments_and_together_answer_each_id_once(tmp_path, cfg, monkeypatch):
    inp = write_input(tmp_path / "in", [30, 40, 50, 60, 70])
    out = tmp_path / "out"
    opened = []   # files whose rows were read (footers are read by every shard, to compute the split)
    real_init, real_iter = pq.ParquetFile.__init__, pq.ParquetFile.iter_batches

    def spy_init(self, source, *args, **kwargs):
        self._spy_name = os.path.basename(getattr(source, "path", None) or str(source))
        return real_init(self, source, *args, **kwargs)

    def spy_iter(self, *args, **kwargs):
        opened.append(self._spy_name)
        return real_iter(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "__init__", spy_init)
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy_iter)
    for k in range(3):
        opened.clear()
        s = run_job(cfg(inp, out, cluster={"shard": f"{k}/3"}), engine_factory=given(FakeEngine()), is_tty=False)
        assert s.exit_code == 0
        mine = {f"part-{f.file_index}.parquet" for f in split(_listing(inp), Shard(k, 3)).fragments}
        assert set(opened) == mine             # it read the rows of its own files, and of no other
    con, manifest = open_results(str(out))
    n, distinct = con.execute("select count(*), count(distinct id) from results").fetchone()
    assert n == distinct == 250
    assert sorted(os.listdir(out / "shards")) == ["00000-of-00003", "00001-of-00003", "00002-of-00003"]
    st = job_status(str(out))
    assert (st["state"], st["rows_done"], st["rows_total"], st["exit_code"]) == ("completed", 250, 250, 0)
    assert [p["shard"] for p in st["per_shard"]] == ["0/3", "1/3", "2/3"]
    assert manifest["counts"]["num_done"] == 250 and len(manifest["shards"]) == 3


def _listing(inp):
    from overnight.pipeline.config import InputConfig
    from overnight.pipeline.input.source import ParquetSource
    return ParquetSource(InputConfig(path=str(inp))).files


def test_hash_shards_cover_a_small_input_once(tmp_path, cfg):
    inp = write_input(tmp_path / "in", [40])
    out = tmp_path / "out"
    for k in range(3):
        assert run_job(cfg(inp, out, cluster={"shard": f"{k}/3"}), engine_factory=given(FakeEngine()),
                       is_tty=False).exit_code == 0
    con, _ = open_results(str(out))
    assert con.execute("select count(*), count(distinct id) from results").fetchone() == (40, 40)
    per = [json.loads((out / "shards" / f"0000{k}-of-00003" / "manifest.json").read_text())["counts"]["num_done"]
           for k in range(3)]
    assert sum(per) == 40 and all(per)


def _done_per_shard(out, n):
    return [json.loads((out / "shards" / f"{k:05d}-of-{n:05d}" / "manifest.json").read_text())["counts"]["num_done"]
            for k in range(n)]


def test_one_large_file_and_small_ones_give_shards_of_equal_size(tmp_path, cfg):
    """Before stop 42 these four files gave shards of 400, 10, 10 and 10 rows: the job took as long as its one
    large shard."""
    inp = write_input(tmp_path / "in", [400, 10, 10, 10], row_group_size=100)
    out = tmp_path / "out"
    for k in range(4):
        assert run_job(cfg(inp, out, cluster={"shard": f"{k}/4"}), engine_factory=given(FakeEngine()),
                       is_tty=False).exit_code == 0
    assert _done_per_shard(out, 4) == [107, 108, 107, 108]
    con, _ = open_results(str(out))
    assert con.execute("select count(*), count(distinct id) from results").fetchone() == (430, 430)
    m = json.loads((out / "shards" / "00001-of-00004" / "manifest.json").read_text())
    assert m["input"]["split_rule"] == ROWS and "rows 107 to 214" in m["input"]["split"]


def test_jsonl_shards_slice_chunks_and_answer_each_line_once(tmp_path, cfg):
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": [{"role": "user", "content": f"q {i}"}]}}) for i in range(50)]
    (tmp_path / "a.jsonl").write_text("\n".join(lines[:45]) + "\n")
    (tmp_path / "b.jsonl").write_text("\n".join(lines[45:]) + "\n")
    out = tmp_path / "out"
    for k in range(3):
        assert run_job(cfg(tmp_path / "*.jsonl", out, cluster={"shard": f"{k}/3"}),
                       engine_factory=given(FakeEngine()), is_tty=False).exit_code == 0
    assert _done_per_shard(out, 3) == [16, 17, 17]
    con, _ = open_results(str(out))
    assert con.execute("select count(*), count(distinct id) from results").fetchone() == (50, 50)


def test_changing_the_number_of_shards_or_the_settings_is_refused(tmp_path, cfg):
    inp = write_input(tmp_path / "in", [10, 10, 10])
    out = tmp_path / "out"
    run_job(cfg(inp, out, cluster={"shard": "0/3"}), engine_factory=given(FakeEngine()), is_tty=False)
    with pytest.raises(OutputError, match="split into 3 shards.*this run is shard 0/2.*--shard K/3"):
        run_job(cfg(inp, out, cluster={"shard": "0/2"}), engine_factory=given(FakeEngine()), is_tty=False)
    with pytest.raises(OutputError, match="this run has no --shard"):
        run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    with pytest.raises(OutputError, match="Shard 0/3 of this job .* other settings .*max_tokens"):
        run_job(cfg(inp, out, cluster={"shard": "1/3"}, sampling={"max_tokens": 7}),
                engine_factory=given(FakeEngine()), is_tty=False)
    other = tmp_path / "plain"
    run_job(cfg(inp, other), engine_factory=given(FakeEngine()), is_tty=False)
    with pytest.raises(OutputError, match="an unsharded run"):
        run_job(cfg(inp, other, cluster={"shard": "0/3"}), engine_factory=given(FakeEngine()), is_tty=False)


def test_a_rerun_with_nothing_to_do_starts_no_engine(tmp_path, cfg):
    inp = write_input(tmp_path / "in", [20, 20])
    starts = []

    def factory(job):
        starts.append(1)
        return FakeEngine()

    for shard in (None, "1/2"):
        out = tmp_path / f"out-{shard is None}"
        c = cfg(inp, out, cluster={"shard": shard})
        assert run_job(c, engine_factory=factory, is_tty=False).exit_code == 0
        assert len(starts) == 1
        s = run_job(c, engine_factory=factory, is_tty=False)
        assert s.exit_code == 0 and s.num_resumed == s.num_done and len(starts) == 1   # no second engine
        starts.clear()
    # with rows left, the resume does start one
    out = tmp_path / "partial"
    run_job(cfg(inp, out, input={"limit": 10}), engine_factory=factory, is_tty=False)
    s = run_job(cfg(inp, out), engine_factory=factory, is_tty=False)
    assert s.num_ok == 40 and len(starts) == 2


# -- three shards as three processes, one killed --------------------------------------------------------

@pytest.mark.slow
def test_three_shard_processes_one_killed_rerun_exactly_once(tmp_path, tiny_model):
    inp = write_input(tmp_path / "in", [120, 130, 140, 150, 160, 170], row_group_size=40)
    out = tmp_path / "out"

    def start(k):
        args = [*overnight_cmd(), "run", str(inp), "--out", str(out), "--shard", f"{k}/3", "--engine", "echo",
                "--echo-step-ms", "20", "--max-tokens", "8", "--model", tiny_model, "--flush-rows", "20",
                "--max-num-seqs", "8", "--json"]
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    procs = [start(k) for k in range(3)]
    victim = procs[1]
    status_dir = out / "shards" / "00001-of-00003" / "parts"
    deadline = time.time() + 120
    while time.time() < deadline and not (status_dir.exists() and len(list(status_dir.glob("part-*"))) >= 2):
        time.sleep(0.2)
    # held where it is (it would finish its ~6 s of rows while `status` starts on a loaded machine), seen running
    victim.send_signal(signal.SIGSTOP)
    running = json.loads(subprocess.run([*overnight_cmd(), "status", str(out), "--json"], capture_output=True,
                                        text=True, check=True).stdout)
    assert running["state"] == "running" and running["exit_code"] is None
    assert running["per_shard"][1]["state"] == "running"
    victim.send_signal(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL
    for p in (procs[0], procs[2]):
        assert p.wait(timeout=300) == 0, p.stderr.read()[-2000:]
    killed = json.loads(subprocess.run([*overnight_cmd(), "status", str(out), "--json"], capture_output=True,
                                       text=True, check=True).stdout)
    assert killed["per_shard"][1]["state"] == "stopped" and killed["state"] != "completed"
    rerun = start(1)
    assert rerun.wait(timeout=300) == 0, rerun.stderr.read()[-2000:]
    summary = json.loads(rerun.stdout.read())
    assert summary["num_resumed"] > 0
    ids = duckdb.sql(f"select id from read_parquet('{out}/shards/*/parts/*.parquet')").fetchall()
    assert len(ids) == len(set(ids)) == 870
    done = subprocess.run([*overnight_cmd(), "status", str(out)], capture_output=True, text=True, check=True).stdout
    assert "completed, 3 shards (3 completed)" in done and "870 done of 870, 0 left" in done


def test_plan_and_the_predictor_read_every_shard(tmp_path, cfg):
    from overnight.buckets.dataset import load_outputs
    from overnight.pipeline.scheduling.plan import make_plan

    inp = write_input(tmp_path / "in", [30, 30, 30])
    out = tmp_path / "out"
    for k in (0, 2):  # shard 1 not run yet
        run_job(cfg(inp, out, cluster={"shard": f"{k}/3"}), engine_factory=given(FakeEngine()), is_tty=False)
    plan = make_plan(cfg(inp, out), out=str(out))
    assert (plan.num_done, plan.num_todo) == (60, 30)
    data = load_outputs([str(out)])
    assert len(data) == 60
    st = job_status(str(out))
    assert st["state"] == "partial" and [p["state"] for p in st["per_shard"]] == ["completed", "not started",
                                                                                   "completed"]
