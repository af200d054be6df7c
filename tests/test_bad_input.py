"""Bad input, table-driven: each case asserts the exit code and the exact message.

A job-level problem stops before the engine starts (exit 1, `Error: ...` naming
the file, column or key and the fix). A row-level problem becomes an error row
with its own message, and the job goes on (exit 0). Row-level cases run on the
echo engine (OVERNIGHT_ENGINE=echo) to stay fast; the same paths through the
real engine are in test_engine_cli.py. Jobs run on the tiny model (tests/fakes.py:
a tokenizer, a chat template and a 2048-token context): the token counts below
are its counts.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Callable, Optional

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from overnight.jobs.cli import cli

ECHO = {"OVERNIGHT_ENGINE": "echo"}


@dataclass
class Case:
    name: str
    # Builds the inputs in a folder; returns the command-line arguments after `overnight`.
    setup: Callable[["Env"], list]
    code: int
    # Job-level: the whole stderr message. Row-level: the error of the row with id "bad".
    message: Optional[str] = None
    row_error: Optional[str] = None
    # For messages that quote a library's own text: compare the start and the end only.
    prefix: Optional[str] = None
    suffix: Optional[str] = None
    extra: dict = field(default_factory=dict)


class Env:
    def __init__(self, root, model):
        self.root = root
        self.out = str(root / "out")
        self.model = model

    def parquet(self, table, name="in.parquet") -> str:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table if isinstance(table, pa.Table) else pa.table(table), path)
        return str(path)

    def rows(self, **bad) -> str:
        """One good row and one bad row (id "bad"), the bad row's columns as given."""
        cols = {"id": ["good", "bad"], "prompt": ["Say hi.", bad.pop("prompt", "Say bye.")]}
        for k, v in bad.items():
            cols[k] = pa.array([None, v]) if not isinstance(v, pa.Array) else v
        return self.parquet(cols)

    def text(self, name, content) -> str:
        path = self.root / name
        path.write_text(content)
        return str(path)


def run_args(e: Env, inp: str, *more) -> list:
    """A run on the tiny model, unless the case names its own --model."""
    model = [] if "--model" in more else ["--model", e.model]
    return ["run", inp, "--out", e.out, "--max-tokens", "16", *model, *more]


def model_without_tokenizer(e: Env) -> str:
    dst = e.root / "no-tokenizer"
    dst.mkdir()
    shutil.copy(os.path.join(e.model, "config.json"), dst / "config.json")
    return str(dst)


def other_job_out(e: Env) -> list:
    inp = e.parquet({"id": ["a"], "prompt": ["hi"]})
    r = CliRunner(env=ECHO).invoke(cli, run_args(e, inp, "--temperature", "0.5"))
    assert r.exit_code == 0, r.output
    return run_args(e, inp, "--temperature", "0.9")


def mixed(e: Env) -> list:
    e.parquet({"id": [1], "prompt": ["a"]}, "m/a.parquet")
    e.parquet({"id": ["x"], "prompt": ["b"]}, "m/b.parquet")
    return run_args(e, str(e.root / "m"))


def empty_folder(e: Env) -> list:
    (e.root / "empty").mkdir()
    return run_args(e, str(e.root / "empty"))


def truncated(e: Env) -> str:
    good = e.parquet({"prompt": ["x" * 200] * 200}, "good.parquet")
    data = open(good, "rb").read()
    path = e.root / "trunc.parquet"
    path.write_bytes(data[: len(data) // 2])
    return str(path)


def damaged(e: Env) -> str:
    path = e.parquet({"prompt": [f"What is it {i} " * 5 for i in range(2000)]})
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2:len(data) // 2 + 64] = b"\xff" * 64   # a data page, not the footer
    open(path, "wb").write(bytes(data))
    return path


def not_utf8(*values: bytes) -> pa.Array:
    """A string column holding bytes that are not UTF-8 (as a writer that does not check them leaves it)."""
    return pa.array(values, pa.binary()).view(pa.string())


CASES = [
    # -- job level: before the engine ---------------------------------------------------------
    Case("missing path", lambda e: run_args(e, str(e.root / "nope.parquet")), 1,
         "Error: Input {root}/nope.parquet does not exist. Check the path (local paths are relative to the current "
         "folder; remote ones need a scheme such as s3://)."),
    Case("not parquet", lambda e: run_args(e, e.text("notes.parquet", "id,prompt\n1,hi\n")), 1,
         prefix="Error: {root}/notes.parquet is not a readable Parquet file (",
         suffix="). Re-export it as Parquet, or remove it from the input."),
    Case("truncated parquet", lambda e: run_args(e, truncated(e)), 1,
         prefix="Error: {root}/trunc.parquet is not a readable Parquet file (",
         suffix="). Re-export it as Parquet, or remove it from the input."),
    Case("folder without parquet", lambda e: empty_folder(e), 1,
         "Error: Folder {root}/empty has no Parquet files (*.parquet). Point INPUT at the folder that holds them, "
            "or at a file or glob."),
    Case("empty dataset", lambda e: run_args(e, e.parquet(pa.table({"id": pa.array([], pa.string()),
                                                                     "prompt": pa.array([], pa.string())}))), 0,
         "overnight: done: 0/0 rows (0 ok, 0 error), 0 output tokens in 0s (0 tok/s) -> {root}/out; nothing to do: "
         "{root}/in.parquet has no rows"),
    Case("no prompt column", lambda e: run_args(e, e.parquet({"id": [1], "question": ["q"]})), 2,
         "Error: {root}/in.parquet has no column 'prompt' (columns: id, question). Name the prompt column with "
         "--prompt-column, or add a 'messages' column of chats."),
    Case("prompt column not text", lambda e: run_args(e, e.parquet({"prompt": [1, 2]})), 2,
         "Error: Column 'prompt' in {root}/in.parquet has type int64; prompts must be strings. Pick the text column "
         "with --prompt-column."),
    Case("mixed schemas", lambda e: mixed(e), 1,
         "Error: Column 'id' has type int64 in {root}/m/a.parquet but string in {root}/m/b.parquet. Mixed schemas "
         "cannot be read as one dataset: cast the column to one type in every file."),
    Case("two columns of one name", lambda e: run_args(e, e.parquet(pa.Table.from_arrays(
        [pa.array([1]), pa.array(["a"]), pa.array([1]), pa.array([2])], names=["id", "prompt", "x", "x"]))), 2,
         "Error: {root}/in.parquet has two columns named 'x'. Rename one of them and write the file again."),
    Case("id column named as an output column", lambda e: run_args(e, e.parquet({"Run_ID": ["r1"], "prompt": ["a"]}),
                                                                    "--id-column", "Run_ID"), 2,
         "Error: Id column 'Run_ID' in {root}/in.parquet has the name of a column the output writes itself "
         "('run_id'). Rename the column in the input, or name another with --id-column."),
    Case("uint64 ids above int64", lambda e: run_args(e, e.parquet({"id": pa.array([1, 2 ** 63 + 5], pa.uint64()),
                                                                     "prompt": ["a", "b"]})), 1,
         "Error: Id column 'id' in {root}/in.parquet is uint64 and holds values above 9223372036854775807; the "
         "results keep integer ids as int64. Cast the column to int64 or string, or name another column with "
         "--id-column."),
    Case("damaged data page", lambda e: run_args(e, damaged(e)), 1,
         prefix="Error: {root}/in.parquet: row group 0 (rows from 0) cannot be read (",
         suffix="). The file is damaged: re-export it, or remove it from the input (rows already answered are "
                "kept). If it is on remote storage that failed, rerun: the job resumes."),
    Case("yaml unknown key", lambda e: ["run", "--config", e.text("job.yaml", "sampling:\n  temprature: 0.5\n")], 2,
         "Error: {root}/job.yaml: unknown key sampling.temprature in sampling. Valid keys: choice, "
         "frequency_penalty, json_schema, logprobs, max_tokens, min_p, min_tokens, n, presence_penalty, regex, "
         "repetition_penalty, seed, stop, stop_token_ids, temperature, top_k, top_p."),
    Case("yaml wrong type", lambda e: ["run", "--config", e.text("job.yaml", "engine:\n  max_num_seqs: lots\n")], 2,
         "Error: {root}/job.yaml: engine.max_num_seqs must be an integer, got 'lots'."),
    Case("invalid yaml", lambda e: ["run", "--config", e.text("job.yaml", "sampling: [oops\n")], 2,
         prefix="Error: {root}/job.yaml is not valid YAML: "),
    Case("missing model folder", lambda e: run_args(e, e.rows(), "--model", str(e.root / "no-model")), 2,
         "Error: Model folder {root}/no-model does not exist. Pass an existing folder, a hub id such as "
         "HuggingFaceTB/SmolLM2-135M-Instruct, or an alias (smollm2-135m)."),
    Case("model without tokenizer", lambda e: run_args(e, e.rows(), "--model", model_without_tokenizer(e)), 2,
         "Error: Model folder {root}/no-tokenizer has no tokenizer (none of tokenizer.json, tokenizer_config.json, "
         "tokenizer.model, vocab.json). Save it there with tokenizer.save_pretrained('{root}/no-tokenizer')."),
    Case("out is a file", lambda e: ["run", e.rows(), "--out", e.text("out.txt", "x"), "--model", e.model], 1,
         "Error: Output {root}/out.txt is a file. --out needs a folder (it is created when missing)."),
    Case("out of another job", other_job_out, 2,
         "Error: {root}/out holds results of a run with different settings (sampling.temperature: 0.5 -> 0.9). "
         "Resuming would mix outputs. Rerun with the original settings to continue, pass --fresh to discard those "
         "results and start over, or choose another --out."),
    Case("deadline in the past", lambda e: run_args(e, e.rows(), "--deadline", "2020-01-01T00:00"), 2,
         prefix="Error: --deadline (scheduler.deadline) 2020-01-01T00:00 is in the past (it is now ",
         suffix="). Give a later time, or a --time-budget such as 90m."),
    Case("deadline malformed", lambda e: run_args(e, e.rows(), "--deadline", "tomorrow 6am"), 2,
         "Error: --deadline (scheduler.deadline) 'tomorrow 6am' is not an ISO time; use e.g. 2026-11-23T06:00 "
         "(local time) or 2026-11-23T06:00+01:00."),
    Case("time budget malformed", lambda e: run_args(e, e.rows(), "--time-budget", "a while"), 2,
         "Error: --time-budget (scheduler.time_budget) 'a while' is not a duration; use e.g. 90m, 1h30m, 45s "
         "or 3600."),
    # -- row level: an error row, and the job goes on ------------------------------------------
    Case("null prompt", lambda e: run_args(e, e.rows(prompt=None)), 0,
         row_error="in.parquet#1: prompt column 'prompt' is null; give the row a prompt or a 'messages' chat"),
    Case("empty prompt", lambda e: run_args(e, e.rows(prompt="")), 0,
         row_error="in.parquet#1: prompt column 'prompt' is empty; give the row a prompt"),
    Case("whitespace prompt", lambda e: run_args(e, e.rows(prompt=" \t\n ")), 0,
         row_error="in.parquet#1: prompt column 'prompt' is empty; give the row a prompt"),
    # The tiny model's context is 2048 (its config.json); its chat template adds 31 tokens to a prompt.
    Case("prompt over the context", lambda e: run_args(e, e.rows(prompt="word " * 3000)), 0,
         row_error="in.parquet#1: prompt is 3031 tokens after the chat template, which leaves no room for output "
                   "within max_model_len=2048; shorten the prompt or raise --max-model-len (up to the model's "
                   "context)."),
    Case("prompt over max_model_len after the template", lambda e: run_args(e, e.rows(prompt="word " * 40),
                                                                            "--max-model-len", "64"), 0,
         row_error="in.parquet#1: prompt is 71 tokens after the chat template, which leaves no room for output "
                   "within max_model_len=64; shorten the prompt or raise --max-model-len (up to the model's "
                   "context)."),
    Case("invalid utf-8", lambda e: run_args(e, e.parquet({"id": ["good", "bad"], "prompt": pa.array(
        [b"Say hi.", b"caf\xe9 au lait"], pa.binary())})), 0,
         row_error="in.parquet#1: prompt column 'prompt' is not valid text: byte 3 is not valid UTF-8 (b'\\xe9'); "
                   "re-encode the file as UTF-8"),
    Case("lone surrogate", lambda e: run_args(e, e.parquet({"id": ["good", "bad"], "prompt": pa.array(
        [b"Say hi.", b"half a pair: \xed\xa0\x80"], pa.binary())})), 0,
         row_error="in.parquet#1: prompt column 'prompt' is not valid text: byte 13 is not valid UTF-8 (b'\\xed'); "
                   "re-encode the file as UTF-8"),
    Case("invalid utf-8 in a string prompt", lambda e: run_args(e, e.parquet({"id": ["good", "bad"], "prompt": not_utf8(
        b"Say hi.", b"caf\xe9 au lait")})), 0,
         row_error="in.parquet#1: prompt column 'prompt' is not valid text: byte 3 is not valid UTF-8 (b'\\xe9'); "
                   "re-encode the file as UTF-8"),
    Case("invalid utf-8 passed through", lambda e: run_args(e, e.rows(note=not_utf8(b"fine", b"caf\xe9"))), 0,
         row_error="in.parquet#1: passthrough column 'note' is not valid text: byte 3 is not valid UTF-8 (b'\\xe9'); "
                   "re-encode the file as UTF-8, or leave the column out of --passthrough"),
    Case("timestamp out of range passed through", lambda e: run_args(e, e.rows(
        created_at=pa.array([0, 2 ** 62], pa.timestamp("us")))), 0,
         row_error="in.parquet#1: passthrough column 'created_at' holds a value that cannot be read (OverflowError: "
                   "date value out of range); fix the value, or leave the column out of --passthrough"),
    Case("id not utf-8", lambda e: run_args(e, e.parquet({"id": not_utf8(b"good", b"caf\xe9"),
                                                           "prompt": ["a", "b"]})), 0,
         row_error="in.parquet#1: column 'id' is not valid text: byte 3 is not valid UTF-8 (b'\\xe9'); re-encode the "
                   "ids as UTF-8, or drop the column so ids are derived from file and row", extra={"null_id": True}),
    Case("null id", lambda e: run_args(e, e.parquet({"id": pa.array(["good", None]), "prompt": ["a", "b"]})), 0,
         row_error="in.parquet#1: column 'id' is null; give every row an id, or drop the column so ids are derived "
                   "from file and row", extra={"null_id": True}),
    Case("duplicate ids", lambda e: run_args(e, e.parquet({"id": ["good", "good"], "prompt": ["a", "b"]})), 0,
         "overnight: done: 1/2 rows (1 ok, 0 error, 1 duplicate ids skipped)", extra={"contains": True}),
    Case("messages bad role", lambda e: run_args(e, e.rows(prompt=None, messages=json.dumps(
        [{"role": "wizard", "content": "hi"}]))), 0,
         row_error="in.parquet#1: messages[0].role is 'wizard'; use one of system, user, assistant, tool "
                   "(or developer, read as system)"),
    Case("messages bad shape", lambda e: run_args(e, e.rows(prompt=None, messages=json.dumps({"role": "user"}))), 0,
         row_error="in.parquet#1: messages must be a non-empty list of {role, content}, got {'role': 'user'}"),
    Case("max_tokens zero", lambda e: run_args(e, e.rows(max_tokens=0)), 0,
         row_error="in.parquet#1: max_tokens is 0; it must be at least 1 (or null for the job default)"),
    Case("max_tokens not an integer", lambda e: run_args(e, e.rows(max_tokens="many")), 0,
         row_error="in.parquet#1: max_tokens is 'many' (str); it must be an integer"),
    Case("temperature below zero", lambda e: run_args(e, e.rows(temperature=-0.5)), 0,
         row_error="in.parquet#1: temperature is -0.5; it must be 0 (greedy) to 2"),
    # values a library's check fails on (rather than judging them)
    Case("regex repetition too large", lambda e: run_args(e, e.rows(regex="a{4294967296}")), 0,
         row_error="in.parquet#1: regex 'a{4294967296}' is not a valid regular expression: the repetition number is "
                   "too large"),
    Case("json_schema $schema not a string", lambda e: run_args(e, e.rows(
        json_schema='{"$schema": 5, "type": "object"}')), 0,
         row_error="in.parquet#1: json_schema is not a valid JSON schema (AttributeError: 'int' object has no "
                   "attribute 'decode'); check its $schema (a URI string) and keywords"),
    Case("deadline before year 1", lambda e: run_args(e, e.rows(deadline="0001-01-01T00:00")), 0,
         row_error="in.parquet#1: deadline is '0001-01-01T00:00', out of the range of times this machine can hold; "
                   "use a time such as 2026-11-23T06:00"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case: Case, tmp_path, tiny_model):
    e = Env(tmp_path, tiny_model)
    args = case.setup(e)
    result = CliRunner(env=ECHO).invoke(cli, [str(a) for a in args])
    assert result.exit_code == case.code, result.output
    root = str(tmp_path)
    if case.code in (1, 2):  # the job failed, or bad usage (a config's value: exit 2)
        message = result.stderr.strip()
        if case.message is not None:
            assert message == case.message.format(root=root)
        if case.prefix is not None:
            assert message.startswith(case.prefix.format(root=root)), message
        if case.suffix is not None:
            assert message.endswith(case.suffix.format(root=root)), message
        assert not (tmp_path / "out" / "parts").exists() or case.name == "out of another job"
        return
    if case.row_error is not None:
        rows = {r["id"]: r for r in pq.read_table(f"{e.out}/parts").to_pylist()}
        bad = rows[None] if case.extra.get("null_id") else rows["bad"]
        assert bad["status"] == "error" and bad["error"] == case.row_error
        assert rows["good"]["status"] == "ok"
    if case.message is not None:
        line = result.stdout.strip().splitlines()[-1]
        expected = case.message.format(root=root)
        assert expected in line if case.extra.get("contains") else line == expected


def test_there_are_at_least_25_cases():
    assert len(CASES) >= 25


def test_rows_with_ids_that_are_not_utf8_are_answered_once(tmp_path, tiny_model):
    """Their error rows have no id and are matched by their origin on a resume, as a null id's: a rerun over a
    changed input does not answer them again."""
    e = Env(tmp_path, tiny_model)
    inp = tmp_path / "in"
    e.parquet({"id": not_utf8(b"good", b"caf\xe9-1", b"caf\xe9-2"), "prompt": ["a", "b", "c"]}, "in/a.parquet")
    r = CliRunner(env=ECHO).invoke(cli, run_args(e, str(inp)))
    assert r.exit_code == 0, r.output
    e.parquet({"id": ["new"], "prompt": ["d"]}, "in/b.parquet")   # the input changed: the rerun scans OUT
    r = CliRunner(env=ECHO).invoke(cli, run_args(e, str(inp)))
    assert r.exit_code == 0, r.output
    rows = pq.read_table(f"{e.out}/parts").to_pylist()
    assert sorted((str(x["id"]), x["status"], (x["error"] or "").split(":")[0]) for x in rows) == [
        ("None", "error", "a.parquet#1"), ("None", "error", "a.parquet#2"), ("good", "ok", ""), ("new", "ok", "")]
