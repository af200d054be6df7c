"""Parquet input at its edges (found by a review, stop 40): a column whose files disagree past a cast, a damaged
row group named right, DECIMAL sampling columns, nanosecond timestamps, passthrough names that clash twice, a
path with glob characters, and an --id-column the input lacks."""

from __future__ import annotations

import decimal
import glob
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fakes import FakeEngine, given
from overnight.pipeline.api import run_job
from overnight.pipeline.config import MAX_N
from overnight.pipeline.input.source import InputError


def _parts(out) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in sorted(glob.glob(f"{out}/parts/part-*.parquet"))])


def test_a_column_that_cannot_take_the_shared_type_names_file_and_column(tmp_path, cfg):
    inp = tmp_path / "in"
    inp.mkdir()
    pq.write_table(pa.table({"id": [1, 2], "prompt": ["a", "b"], "h": pa.array([1, 2], pa.int64())}), inp / "a.parquet")
    pq.write_table(pa.table({"id": [3, 4], "prompt": ["c", "d"], "h": pa.array([5, 2 ** 64 - 1], pa.uint64())}),
                   inp / "b.parquet")
    with pytest.raises(InputError, match=r"b.parquet: column 'h' \(uint64\) cannot be read as int64, the type the "
                                         r"input's files share, at rows from 0 .* leave it out with --passthrough"):
        run_job(cfg(inp, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    assert _parts(tmp_path / "out").column("id").to_pylist() == [1, 2]      # a.parquet's rows are kept


def test_a_request_value_that_cannot_take_the_shared_type_is_its_rows_error(tmp_path, cfg):
    """A seed of 2**64-1 in a uint64 file beside an int64 one: that row is an error row naming the value, as the
    same file alone makes it; the job goes on (it stopped, and its fix, --passthrough, did nothing here)."""
    inp = tmp_path / "in"
    inp.mkdir()
    pq.write_table(pa.table({"id": [1, 2], "prompt": ["a", "b"], "seed": pa.array([1, 2], pa.int64())}),
                   inp / "a.parquet")
    pq.write_table(pa.table({"id": [3, 4], "prompt": ["c", "d"], "seed": pa.array([5, 2 ** 64 - 1], pa.uint64())}),
                   inp / "b.parquet")
    s = run_job(cfg(inp, tmp_path / "out", input={"passthrough": "none"}), engine_factory=given(FakeEngine()),
                is_tty=False)
    assert (s.exit_code, s.num_ok, s.num_error) == (0, 3, 1)
    err = [r for r in _parts(tmp_path / "out").to_pylist() if r["status"] == "error"]
    assert [r["id"] for r in err] == [4]
    assert err[0]["error"] == ("b.parquet#1: seed is 18446744073709551615, which int64 (the type 'seed' has in the "
                               "input's other files) cannot hold; fix the value, or set it to null")


def test_the_rows_read_before_a_file_that_cannot_be_read_are_answered_first(tmp_path, cfg):
    # the reader reaches b.parquet long before a.parquet's 64 rows are answered, 8 at a time
    inp = tmp_path / "in"
    inp.mkdir()
    pq.write_table(pa.table({"id": list(range(64)), "prompt": ["a"] * 64, "h": pa.array([1] * 64, pa.int64())}),
                   inp / "a.parquet")
    pq.write_table(pa.table({"id": [100], "prompt": ["c"], "h": pa.array([2 ** 64 - 1], pa.uint64())}),
                   inp / "b.parquet")
    with pytest.raises(InputError, match=r"b.parquet: column 'h' \(uint64\) cannot be read as int64"):
        run_job(cfg(inp, tmp_path / "out"), engine_factory=given(FakeEngine(max_num_seqs=8, step_sleep=0.01)),
                is_tty=False)
    assert sorted(_parts(tmp_path / "out").column("id").to_pylist()) == list(range(64))
    status = json.loads((tmp_path / "out" / "status.json").read_text())
    assert status["state"] == "failed" and "b.parquet" in status["message"]


def test_a_damaged_row_group_is_named_even_when_a_batch_spans_two(tmp_path, cfg):
    path = tmp_path / "b.parquet"
    pq.write_table(pa.table({"id": list(range(1500)), "prompt": [f"p {i}" for i in range(1500)]}), path,
                   row_group_size=500, compression="none")
    offset = pq.ParquetFile(path).metadata.row_group(2).column(1).data_page_offset
    data = bytearray(path.read_bytes())
    data[offset:offset + 60] = b"\xff" * 60
    path.write_bytes(bytes(data))
    with pytest.raises(InputError, match=r"b.parquet: row group 2 \(rows from 1000\) cannot be read"):
        run_job(cfg(path, tmp_path / "out", input={"batch_rows": 128}), engine_factory=given(FakeEngine()),
                is_tty=False)
    # every row of the row groups before it is answered (a batch spanning rows 896-1023 lost 896-999)
    assert sorted(_parts(tmp_path / "out").column("id").to_pylist()) == list(range(1000))


def test_decimal_sampling_columns_are_numbers(tmp_path, cfg, write_parquet):
    inp = write_parquet({"id": [1, 2], "prompt": ["a", "b"],   # what DuckDB writes for a literal 0.7
                         "temperature": pa.array([decimal.Decimal("0.7"), None], pa.decimal128(2, 1)),
                         "max_tokens": pa.array([decimal.Decimal("16"), decimal.Decimal("2.5")], pa.decimal128(18, 1))})
    s = run_job(cfg(inp, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    rows = {r["id"]: r for r in _parts(tmp_path / "out").to_pylist()}
    assert (s.num_ok, s.num_error) == (1, 1) and rows[1]["status"] == "ok"
    assert rows[2]["error"] == "in.parquet#1: max_tokens is Decimal('2.5') (Decimal); it must be an integer"


def test_a_huge_whole_number_is_shown_short_in_its_error(tmp_path, cfg, write_parquet):
    inp = write_parquet({"id": [1, 2], "prompt": ["a", "b"], "n": [1.0, 1e300]})
    s = run_job(cfg(inp, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    rows = {r["id"]: r for r in _parts(tmp_path / "out").to_pylist()}
    assert (s.num_ok, s.num_error) == (1, 1)
    assert rows[2]["error"] == f"in.parquet#1: n is 1e+300; it must be 1 to {MAX_N} (completions of the row)"


def test_a_file_without_the_id_column_the_others_have_is_refused(tmp_path, cfg):
    """Its rows would each have been an error row (a null id), the file never answered."""
    folder = tmp_path / "in"
    folder.mkdir()
    pq.write_table(pa.table({"id": ["a"], "prompt": ["hi"]}), folder / "a.parquet")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), folder / "b.parquet")   # empty: no matter
    assert run_job(cfg(folder, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False).num_ok == 1
    pq.write_table(pa.table({"prompt": ["yo", "hey"]}), folder / "b.parquet")
    with pytest.raises(InputError, match=r"b.parquet has no id column 'id', which other input files have "
                                         r"\(.*a.parquet\)\. Add the column to it, or run it as a job of its own"):
        run_job(cfg(folder, tmp_path / "out2"), engine_factory=given(FakeEngine()), is_tty=False)


def test_nanosecond_timestamps_pass_through_exactly(tmp_path, cfg, write_parquet):
    ns = [1_700_000_000_000_000_001, 1_700_000_000_000_000_000]
    inp = write_parquet({"id": [1, 2], "prompt": ["a", "b"], "ts": pa.array(ns, pa.timestamp("ns")),
                         "took": pa.array([1, 2_000], pa.duration("ns"))})
    s = run_job(cfg(inp, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    t = _parts(tmp_path / "out").sort_by("id")
    assert s.num_ok == 2 and t.schema.field("ts").type == pa.timestamp("ns")
    assert t.column("ts").cast(pa.int64()).to_pylist() == ns
    assert t.column("took").cast(pa.int64()).to_pylist() == [1, 2_000]


def test_nanosecond_values_inside_lists_structs_and_maps_pass_through_exactly(tmp_path, cfg, write_parquet):
    ns = pa.timestamp("ns")
    cols = {
        "ev": pa.array([{"t": 1_000_000_001, "k": "a"}, {"t": 2_000_000_000, "k": "b"}],
                       pa.struct([("t", ns), ("k", pa.string())])),
        "ts": pa.array([[1, 2], None], pa.list_(ns)),
        "big": pa.array([[3], []], pa.large_list(pa.duration("ns"))),
        "pair": pa.array([[4, 5], [6, 7]], pa.list_(pa.time64("ns"), 2)),
        "by": pa.array([[("x", 8)], [("y", 9)]], pa.map_(pa.string(), pa.timestamp("ns", "UTC"))),
    }
    inp = write_parquet({"id": [1, 2], "prompt": ["a", "b"], **cols})
    s = run_job(cfg(inp, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    t = _parts(tmp_path / "out").sort_by("id")
    assert s.num_ok == 2 and s.num_error == 0
    for name, col in cols.items():
        assert t.schema.field(name).type == col.type and t.column(name).combine_chunks().equals(col), name


def test_passthrough_names_that_clash_twice_keep_both(tmp_path, cfg, write_parquet):
    inp = write_parquet({"id": [1], "prompt": ["a"], "text": ["T1"], "input_text": ["I1"]})
    run_job(cfg(inp, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    row = _parts(tmp_path / "out").to_pylist()[0]                  # a table pyarrow reads by name
    assert (row["input_input_text"], row["input_text"]) == ("T1", "I1") and row["text"].startswith("echo")


def test_passthrough_names_that_clash_but_for_case_are_renamed_as_duckdb_reads_them(tmp_path, cfg, write_parquet):
    """DuckDB reads names without regard to case: a part with "Status" beside "status" would be read with the
    input's values under "status" and the result's as "status_1", by inspect, export and a notebook alike."""
    import duckdb

    inp = write_parquet({"id": [1, 2], "prompt": ["a", "b"], "Text": ["T1", "T2"], "Status": ["gold", "silver"]})
    s = run_job(cfg(inp, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    t = _parts(tmp_path / "out").sort_by("id")
    assert s.num_ok == 2 and {"input_Text", "input_Status", "text", "status"} <= set(t.column_names)
    got = duckdb.sql(f"select status, text, input_Status from read_parquet('{tmp_path}/out/**/part-*.parquet') "
                     f"order by id").fetchall()
    assert [(st, txt.startswith("echo"), inp_st) for st, txt, inp_st in got] == [("ok", True, "gold"),
                                                                             ("ok", True, "silver")]


def test_an_out_begun_before_names_clashed_without_case_keeps_its_column_name_on_resume(tmp_path, cfg,
                                                                                        write_parquet):
    """An OUT whose parts hold "Status" as it came (before the case-blind rule): its resume writes "Status" too,
    as its manifest's renames say (it wrote "input_Status" in the new parts, and the column's earlier rows read as
    null)."""
    import json

    inp = write_parquet({"id": [1, 2], "prompt": ["a", "b"], "Status": ["gold", "silver"]})
    out = tmp_path / "out"
    run_job(cfg(inp, out, input={"limit": 1}), engine_factory=given(FakeEngine()), is_tty=False)
    part = next((out / "parts").glob("part-*.parquet"))   # made as the rule before made it
    t = pq.read_table(part)
    pq.write_table(t.rename_columns(["Status" if c == "input_Status" else c for c in t.column_names]), part)
    m = json.loads((out / "manifest.json").read_text())
    assert m["input"].pop("renamed") == {"Status": "input_Status"}
    (out / "manifest.json").write_text(json.dumps(m))
    run_job(cfg(inp, out), engine_factory=given(FakeEngine()), is_tty=False)
    for p in (out / "parts").glob("part-*.parquet"):
        assert "Status" in pq.read_schema(p).names and "input_Status" not in pq.read_schema(p).names, p
    assert "renamed" not in json.loads((out / "manifest.json").read_text())["input"]


def test_a_path_with_glob_characters_that_exists_is_that_path(tmp_path, cfg):
    folder = tmp_path / "run [v2]"
    folder.mkdir()
    pq.write_table(pa.table({"id": [1], "prompt": ["a"]}), folder / "prompts.parquet")
    for inp in (folder, folder / "prompts.parquet"):
        s = run_job(cfg(inp, tmp_path / f"out{len(str(inp))}"), engine_factory=given(FakeEngine()), is_tty=False)
        assert s.num_ok == 1


def test_an_id_column_the_input_lacks_is_refused(tmp_path, cfg, write_parquet):
    inp = write_parquet({"uid": ["u1"], "prompt": ["a"]})
    with pytest.raises(InputError, match=r"Id column 'user_id' is not in .* \(columns: uid, prompt\)\. Fix "
                                         r"--id-column"):
        run_job(cfg(inp, tmp_path / "out", input={"id_column": "user_id"}), engine_factory=given(FakeEngine()),
                is_tty=False)
    assert run_job(cfg(inp, tmp_path / "out2"), engine_factory=given(FakeEngine()), is_tty=False).num_ok == 1


def test_dictionary_encoded_columns_are_read_as_their_values(tmp_path, cfg):
    """pandas categories: a prompt, an id and a passthrough column, with index widths that differ by file."""
    inp = tmp_path / "in"
    inp.mkdir()
    for k, width in enumerate((pa.int8(), pa.int16())):
        def cat(values):
            return pa.array(values).dictionary_encode().cast(pa.dictionary(width, pa.string()))
        pq.write_table(pa.table({"id": cat([f"r{k}0", f"r{k}1"]), "prompt": cat(["hello", "hello"]),
                                 "kind": cat(["x", f"y{k}"])}), inp / f"f{k}.parquet")
    s = run_job(cfg(inp, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    t = _parts(tmp_path / "out").sort_by("id")
    assert s.num_ok == 4 and t.column("kind").to_pylist() == ["x", "y0", "x", "y1"]
    assert t.schema.field("id").type == pa.string()
    os.utime(inp / "f1.parquet", (1, 1))                          # changed: the parts are scanned, ids matched
    s = run_job(cfg(inp, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    assert (s.num_resumed, s.num_ok) == (4, 4)


def test_an_empty_file_without_the_prompt_column_is_no_error(tmp_path, cfg):
    """A file of zero rows has no prompt to ask for: it may lack the prompt column, as it may lack the id column
    (a writer that drops the columns of an empty frame); the other files' rows are answered."""
    inp = tmp_path / "in"
    inp.mkdir()
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["hi", "yo"]}), inp / "a.parquet")
    pq.write_table(pa.table({"other": pa.array([], pa.string())}), inp / "b.parquet")
    s = run_job(cfg(inp, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    assert (s.exit_code, s.num_ok) == (0, 2)
    pq.write_table(pa.table({"other": ["x"]}), inp / "b.parquet")   # with a row, it is refused, naming the file
    with pytest.raises(InputError, match=r"b.parquet has no column 'prompt' or 'messages'"):
        run_job(cfg(inp, tmp_path / "out2"), engine_factory=given(FakeEngine()), is_tty=False)


def test_a_column_the_job_does_not_read_does_not_block_it(tmp_path, cfg):
    """A struct of another shape in each file is passed through with the fields merged (each file's missing ones
    null); one whose fields do not merge is refused while it is passed through (with the fix of leaving it out),
    and left out of the dataset when --passthrough leaves it out."""
    inp = tmp_path / "in"
    inp.mkdir()
    pq.write_table(pa.table({"prompt": ["a"], "meta": pa.array([{"a": 1}])}), inp / "a.parquet")
    pq.write_table(pa.table({"prompt": ["b"], "meta": pa.array([{"a": 1, "z": True}])}), inp / "b.parquet")
    s = run_job(cfg(inp, tmp_path / "merged"), engine_factory=given(FakeEngine()), is_tty=False)
    assert (s.exit_code, s.num_ok) == (0, 2)
    got = {r["prompt"]: r["meta"] for r in _parts(tmp_path / "merged").to_pylist()}
    assert got == {"a": {"a": 1, "z": None}, "b": {"a": 1, "z": True}}
    pq.write_table(pa.table({"prompt": ["b"], "meta": pa.array([{"a": "one"}])}), inp / "b.parquet")
    with pytest.raises(InputError, match=r"Column 'meta' has type .* leave it out of --passthrough"):
        run_job(cfg(inp, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    s = run_job(cfg(inp, tmp_path / "out", input={"passthrough": "none"}), engine_factory=given(FakeEngine()),
                is_tty=False)
    assert (s.exit_code, s.num_ok) == (0, 2)
    pq.write_table(pa.table({"prompt": ["b"], "max_tokens": ["many"]}), inp / "b.parquet")   # a request column
    pq.write_table(pa.table({"prompt": ["a"], "max_tokens": [4]}), inp / "a.parquet")
    with pytest.raises(InputError, match=r"Column 'max_tokens' has type int64 .* in every file\.$"):
        run_job(cfg(inp, tmp_path / "out2", input={"passthrough": "none"}), engine_factory=given(FakeEngine()),
                is_tty=False)


def test_a_prompt_column_of_text_in_one_file_and_bytes_in_another(tmp_path, cfg):
    """Text written without Parquet's UTF8 annotation (bytes) is read as text, also beside a file of strings
    (refused before as mixed schemas); the output's prompt column is text."""
    inp = tmp_path / "in"
    inp.mkdir()
    pq.write_table(pa.table({"prompt": pa.array(["a", "b"], pa.string())}), inp / "a.parquet")
    pq.write_table(pa.table({"prompt": pa.array([b"c", b"bad \xff"], pa.binary())}), inp / "b.parquet")
    s = run_job(cfg(inp, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
    assert (s.exit_code, s.num_ok, s.num_error) == (0, 3, 1)
    parts = _parts(tmp_path / "out")
    assert parts.schema.field("prompt").type == pa.string()
    assert sorted(p for p in parts.column("prompt").to_pylist() if p) == ["a", "b", "c"]


def test_bytes_beside_text_in_another_column_are_refused_not_turned_into_bytes(tmp_path, cfg):
    """Only the prompt or chat column reads bytes as text: a passed-through column of strings in one file and
    bytes in another is refused naming both files, not made bytes in every row."""
    inp = tmp_path / "in"
    inp.mkdir()
    pq.write_table(pa.table({"prompt": ["a"], "category": pa.array(["cat"], pa.string())}), inp / "a.parquet")
    pq.write_table(pa.table({"prompt": ["b"], "category": pa.array([b"dog"], pa.binary())}), inp / "b.parquet")
    with pytest.raises(InputError, match=r"Column 'category' has type string in .*a.parquet but binary in "
                                         r".*b.parquet"):
        run_job(cfg(inp, tmp_path / "out"), engine_factory=given(FakeEngine()), is_tty=False)
