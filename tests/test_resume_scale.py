"""Resume state at scale: ids as keys (pipeline/idkeys.py), the key table, the Scan, and the batch resume filter.

No engine: the filter runs over SourceBatches built here, against Scans of parts written here."""

import hashlib
import logging

import numpy as np
import pyarrow as pa

from overnight.pipeline.config import InputConfig
from overnight.pipeline.idkeys import KeyTable, first_of_each, hex16_to_u64, key_of, keys_of
from overnight.pipeline.input.resume import ResumeFilter
from overnight.pipeline.input.source import InputFile, SourceBatch
from overnight.pipeline.input.validate import prompt_hash
from overnight.pipeline.output.checkpoint import OutputDir, Scan
from overnight.pipeline.output.schema import OutputSchema
from overnight.pipeline.records import Result
from overnight.pipeline.tally import Tally


# -- keys ------------------------------------------------------------------------------------------

def test_integer_ids_are_exact_and_string_keys_are_pinned():
    values = [0, 1, -1, 2, 2**63 - 1, -2**63, 12345]
    keys, checks, valid = keys_of(pa.array(values, pa.int64()))
    assert valid.all() and len(set(keys.tolist())) == len(values) and not checks.any()
    # The same in every process and machine: a change here changes which rows a rerun finds done.
    assert key_of(12345) == (2454886589211414944, 0)
    assert key_of("row-000000001") == (17319778577411639244, 3872626326)
    assert key_of("") != key_of("\0") and key_of("a") != key_of("a\0")


def test_string_keys_do_not_depend_on_the_array_layout():
    words = ["", "a", "a\0", "abcdefgh", "abcdefgh\0", "abcdefghi", "é", "x" * 100, "row-000000001"]
    keys, checks, valid = keys_of(pa.array(words))
    assert valid.all() and len(set(zip(keys.tolist(), checks.tolist()))) == len(words)
    for arr in (pa.array(words, pa.large_string()), pa.array(["pad"] + words).slice(1),
                pa.chunked_array([words[:4], words[4:]]), pa.array(words).dictionary_encode()):
        k, c, _ = keys_of(arr)
        assert k.tolist() == keys.tolist() and c.tolist() == checks.tolist()
    assert [key_of(w) for w in words] == list(zip(keys.tolist(), checks.tolist()))


def test_null_ids_are_not_valid():
    for arr in (pa.array(["a", None, "b"]), pa.array([1, None, 3])):
        _, _, valid = keys_of(arr)
        assert valid.tolist() == [True, False, True]


def test_many_string_ids_get_distinct_keys():
    ids = pa.array([f"row-{i:09d}" for i in range(300_000)] + [f"{i}" for i in range(300_000)])
    keys, checks, _ = keys_of(ids)
    assert len(np.unique(keys)) == len(ids)  # 64 bits alone already tell these apart


def test_prompt_hash_hex_parses_as_written():
    h = prompt_hash("hello", None)
    v = hex16_to_u64(pa.array([h, None, "xyz", "G" * 16, h.upper()]))
    assert v.tolist() == [int(h, 16), 0, 0, 0, int(h, 16)]


def test_first_of_each_keeps_the_first_occurrence():
    keys = np.array([5, 7, 5, 9, 7, 5], np.uint64)
    checks = np.array([1, 1, 1, 1, 2, 1], np.uint32)  # (7, 2) differs from (7, 1)
    assert first_of_each(keys, checks).tolist() == [0, 1, 3, 4]


# -- the table -----------------------------------------------------------------------------------

def test_key_table_matches_a_python_set_through_growth():
    rng = np.random.default_rng(1)
    table, ref = KeyTable(), set()
    for _ in range(40):
        keys = rng.integers(0, 2**64 - 1, size=700, dtype=np.uint64)
        if ref:  # some already in, some repeated within the batch
            keys[:50] = rng.choice(np.array([k for k, _ in ref], np.uint64), 50)
        keys[50:60] = keys[60:70]
        checks = (keys % np.uint64(7)).astype(np.uint32)
        present = table.contains(keys, checks)
        assert present.tolist() == [(int(k), int(c)) in ref for k, c in zip(keys, checks)]
        table.add(keys, checks)
        ref.update(zip(keys.tolist(), checks.tolist()))
        assert len(table) == len(ref)
    assert table.num_buckets * KeyTable.SLOTS * KeyTable.MAX_LOAD >= len(ref)
    assert table.nbytes < 40 * len(ref)


def test_key_table_tells_apart_pairs_that_share_a_key_and_survives_full_buckets():
    table = KeyTable(values=True, flags=True)
    # 40 pairs with the same key (so the same home bucket: 5 buckets' worth) and different checks, key 0 among them
    keys = np.zeros(40, np.uint64)
    checks = np.arange(40, dtype=np.uint32)
    slots = table.add(keys, checks, np.arange(40, dtype=np.uint64) + 100)
    assert len(set(slots.tolist())) == 40 and len(table) == 40
    table.set_flags(slots[:3], 1)
    more = np.random.default_rng(2).integers(1, 2**64 - 1, size=3000, dtype=np.uint64)
    table.add(more, np.zeros(3000, np.uint32))  # grows: the pairs move, values and flags with them
    found = table.find(keys, checks)
    assert (found >= 0).all() and table.value_at(found).tolist() == list(range(100, 140))
    assert table.flags_at(found).tolist() == [1, 1, 1] + [0] * 37
    assert not table.contains(np.zeros(1, np.uint64), np.array([99], np.uint32)).any()
    assert table.contains(more, np.zeros(3000, np.uint32)).all()
    assert not table.contains(more, np.ones(3000, np.uint32)).any()


def test_add_repeated_pairs_once_with_the_last_value():
    table = KeyTable(values=True)
    keys = np.array([3, 4, 3], np.uint64) << np.uint64(40)
    table.add(keys, np.zeros(3, np.uint32), np.array([1, 2, 3], np.uint64))
    assert len(table) == 2
    assert table.value_at(table.find(keys[:1], np.zeros(1, np.uint32))).tolist() == [3]


# -- scan and filter -----------------------------------------------------------------------------

SCHEMA = OutputSchema("id", pa.string(), [])


def ok(row_id, prompt="p"):
    return Result(id=row_id, passthrough={}, status="ok", text="t", output_tokens=2,
                  prompt_hash=prompt_hash(prompt, None))


def written(tmp_path, name, *parts) -> OutputDir:
    out = OutputDir(str(tmp_path / name))
    for i, results in enumerate(parts):
        out.write_part(i, SCHEMA.table(results, "run", "m"))
    return out


def batch(table: dict, name="in.parquet", start=0, row_numbers=None) -> SourceBatch:
    rb = pa.RecordBatch.from_pydict(table)
    return SourceBatch(InputFile(name, name, rb.num_rows, rb.schema), start, rb, row_numbers)


def passing(f: ResumeFilter, sb: SourceBatch, cfg=None):
    kept = f.filter(sb, cfg or InputConfig())
    if kept is None:
        return []
    return [(kept.row_number(i), v) for i, v in enumerate(kept.batch.column(0).to_pylist())]


def test_scan_into_adds_folders(tmp_path):
    a = written(tmp_path, "a", [ok("x"), ok("y")], [Result.failed(None, {}, "in.parquet#7: bad")])
    b = written(tmp_path, "b", [ok("y"), ok("z")])
    scan = a.scan("id")
    assert (scan.num_ok, scan.num_error, scan.num_parts, scan.next_index, scan.num_ids) == (2, 1, 2, 2, 2)
    b.scan("id", into=scan)
    assert (scan.num_ok, scan.num_error, scan.num_parts, scan.next_index, scan.num_output_tokens) == (4, 1, 3, 2, 8)
    assert scan.num_ids == 3 and scan.contains(["x", "y", "z", "w"]) == [True, True, True, False]
    assert len(scan.null_origins) == 1


def test_filter_counts_resumed_duplicates_changed_and_removed(tmp_path, caplog):
    out = written(tmp_path, "out", [ok("a", "one"), ok("b", "two")], [ok("c", "three"), ok("gone", "x")])
    tally = Tally(0)
    f = ResumeFilter(out.scan("id"), tally, out.url)
    caplog.set_level(logging.WARNING)
    first = batch({"id": ["a", "n1", "c", "a", "n1"], "prompt": ["one", "new", "THREE", "again", "dup"]})
    assert passing(f, first) == [(1, "n1")]
    second = batch({"id": ["n2", "b", "c", "n1"], "prompt": ["n", "two", "three", "x"]}, start=5)
    assert passing(f, second) == [(5, "n2")]
    assert (tally.num_resumed, tally.num_duplicates, tally.num_changed) == (3, 4, 1)
    assert "id 'c' at in.parquet#2: its prompt changed since its result was written" in caplog.text
    assert "duplicate id 'a' at in.parquet#3: the first row with this id is kept" in caplog.text
    assert "duplicate id 'c' at in.parquet#7" in caplog.text
    f.report_removed(limited=False)
    assert tally.num_removed == 1 and "1 rows in" in caplog.text and "(e.g. ids 'gone')" in caplog.text


def test_only_five_duplicates_are_named(caplog):
    f = ResumeFilter(Scan(), Tally(0), "out")
    caplog.set_level(logging.WARNING)
    assert len(passing(f, batch({"id": ["a"] * 9, "prompt": ["p"] * 9}))) == 1
    assert f.tally.num_duplicates == 8 and caplog.text.count("duplicate id") == 5
    f.report_removed(limited=False)
    assert f.tally.num_removed is None  # nothing was done before


def test_a_full_rerun_keeps_nothing_and_a_limited_pass_reports_no_removed(tmp_path):
    out = written(tmp_path, "out", [ok(f"r{i}") for i in range(50)])
    f = ResumeFilter(out.scan("id"), Tally(0), out.url)
    assert f.filter(batch({"id": [f"r{i}" for i in range(30)], "prompt": ["p"] * 30}), InputConfig()) is None
    f.report_removed(limited=True)
    assert f.tally.num_resumed == 30 and f.tally.num_removed is None
    f.report_removed(limited=False)
    assert f.tally.num_removed == 20


def test_a_second_filter_on_the_same_scan_starts_a_new_pass(tmp_path):
    out = written(tmp_path, "out", [ok("a")])
    scan = out.scan("id")
    for _ in range(2):
        f = ResumeFilter(scan, Tally(0), out.url)
        assert passing(f, batch({"id": ["a"], "prompt": ["p"]})) == []
        assert (f.tally.num_resumed, f.tally.num_duplicates) == (1, 0)


def test_changed_chats_and_invalid_rows_are_decided_by_the_parse(tmp_path):
    chat = [{"role": "user", "content": "hi"}]
    rows = [Result(id="c", passthrough={}, status="ok", prompt_hash=prompt_hash(None, chat)),
            Result(id="d", passthrough={}, status="ok", prompt_hash=prompt_hash(None, chat)),
            Result.failed("e", {}, "in.parquet#2: empty"), ok("f", "  ")]
    rows[2].prompt_hash = prompt_hash("   ", None)
    out = written(tmp_path, "out", rows)
    tally = Tally(0)
    f = ResumeFilter(out.scan("id"), tally, out.url)
    msgs = pa.array([chat, [{"role": "user", "content": "changed"}], None, None])
    sb = batch({"id": ["c", "d", "e", "f"], "prompt": [None, None, "  ", "  "], "messages": msgs})
    assert passing(f, sb) == []
    assert (tally.num_resumed, tally.num_changed) == (4, 2)  # d's chat changed, e's prompt lost a space


def test_null_ids_are_matched_by_origin_and_int_ids_work(tmp_path):
    schema = OutputSchema("id", pa.int64(), [])
    out = OutputDir(str(tmp_path / "out"))
    out.write_part(0, schema.table([Result(id=1, passthrough={}, status="ok"),
                                    Result.failed(None, {}, "in.parquet#1: column 'id' is null")], "run", "m"))
    f = ResumeFilter(out.scan("id"), Tally(0), out.url)
    sb = batch({"id": pa.array([1, None, 2, None], pa.int64()), "prompt": ["a", "b", "c", "d"]})
    assert passing(f, sb) == [(2, 2), (3, None)]
    assert f.tally.num_resumed == 2   # id 1, and row 1's error row (by its origin)


def test_inputs_without_an_id_column_match_by_file_and_row(tmp_path):
    out = written(tmp_path, "out", [ok("in.parquet#0"), ok("in.parquet#5")])
    f = ResumeFilter(out.scan("id"), Tally(0), out.url)
    # rows 3..6 of the file, some already left out upstream (row_numbers)
    sb = batch({"prompt": ["a", "b", "c"]}, start=3, row_numbers=[3, 5, 6])
    kept = f.filter(sb, InputConfig())
    assert kept.row_numbers == [3, 6] and kept.batch.column(0).to_pylist() == ["a", "c"]
    assert f.tally.num_resumed == 1


def test_plain_prompt_check_hashes_the_column_bytes_as_validate_does(tmp_path):
    prompts = ["plain", "ünïcödé ✓", "x" * 300, "tabs\tand\nnewlines"]
    out = written(tmp_path, "out", [ok(f"r{i}", p) for i, p in enumerate(prompts)])
    for typ in (pa.string(), pa.large_string(), pa.binary()):
        tally = Tally(0)
        f = ResumeFilter(out.scan("id"), tally, out.url)
        values = [p.encode() if typ == pa.binary() else p for p in prompts]
        sb = batch({"id": [f"r{i}" for i in range(4)], "prompt": pa.array(values, typ)})
        assert passing(f, sb) == [] and (tally.num_resumed, tally.num_changed) == (4, 0)
    assert hashlib.blake2b(prompts[1].encode(), digest_size=8).hexdigest() == prompt_hash(prompts[1], None)


def test_resume_state_stays_small_at_a_million_ids(tmp_path):
    n = 1_000_000
    ids = pa.array([f"row-{i:09d}" for i in range(n)])
    scan = Scan()
    scan.add_rows(ids, pa.array([prompt_hash("p", None)] * n))
    f = ResumeFilter(scan, Tally(0), "out")
    assert scan.done.nbytes / n < 60  # 21 bytes a slot, 1.3 to 2.7 slots an id; a dict of str ids took ~150
    step = 8192
    for s in range(0, n, step):
        part = ids.slice(s, step)
        assert f.filter(batch({"id": part, "prompt": pa.array(["p"] * len(part))}, start=s), InputConfig()) is None
    new = pa.array([f"new-{i}" for i in range(200_000)])
    for s in range(0, len(new), step):
        part = new.slice(s, step)
        assert len(passing(f, batch({"id": part, "prompt": pa.array(["p"] * len(part))}, start=s))) == len(part)
    assert f.tally.num_resumed == n and f.tally.num_changed == 0 and f.tally.num_duplicates == 0
    assert f.seen.nbytes / len(new) < 40
    f.report_removed(limited=False)
    assert f.tally.num_removed == 0


def test_done_rows_are_the_first_row_of_each_done_id_up_to_the_limit(tmp_path):
    """plan's second pass (DoneRows): the rows OUT holds, in input order, each id once, at most `limit`."""
    from overnight.pipeline.input.resume import DoneRows

    out = written(tmp_path, "out", [ok("a"), ok("b"), ok("c"), ok("d")])
    scan = out.scan("id")
    ResumeFilter(scan, Tally(0), out.url)  # (plan's first pass sets flags of its own on the same scan)
    rows = DoneRows(scan, limit=3)
    batches = [batch({"id": ["n", "b", "a", "b", None], "prompt": ["p"] * 5}),
               batch({"id": ["a", "d", "c", "x"], "prompt": ["p"] * 4}, start=5)]
    kept = [(sb.row_number(i), v) for sb in rows.filter_batches(batches, InputConfig())
            for i, v in enumerate(sb.batch.column(0).to_pylist())]
    assert kept == [(1, "b"), (2, "a"), (6, "d")] and rows.num_taken == 3
    assert list(DoneRows(Scan(), limit=3).filter_batches(batches, InputConfig())) == []


def test_done_rows_read_no_further_once_every_done_id_is_taken(tmp_path):
    """A resume of a few rows done must not read the whole input a second time before its first row."""
    from overnight.pipeline.input.resume import DoneRows

    out = written(tmp_path, "out", [ok("a"), ok("b")])

    def batches():
        yield batch({"id": ["a", "x", "b"], "prompt": ["p"] * 3})
        raise AssertionError("read past the last id done")

    rows = DoneRows(out.scan("id"), limit=1024)
    assert [v for sb in rows.filter_batches(batches(), InputConfig()) for v in sb.batch.column(0).to_pylist()] == [
        "a", "b"]
