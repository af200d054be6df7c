import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from overnight.pipeline.config import InputConfig
from overnight.pipeline.input.source import InputError, ParquetSource


def source(path, **kw) -> ParquetSource:
    return ParquetSource(InputConfig(path=str(path), **kw))


def all_rows(src):
    rows = []
    for sb in src.batches():
        for i, r in enumerate(sb.batch.to_pylist()):
            rows.append((sb.file.name, sb.start + i, r))
    return rows


def test_single_file(write_parquet):
    p = write_parquet({"id": [1, 2, 3], "prompt": ["a", "b", "c"]})
    s = source(p)
    assert s.num_rows == 3 and s.has_id_column and s.id_type == pa.int64()
    assert [r["prompt"] for _, _, r in all_rows(s)] == ["a", "b", "c"]


def test_folder_is_read_recursively_in_sorted_order(tmp_path, write_parquet):
    write_parquet({"prompt": ["b0", "b1"]}, "d/b.parquet")
    write_parquet({"prompt": ["a0"]}, "d/a.parquet")
    write_parquet({"prompt": ["c0"]}, "d/sub/c.parquet")
    (tmp_path / "d" / "_SUCCESS").write_text("")
    s = source(tmp_path / "d")
    rows = all_rows(s)
    assert [(f, i) for f, i, _ in rows] == [("a.parquet", 0), ("b.parquet", 0), ("b.parquet", 1), ("sub/c.parquet", 0)]
    assert s.id_type == pa.string()


def test_glob(tmp_path, write_parquet):
    write_parquet({"prompt": ["x"]}, "g/one.parquet")
    write_parquet({"prompt": ["y"]}, "g/two.parquet")
    write_parquet({"prompt": ["z"]}, "g/skip.txt")
    s = source(f"{tmp_path}/g/*.parquet")
    assert [f for f, _, _ in all_rows(s)] == ["one.parquet", "two.parquet"]


def test_memory_and_file_urls(tmp_path, write_parquet):
    table = pa.table({"id": ["m1", "m2"], "prompt": ["p1", "p2"]})
    fs = fsspec.filesystem("memory")
    with fs.open("/src/in.parquet", "wb") as f:
        pq.write_table(table, f)
    assert [r["id"] for _, _, r in all_rows(source("memory://src/in.parquet"))] == ["m1", "m2"]
    assert [r["id"] for _, _, r in all_rows(source("memory://src"))] == ["m1", "m2"]
    p = write_parquet(table)
    assert [r["id"] for _, _, r in all_rows(source(f"file://{p}"))] == ["m1", "m2"]


def test_streams_in_batches_and_respects_limit(write_parquet):
    p = write_parquet({"prompt": [f"p{i}" for i in range(2500)]})
    s = source(p, batch_rows=1000, limit=2100)
    sizes = [sb.batch.num_rows for sb in s.batches()]
    assert sizes == [1000, 1000, 100]
    assert s.num_rows == 2100


def test_limit_zero_reads_nothing(write_parquet):
    p = write_parquet({"prompt": ["a"]})
    assert list(source(p, limit=0).batches()) == []


def test_only_needed_columns_are_read(write_parquet):
    p = write_parquet({"prompt": ["a"], "big": ["x" * 10], "max_tokens": [5]})
    s = source(p, passthrough="none")
    assert s.read_columns() == ["prompt", "max_tokens"]


@pytest.mark.parametrize("setup,message", [
    ("missing", "Input {p} does not exist. Check the path"),
    ("not_parquet", "{p} is not a readable Parquet file"),
    ("truncated", "{p} is not a readable Parquet file"),
    ("empty_folder", "Folder {p} has no Parquet files (*.parquet)"),
    ("no_glob_match", "No files match {p}"),
])
def test_bad_paths_name_the_file(tmp_path, write_parquet, setup, message):
    if setup == "missing":
        p = tmp_path / "nope.parquet"
    elif setup == "not_parquet":
        p = tmp_path / "notes.parquet"
        p.write_text("id,prompt\n1,hello\n")
    elif setup == "truncated":
        good = write_parquet({"prompt": ["a" * 100] * 100}, "good.parquet")
        data = open(good, "rb").read()
        p = tmp_path / "trunc.parquet"
        p.write_bytes(data[: len(data) // 2])
    elif setup == "empty_folder":
        p = tmp_path / "empty"
        p.mkdir()
    else:
        p = f"{tmp_path}/*.nothing"
    with pytest.raises(InputError) as e:
        source(p)
    assert message.format(p=p) in str(e.value)


def test_missing_prompt_column(write_parquet):
    p = write_parquet({"id": [1], "question": ["q"]})
    with pytest.raises(InputError) as e:
        source(p)
    assert str(e.value) == (f"{p} has no column 'prompt' (columns: id, question). Name the prompt column with "
                            f"--prompt-column, or add a 'messages' column of chats.")
    assert source(p, prompt_column="question").num_rows == 1


def test_prompt_column_of_wrong_type(write_parquet):
    p = write_parquet({"prompt": [1, 2]})
    with pytest.raises(InputError, match="Column 'prompt' in .* has type int64; prompts must be strings"):
        source(p)


def test_mixed_schemas_name_both_files(tmp_path, write_parquet):
    a = write_parquet({"id": [1], "prompt": ["x"]}, "m/a.parquet")
    b = write_parquet({"id": ["s"], "prompt": ["y"]}, "m/b.parquet")
    with pytest.raises(InputError) as e:
        source(tmp_path / "m")
    assert f"Column 'id' has type int64 in {a} but string in {b}" in str(e.value)


def test_compatible_widths_are_unified(tmp_path):
    (tmp_path / "w").mkdir()
    pq.write_table(pa.table({"prompt": ["x"], "max_tokens": pa.array([5], pa.int32())}), tmp_path / "w/a.parquet")
    pq.write_table(pa.table({"prompt": ["y"], "max_tokens": pa.array([6], pa.int64())}), tmp_path / "w/b.parquet")
    s = source(tmp_path / "w")
    assert s.schema.field("max_tokens").type == pa.int64()
    assert [r["max_tokens"] for _, _, r in all_rows(s)] == [5, 6]


def test_column_present_in_some_files_only_reads_as_null(tmp_path, write_parquet):
    write_parquet({"prompt": ["x"], "max_tokens": [5]}, "s/a.parquet")
    write_parquet({"prompt": ["y"]}, "s/b.parquet")
    rows = all_rows(source(tmp_path / "s"))
    assert [r["max_tokens"] for _, _, r in rows] == [5, None]


def test_bad_id_type(write_parquet):
    p = write_parquet({"id": [1.5], "prompt": ["x"]})
    with pytest.raises(InputError, match="Id column 'id' in .* has type double; ids must be integers or strings"):
        source(p)


def test_unknown_passthrough_column(write_parquet):
    p = write_parquet({"prompt": ["x"]})
    with pytest.raises(InputError, match="Passthrough column 'nope' is not in"):
        source(p, passthrough=["nope"])
