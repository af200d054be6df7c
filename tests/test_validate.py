import pyarrow as pa
import pytest

from overnight.pipeline.config import InputConfig, SamplingConfig
from overnight.pipeline.input.source import InputFile, SourceBatch
from overnight.pipeline.input.validate import parse_batch, sampling_defaults

DEFAULTS = sampling_defaults(SamplingConfig(max_tokens=100, temperature=0.5))


def parse(columns: dict, cfg: InputConfig = InputConfig(), start: int = 0, passthrough=()):
    batch = pa.RecordBatch.from_pydict(columns) if isinstance(columns, dict) else columns
    f = InputFile(path="/x/in.parquet", name="in.parquet", num_rows=batch.num_rows, schema=batch.schema)
    return parse_batch(SourceBatch(f, start, batch), cfg, DEFAULTS, list(passthrough))


def test_valid_rows_take_defaults_and_derived_ids():
    parsed, errors = parse({"prompt": ["hello", "world"]}, start=10)
    assert errors == []
    assert [p.id for p in parsed] == ["in.parquet#10", "in.parquet#11"]
    assert parsed[0].sampling["max_tokens"] == 100 and parsed[0].sampling["temperature"] == 0.5


def test_id_column_is_used():
    parsed, _ = parse({"id": [7, 8], "prompt": ["a", "b"]})
    assert [p.id for p in parsed] == [7, 8]


@pytest.mark.parametrize("prompt,message", [
    (None, "in.parquet#0: prompt column 'prompt' is null; give the row a prompt or a 'messages' chat"),
    ("", "in.parquet#0: prompt column 'prompt' is empty; give the row a prompt"),
    ("  \n\t", "in.parquet#0: prompt column 'prompt' is empty; give the row a prompt"),
])
def test_bad_prompts_become_error_rows(prompt, message):
    parsed, errors = parse({"id": ["r"], "prompt": pa.array([prompt], pa.string())})
    assert parsed == []
    assert len(errors) == 1
    assert errors[0].status == "error" and errors[0].id == "r" and errors[0].error == message


def test_invalid_utf8_in_a_binary_prompt_column():
    parsed, errors = parse({"prompt": pa.array([b"fine", b"bad \xff byte"], pa.binary())})
    assert [p.prompt for p in parsed] == ["fine"]
    assert errors[0].error == ("in.parquet#1: prompt column 'prompt' is not valid text: byte 4 is not valid UTF-8 "
                               "(b'\\xff'); re-encode the file as UTF-8")


def test_request_columns_stored_as_binary_are_read_as_text():
    """Writers that store strings without Parquet's UTF8 annotation give binary columns: a row's stop, schema,
    choice, lora and chat are read as the text they hold, as a binary prompt is; bytes that are not UTF-8 make an
    error row naming the column."""
    b = pa.binary()
    parsed, errors = parse({
        "id": ["a", "b", "c", "d"], "prompt": pa.array([b"hi", b"yo", b"x", None], b),
        "stop": pa.array([b"STOP", None, None, None], b),
        "json_schema": pa.array([None, b'{"type": "object"}', None, None], b),
        "choice": pa.array([None, None, [b"yes", b"no"], None], pa.list_(b)),
        "messages": pa.array([None, None, None, b'[{"role": "user", "content": "hey"}]'], b),
        "regex": pa.array([None, None, None, b"[a-z]+"], pa.large_binary())})
    assert errors == [] and [p.id for p in parsed] == ["a", "b", "c", "d"]
    assert parsed[0].sampling["stop"] == ["STOP"]
    assert "json" in parsed[1].sampling["structured"] and parsed[2].sampling["structured"]["choice"] == ["yes", "no"]
    assert parsed[3].messages == [{"role": "user", "content": "hey"}]
    parsed, errors = parse({"id": ["e"], "prompt": ["hi"], "choice": pa.array([[b"ok", b"\xff"]], pa.list_(b))})
    assert parsed == [] and "choice is not valid text: byte 0 is not valid UTF-8" in errors[0].error


def test_per_row_overrides():
    parsed, errors = parse({
        "prompt": ["a", "b", "c"],
        "max_tokens": [5, None, 7.0],
        "temperature": [0.0, 1.2, None],
        "top_p": [None, 0.5, None],
        "seed": [1, None, 3],
        "stop": [["###"], None, ["x", ""]],
    })
    assert errors == []
    s = [p.sampling for p in parsed]
    assert (s[0]["max_tokens"], s[0]["temperature"], s[0]["seed"], s[0]["stop"]) == (5, 0.0, 1, ["###"])
    assert (s[1]["max_tokens"], s[1]["temperature"], s[1]["top_p"]) == (100, 1.2, 0.5)
    assert (s[2]["max_tokens"], s[2]["temperature"], s[2]["stop"]) == (7, 0.5, ["x"])


@pytest.mark.parametrize("column,value,message", [
    ("max_tokens", 0, "max_tokens is 0; it must be at least 1 (or null for the job default)"),
    ("max_tokens", -3, "max_tokens is -3; it must be at least 1 (or null for the job default)"),
    ("max_tokens", 2.5, "max_tokens is 2.5 (float); it must be an integer"),
    ("max_tokens", "lots", "max_tokens is 'lots' (str); it must be an integer"),
    ("temperature", -0.1, "temperature is -0.1; it must be 0 (greedy) to 2"),
    ("temperature", "warm", "temperature is 'warm' (str); it must be a number"),
    ("top_p", 0.0, "top_p is 0.0; it must be in (0, 1]"),
    ("seed", "abc", "seed is 'abc' (str); it must be an integer"),
    ("seed", 1e20, "seed is 100000000000000000000; it must be within ±2**62 (4611686018427387904)"),
    ("stop", 5, "stop is 5; it must be a string or a list of strings"),
])
def test_bad_override_becomes_an_error_row_naming_the_column(column, value, message):
    parsed, errors = parse({"id": ["good", "bad"], "prompt": ["a", "b"], column: [None, value]})
    assert [p.id for p in parsed] == ["good"]
    assert errors[0].id == "bad"
    assert errors[0].error == f"in.parquet#1: {message}"


def test_messages_column():
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    parsed, errors = parse({"prompt": [None, "plain"], "messages": [chat, None]})
    assert errors == []
    assert parsed[0].messages == chat and parsed[0].prompt is None
    assert parsed[1].prompt == "plain" and parsed[1].messages is None


def test_a_null_chat_without_a_prompt_column_says_so():
    parsed, errors = parse({"messages": ['[{"role": "user", "content": "Hi"}]', None]})
    assert [p.messages for p in parsed] == [[{"role": "user", "content": "Hi"}]]
    assert errors[0].error == ("in.parquet#1: messages column 'messages' is null, and the input has no prompt column "
                               "'prompt'; give the row a chat")


def test_messages_as_json_string():
    parsed, errors = parse({"messages": ['[{"role": "user", "content": "Hi"}]']})
    assert errors == [] and parsed[0].messages == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("messages,message", [
    ([], "messages must be a non-empty list of {role, content}, got []"),
    ('not json', "messages is a string but not JSON; give a list of {role, content}"),
    ([{"role": "robot", "content": "x"}],
     "messages[0].role is 'robot'; use one of system, user, assistant, tool (or developer, read as system)"),
    ([{"content": "x"}], "messages[0] must be a {role, content} mapping, got {'content': 'x'}"),
    ([{"role": "user", "content": 5}],
     "messages[0].content must be a string or a list of text parts ({type: text, text}), got 5"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
     "messages[0].content must be a string or a list of text parts ({type: text, text}), got [{'type': 'image_url', 'image_url': 'x'}]"),
    ([{"role": "user", "content": " "}], "messages has no content; give at least one non-empty message"),
])
def test_bad_messages_become_error_rows(messages, message):
    import json
    value = messages if isinstance(messages, str) else json.dumps(messages)
    parsed, errors = parse({"messages": [value]})
    assert parsed == []
    assert errors[0].error == f"in.parquet#0: {message}"


def test_null_id_becomes_an_error_row():
    parsed, errors = parse({"id": pa.array([None, 2], pa.int64()), "prompt": ["a", "b"]})
    assert [p.id for p in parsed] == [2]
    assert "column 'id' is null" in errors[0].error


def test_passthrough_values_are_carried():
    parsed, errors = parse({"prompt": ["a", None], "category": ["x", "y"]}, passthrough=["category", "prompt"])
    assert parsed[0].passthrough == {"category": "x", "prompt": "a"}
    assert errors[0].passthrough == {"category": "y", "prompt": None}


def test_structured_output_and_sampling_columns_per_row():
    import json

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    parsed, errors = parse({
        "id": [1, 2, 3, 4, 5, 6],
        "prompt": ["p"] * 6,
        "json_schema": [json.dumps(schema), None, None, None, None, None],
        "response_format": [None, json.dumps({"type": "json_schema", "json_schema": {"schema": schema}}),
                            json.dumps({"type": "json_object"}), json.dumps({"type": "text"}), None, None],
        "regex": [None, None, None, None, "[a-z]+", None],
        "choice": [None, None, None, None, None, ["x", "y"]],
        "min_tokens": [None, 5, None, None, None, None],
        "presence_penalty": [0.5, None, None, None, None, None],
        "stop_token_ids": [[2, 3], None, None, None, None, None],
    })
    assert errors == []
    by = {p.id: p.sampling for p in parsed}
    assert by[1]["structured"] == {"json": schema} and by[1]["presence_penalty"] == 0.5
    assert by[1]["stop_token_ids"] == [2, 3]
    assert by[2]["structured"] == {"json": schema} and by[2]["min_tokens"] == 5
    assert by[3]["structured"] == {"json_object": True} and by[4]["structured"] == {}
    assert by[5]["structured"] == {"regex": "[a-z]+"} and by[6]["structured"] == {"choice": ["x", "y"]}


@pytest.mark.parametrize("column,value,message", [
    ("json_schema", '{"type": "nonsense"}', "json_schema is not a valid JSON schema"),
    ("json_schema", "{not json", "json_schema is not valid JSON"),
    ("response_format", '{"type": "xml"}', "use OpenAI's shape"),
    ("regex", "([a-z", "is not a valid regular expression"),
    ("presence_penalty", 3.0, "between -2 and 2"),
    ("min_tokens", -1, "min_tokens is -1"),
])
def test_bad_request_columns_become_error_rows(column, value, message):
    parsed, errors = parse({"id": ["r"], "prompt": ["p"], column: [value]})
    assert parsed == [] and len(errors) == 1
    assert errors[0].error.startswith("in.parquet#0: ") and message in errors[0].error


def test_a_bad_job_schema_fails_the_job_before_it_starts(tmp_path):
    from overnight.pipeline.config import ConfigError
    from overnight.pipeline.input.checks import job_structured

    with pytest.raises(ConfigError, match="--json-schema .*cannot read it"):
        job_structured(SamplingConfig(json_schema=str(tmp_path / "missing.json")))
    with pytest.raises(ConfigError, match="not a valid JSON schema"):
        job_structured(SamplingConfig(json_schema='{"type": 7}'))
    assert job_structured(SamplingConfig(choice=["a", "b"])) == {"choice": ["a", "b"]}


def test_values_vllm_refuses_become_error_rows():
    # vLLM refuses a temperature above 2 and min_tokens above max_tokens when the row is added; the job's own checks
    # make such rows error rows before they reach it
    parsed, errors = parse({"id": ["hot", "inf", "min", "ok"], "prompt": ["a", "b", "c", "d"],
                            "temperature": [3.0, float("inf"), None, 2.0], "min_tokens": [None, None, 150, 100]})
    assert [p.id for p in parsed] == ["ok"]
    got = {e.id: e.error for e in errors}
    assert got["hot"] == "in.parquet#0: temperature is 3.0; it must be 0 (greedy) to 2"
    assert got["inf"] == "in.parquet#1: temperature is inf; it must be 0 (greedy) to 2"
    assert got["min"] == ("in.parquet#2: min_tokens (150) is above max_tokens (100); lower the row's min_tokens or "
                          "raise its max_tokens")


def test_a_row_with_two_structured_outputs_is_an_error_row():
    parsed, errors = parse({"id": ["two", "one"], "prompt": ["a", "b"],
                            "json_schema": ['{"type": "object"}', None], "choice": [["yes", "no"], ["x", "y"]]})
    assert [p.id for p in parsed] == ["one"] and parsed[0].sampling["structured"] == {"choice": ["x", "y"]}
    assert errors[0].error == ("in.parquet#0: the row sets json_schema and choice, and a request takes one "
                               "structured output; keep one of them and set the others to null")


def test_struct_schemas_of_different_shapes_in_one_column():
    # Arrow gives a struct column the union of the rows' keys, filling each row's missing ones with null
    s1 = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    s2 = {"type": "string", "maxLength": 10}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": s2}}
    batch = pa.RecordBatch.from_pydict({"prompt": ["a", "b", "c"], "json_schema": pa.array([s1, s2, None]),
                                        "response_format": pa.array([None, None, rf])})
    assert batch.column("json_schema").to_pylist()[1]["required"] is None   # what the check is given
    parsed, errors = parse(batch)
    assert errors == []
    assert [p.sampling["structured"] for p in parsed] == [{"json": s1}, {"json": s2}, {"json": s2}]


def test_values_python_cannot_hold_make_error_rows_naming_the_column():
    import datetime as dt

    not_utf8 = pa.array([b"fine", b"caf\xe9", b"fine"], pa.binary()).view(pa.string())
    when = pa.array([0, 0, 2 ** 62], pa.timestamp("us"))   # the last: far past year 9999
    parsed, errors = parse({"id": ["ok", "text", "time"], "prompt": ["a", "b", "c"], "note": not_utf8,
                            "created_at": when}, passthrough=["note", "created_at"])
    assert [p.id for p in parsed] == ["ok"]
    assert parsed[0].passthrough == {"note": "fine", "created_at": dt.datetime(1970, 1, 1)}
    got = {e.id: e for e in errors}
    assert got["text"].error == ("in.parquet#1: passthrough column 'note' is not valid text: byte 3 is not valid "
                                 "UTF-8 (b'\\xe9'); re-encode the file as UTF-8, or leave the column out of "
                                 "--passthrough")
    assert got["time"].error == ("in.parquet#2: passthrough column 'created_at' holds a value that cannot be read "
                                 "(OverflowError: date value out of range); fix the value, or leave the column out "
                                 "of --passthrough")
    # the error rows carry the values that can be written, and null for the others
    assert got["text"].passthrough == {"note": None, "created_at": dt.datetime(1970, 1, 1)}
    assert got["time"].passthrough == {"note": "fine", "created_at": None}


def test_a_string_prompt_that_is_not_utf8_is_an_error_row_even_when_passed_through():
    prompts = pa.array([b"Say hi.", b"caf\xe9 au lait"], pa.binary()).view(pa.string())
    parsed, errors = parse({"id": ["good", "bad"], "prompt": prompts}, passthrough=["prompt"])
    assert [p.id for p in parsed] == ["good"] and parsed[0].passthrough == {"prompt": "Say hi."}
    assert errors[0].error == ("in.parquet#1: prompt column 'prompt' is not valid text: byte 3 is not valid UTF-8 "
                               "(b'\\xe9'); re-encode the file as UTF-8")


def test_an_id_that_is_not_utf8_is_an_error_row_without_an_id(write_parquet):
    from overnight.pipeline.input.source import ParquetSource

    message = ("in.parquet#1: column 'id' is not valid text: byte 3 is not valid UTF-8 (b'\\xe9'); re-encode the ids "
               "as UTF-8, or drop the column so ids are derived from file and row")
    ids = pa.array([b"good", b"caf\xe9-1", b"caf\xe9-2"], pa.binary()).view(pa.string())
    # as the source hands it over (the id read as null, the reason in the column's metadata) ...
    src = ParquetSource(InputConfig(path=write_parquet({"id": ids, "prompt": ["a", "b", "c"]})))
    (sb,) = list(src.batches())
    parsed, errors = parse_batch(sb, InputConfig(), DEFAULTS, [])
    assert [p.id for p in parsed] == ["good"]
    assert [(e.id, e.error) for e in errors] == [(None, message), (None, message.replace("#1", "#2"))]
    # ... and as a batch read directly
    parsed, errors = parse({"id": ids, "prompt": ["a", "b", "c"]})
    assert [p.id for p in parsed] == ["good"] and [e.id for e in errors] == [None, None]
    assert errors[0].error == message


@pytest.mark.parametrize("column,value,message", [
    ("regex", "a{4294967296}", "regex 'a{4294967296}' is not a valid regular expression: the repetition number is "
                               "too large"),
    ("json_schema", '{"$schema": 5, "type": "object"}',
     "json_schema is not a valid JSON schema (AttributeError: 'int' object has no attribute 'decode'); check its "
     "$schema (a URI string) and keywords"),
    ("json_schema", '{"$schema": [], "type": "object"}',
     "json_schema is not a valid JSON schema (TypeError: unhashable type: 'list'); check its $schema (a URI string) "
     "and keywords"),
    ("json_schema", "[" * 100000 + "]" * 100000, "json_schema is nested too deeply to read; give the schema as a "
                                                 "JSON object"),
    ("deadline", "0001-01-01T00:00", "deadline is '0001-01-01T00:00', out of the range of times this machine can "
                                     "hold; use a time such as 2026-11-23T06:00"),
    ("deadline", "0001-01-01T00:00:00+05:00", "deadline is '0001-01-01T00:00:00+05:00', out of the range of times "
                                              "this machine can hold; use a time such as 2026-11-23T06:00"),
    ("priority", 1e20, "priority is 100000000000000000000; it must be within ±2**31 (2147483648), lower runs sooner"),
    ("value", float("inf"), "value is inf; it must be a finite number, 0 or more"),
    ("messages", '[{"role": ["user"], "content": "hi"}]',
     "messages[0].role is ['user']; use one of system, user, assistant, tool (or developer, read as system)"),
    ("messages", '[{"role": "user", "content": "\\ud800 hi"}]',
     "messages[0].content is not valid text (a lone UTF-16 surrogate); fix the message"),
])
def test_a_check_that_fails_on_an_odd_value_makes_an_error_row(column, value, message):
    parsed, errors = parse({"id": ["good", "bad"], "prompt": ["a", "b"], column: [None, value]})
    assert [p.id for p in parsed] == ["good"]
    assert errors[0].id == "bad" and errors[0].error == f"in.parquet#1: {message}"


def test_any_other_exception_of_a_check_makes_an_error_row(monkeypatch):
    from overnight.pipeline.input import checks

    def boom(value):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setitem(checks._OVERRIDE_CHECKS, "seed", boom)
    parsed, errors = parse({"id": ["good", "bad"], "prompt": ["a", "b"], "seed": [None, 3]})
    assert [p.id for p in parsed] == ["good"]
    assert errors[0].error == ("in.parquet#1: seed could not be checked (RecursionError: maximum recursion depth "
                               "exceeded); fix the value, or set it to null")


def test_messages_as_a_list_of_maps():
    msgs = pa.array([[[("role", "system"), ("content", "Be brief.")], [("role", "user"), ("content", "Hi")]]],
                    pa.list_(pa.map_(pa.string(), pa.string())))
    parsed, errors = parse(pa.RecordBatch.from_pydict({"id": ["r0"], "messages": msgs}))
    assert errors == []
    assert parsed[0].messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_messages_read_as_the_openai_jsonl_input_reads_them():
    # the developer role is system, and text content parts (a struct list, or a list of maps) are joined
    parts = pa.array([[{"role": "developer", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]},
                       {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]])
    parsed, errors = parse(pa.RecordBatch.from_pydict({"id": ["r0"], "messages": parts}))
    assert errors == []
    assert parsed[0].messages == [{"role": "system", "content": "Be\nbrief."}, {"role": "user", "content": "Hi"}]
    maps = pa.array([[[("role", "user"), ("content", None)]]], pa.list_(pa.map_(pa.string(), pa.string())))
    parsed, errors = parse(pa.RecordBatch.from_pydict({"id": ["r1"], "messages": maps}))
    assert parsed == [] and "messages[0].content must be a string" in errors[0].error


def test_a_chat_with_per_row_columns_parses_without_job_defaults():
    # the resume filter re-parses rows whose prompt it cannot hash from the column's bytes (chats) with no defaults
    import json

    from overnight.pipeline.input.validate import prompt_hash

    chat = [{"role": "user", "content": "Hi"}]
    batch = pa.RecordBatch.from_pydict({"id": ["a"], "messages": [json.dumps(chat)], "temperature": [0.5]})
    f = InputFile(path="/x/in.parquet", name="in.parquet", num_rows=1, schema=batch.schema)
    parsed, errors = parse_batch(SourceBatch(f, 0, batch), InputConfig(), {}, [])
    assert errors == [] and parsed[0].prompt_hash == prompt_hash(None, chat)
