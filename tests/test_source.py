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


def test_struct_schemas_of_other_shapes_in_other_files_are_merged(tmp_path, write_parquet):
    # a JSON schema per file, as structs: their fields merge, each row's missing ones null (dropped by validate)
    from overnight.pipeline.input.validate import parse_batch
    from tests.test_validate import DEFAULTS

    s1 = {"type": "object", "properties": {"a": {"type": "string"}}}
    s2 = {"type": "object", "properties": {"b": {"type": "integer"}}}
    write_parquet({"id": ["x"], "prompt": ["p"], "json_schema": [s1]}, "j/a.parquet")
    write_parquet({"id": ["y"], "prompt": ["q"], "json_schema": [s2]}, "j/b.parquet")
    src = source(tmp_path / "j")
    got = [p.sampling["structured"] for sb in src.batches() for p in parse_batch(sb, src.cfg, DEFAULTS, [])[0]]
    assert got == [{"json": s1}, {"json": s2}]
    # fields of one name but types that do not merge: refused, naming the JSON text form
    write_parquet({"id": ["z"], "prompt": ["r"], "json_schema": [{"type": "object", "properties": 5}]},
                  "j/c.parquet")
    with pytest.raises(InputError, match="or write it as JSON text"):
        source(tmp_path / "j")
    # nor is a field's type promoted: a list of text beside a list of bytes would make the text bytes
    write_parquet({"id": ["v"], "prompt": ["s"], "tags": pa.array([["x"]], pa.list_(pa.string()))}, "k/a.parquet")
    write_parquet({"id": ["w"], "prompt": ["t"], "tags": pa.array([[b"y"]], pa.list_(pa.binary()))}, "k/b.parquet")
    with pytest.raises(InputError, match=r"Column 'tags' has type list<\w+: string> .* but list<\w+: binary>"):
        source(tmp_path / "k", passthrough=["tags"])
    # a third file is checked against the first two's fields together
    meta = [{"x": "a"}, {"x": "b", "y": "c"}, {"x": "d", "y": b"e"}]
    for i, m in enumerate(meta):
        write_parquet({"id": [str(i)], "prompt": ["p"], "meta": [m]}, f"m/{i}.parquet")
    with pytest.raises(InputError, match=r"Column 'meta' has type struct<x: string, y: string> .* but struct<x: "
                                         r"string, y: binary>"):
        source(tmp_path / "m", passthrough=["meta"])


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


@pytest.mark.parametrize("rule", ["rows", "fragments"])
def test_a_split_of_one_row_group_without_ids_counts_its_rows(write_parquet, rule):
    """Equal ranges slice the one row group; the old rule (OUTs begun before stop 42) hashes the rows' origins."""
    from overnight.pipeline.input.shards import Shard

    p = write_parquet({"prompt": [f"p{i}" for i in range(100)]})
    counts = []
    for k in range(4):
        s = ParquetSource(InputConfig(path=p), Shard(k, 4), rule)
        assert (s.selection.hash_of is not None) == (rule == "fragments")
        read = sum(sb.batch.num_rows for sb in s.batches())
        assert s.num_rows == read > 0   # the count the job plans with is the rows it reads
        counts.append(read)
    assert sum(counts) == 100 and (rule == "fragments" or counts == [25] * 4)


def test_uint64_ids_above_int64_are_refused_when_the_source_opens(write_parquet):
    p = write_parquet({"id": pa.array([1, 2 ** 63 + 5], pa.uint64()), "prompt": ["a", "b"]})
    with pytest.raises(InputError) as e:
        source(p)
    assert str(e.value) == (f"Id column 'id' in {p} is uint64 and holds values above 9223372036854775807; the results keep integer ids as int64. Cast the "
                            f"column to int64 or string, or name another column with --id-column.")
    small = write_parquet({"id": pa.array([1, 2 ** 63 - 1], pa.uint64()), "prompt": ["a", "b"]}, "small.parquet")
    s = source(small)
    assert s.id_type == pa.int64() and [r["id"] for _, _, r in all_rows(s)] == [1, 2 ** 63 - 1]
    # without the row groups' statistics the ids are read once to tell
    for ids, fits in (([1, 2 ** 63 - 1], True), ([1, 2 ** 63 + 5], False)):
        path = p.replace(".parquet", f"-nostats-{fits}.parquet")
        pq.write_table(pa.table({"id": pa.array(ids, pa.uint64()), "prompt": ["a", "b"]}), path,
                       write_statistics=False)
        if fits:
            assert source(path).id_type == pa.int64()
        else:
            with pytest.raises(InputError, match="is uint64 and holds values above"):
                source(path)


def test_a_damaged_data_page_names_the_file_and_row_group(tmp_path, write_parquet):
    write_parquet({"prompt": ["fine"] * 10}, "d/a.parquet")
    b = write_parquet(pa.table({"prompt": [f"What is it {i} " * 5 for i in range(2000)]}), "d/b.parquet")
    data = bytearray(open(b, "rb").read())
    mid = len(data) // 2
    data[mid:mid + 64] = b"\xff" * 64   # the footer is intact, a page is not
    open(b, "wb").write(bytes(data))
    s = source(tmp_path / "d")   # opens: the footers are fine
    with pytest.raises(InputError) as e:
        all_rows(s)
    assert str(e.value).startswith(f"{b}: row group 0 (rows from 0) cannot be read (")
    assert str(e.value).endswith("). The file is damaged: re-export it, or remove it from the input (rows already "
                                 "answered are kept). If it is on remote storage that failed, rerun: the job resumes.")


def test_a_rewrite_of_the_same_size_changes_the_stamp(monkeypatch):
    fs = fsspec.filesystem("memory")
    with fs.open("/stamp/in.parquet", "wb") as f:
        pq.write_table(pa.table({"id": ["a"], "prompt": ["x"]}), f)
    first = source("memory://stamp/in.parquet")
    assert first.input_stamp() == source("memory://stamp/in.parquet").input_stamp()   # unchanged: the same
    with fs.open("/stamp/in.parquet", "wb") as f:
        pq.write_table(pa.table({"id": ["b"], "prompt": ["y"]}), f)   # the same size, other rows
    again = source("memory://stamp/in.parquet")
    assert again.files[0].version.split(":")[0] == first.files[0].version.split(":")[0]
    assert again.input_stamp() != first.input_stamp()
    # a file system that tells only the size: no version, and a stamp that never matches (the job scans OUT)
    info = type(fs).info
    monkeypatch.setattr(type(fs), "info", lambda self, path, **kw: {
        k: v for k, v in info(self, path, **kw).items() if k in ("name", "size", "type")})
    blind = source("memory://stamp/in.parquet")
    assert blind.files[0].version == ""
    assert blind.input_stamp() != source("memory://stamp/in.parquet").input_stamp()


def test_a_folder_skips_hidden_and_underscore_folders(tmp_path, write_parquet):
    t = pa.table({"prompt": ["Say hi.", "Say bye."]})
    write_parquet(t, "in/part-00000.parquet")
    write_parquet(t, "in/_temporary/0/_temporary/attempt_1/part-00000.parquet")
    write_parquet(t, "in/.snapshot/part-00000.parquet")
    write_parquet(t, "in/_delta_log/x.parquet")
    write_parquet(t, "in/sub/part-00001.parquet")
    s = source(tmp_path / "in")
    assert [f.name for f in s.files] == ["part-00000.parquet", "sub/part-00001.parquet"] and s.num_rows == 4
    # a glob's matches too: `in/**/*.parquet` read Spark's attempt files again, and `in/*` failed on _SUCCESS
    (tmp_path / "in" / "_SUCCESS").write_text("")
    s = source(f"{tmp_path}/in/**/*.parquet")
    assert [f.name for f in s.files] == ["part-00000.parquet", "sub/part-00001.parquet"] and s.num_rows == 4
    assert [f.name for f in source(f"{tmp_path}/in/*").files] == ["part-00000.parquet"]
    assert [f.name for f in source(f"{tmp_path}/in/_temporary/0/_temporary/attempt_1/*.parquet").files] == [
        "part-00000.parquet"]                                             # in a hidden folder the glob names


def test_string_view_ids_and_prompts(tmp_path):
    (tmp_path / "v").mkdir()
    view = pa.table({"id": pa.array(["a", "b"], pa.string_view()), "prompt": pa.array(["x", "y"], pa.string_view())})
    pq.write_table(view, tmp_path / "v/a.parquet")
    pq.write_table(pa.table({"id": ["c"], "prompt": ["z"]}), tmp_path / "v/b.parquet")
    s = source(tmp_path / "v")
    assert s.id_type == pa.string() and s.schema.field("id").type == pa.string()
    assert [(r["id"], r["prompt"]) for _, _, r in all_rows(s)] == [("a", "x"), ("b", "y"), ("c", "z")]
    assert source(tmp_path / "v/a.parquet").has_id_column


def test_ids_that_are_not_utf8_read_as_null_and_say_why(write_parquet):
    import json

    from overnight.pipeline.input.arrow_types import BAD_IDS_KEY

    ids = pa.array([b"good", b"caf\xe9-1", None], pa.binary()).view(pa.string())
    s = source(write_parquet({"id": ids, "prompt": ["a", "b", "c"]}))
    (sb,) = list(s.batches())
    assert sb.batch.column("id").to_pylist() == ["good", None, None]
    meta = sb.batch.schema.field("id").metadata
    assert json.loads(meta[BAD_IDS_KEY]) == {"1": "byte 3 is not valid UTF-8 (b'\\xe9')"}
