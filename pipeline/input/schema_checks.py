"""The input's files as one dataset, checked before the engine starts: their schemas unified (a column of two
types refused, naming both files), the columns a job needs present and of the right type in every file, and a uint64
id column's values within int64 (from the row groups' statistics)."""

from __future__ import annotations

import logging

import pyarrow as pa

from overnight.pipeline.config import ConfigError, InputConfig
from overnight.pipeline.input.arrow_types import compatible, is_id_type, is_text, merged, nested, plain
from overnight.pipeline.output.storage import unstrip

INT64_MAX = 2 ** 63 - 1
# Column names a user of vLLM, Ray Data LLM or OpenAI's API may give a row's request setting by, which overnight
# does not read per row (its own columns: source.OVERRIDE_COLUMNS): said once, as such a column is only passed through.
NOT_PER_ROW = frozenset({"sampling_params", "max_completion_tokens", "top_logprobs", "logit_bias", "best_of",
                         "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                         "bad_words", "allowed_token_ids", "ignore_eos", "include_stop_str_in_output",
                         "skip_special_tokens", "prompt_logprobs", "truncate_prompt_tokens", "length_penalty",
                         "logits_processors", "min_p_keep", "lora_request", "lora_name", "adapter"})


class InputError(Exception):
    "The input cannot be read as a job; the message names the file or column and the fix."


class InputUsageError(InputError, ConfigError):
    """An input that does not fit the options (a column they name, or the prompt column, it lacks): bad usage,
    exit 2, as a rerun meets the same; an input that cannot be read stays an InputError, exit 1."""


def first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def check_id_range(fs, id_column: str, meta, schema: pa.Schema, shown: str, path: str) -> None:
    """A uint64 id column must hold no value above int64's maximum, which the results' id column cannot
    hold: known from the row groups' statistics, without reading a row."""
    name = id_column
    if name not in schema.names or schema.field(name).type != pa.uint64():
        return
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        col = next((group.column(j) for j in range(group.num_columns)
                    if group.column(j).path_in_schema == name), None)
        stats = col.statistics if col is not None else None
        if stats is not None and stats.has_min_max:
            fits = stats.max <= INT64_MAX
        else:  # no statistics: the row group's ids are read once
            import pyarrow.compute as pc
            import pyarrow.parquet as pq

            with fs.open(path, "rb") as f:
                top = pc.max(pq.ParquetFile(f).read_row_group(g, columns=[name]).column(0)).as_py()
            fits = top is None or top <= INT64_MAX
        if not fits:
            raise InputError(f"Id column {name!r} in {shown} is uint64 and holds values above "
                             f"{INT64_MAX}; the results keep "
                             f"integer ids as int64. Cast the column to int64 or string, or name another column "
                             f"with --id-column.")


def unify(fs, url: str, files: list, reads=lambda name: "needed") -> pa.Schema:
    """The files' schemas as one dataset's: a column of two types that cannot be read as one is refused, naming
    both files; one the job does not read (``reads(name)`` None: not a request column, not passed through) is
    left out of the dataset instead. ``reads`` says why a column is read: "text" (the prompt or chat column, whose
    bytes are read as text), "passthrough", or "needed"."""
    seen: dict = {}
    unread: set = set()
    for f in files:
        names = f.schema.names
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice is not None:  # (pyarrow's "Can't unify schema with duplicate field names" names neither)
            raise InputUsageError(f"{unstrip(fs, f.path)} has two columns named {twice!r}. Rename one of them "
                                  f"and write the file again.")
        for fld in f.schema:
            if fld.name not in seen:
                seen[fld.name] = (fld.type, f)
                continue
            t0, f0 = seen[fld.name]
            why = reads(fld.name)
            ok = compatible(t0, fld.type, bytes_are_text=why == "text")
            if ok and nested(t0) and nested(fld.type):
                seen[fld.name] = (merged(t0, fld.type), f0)   # the next file's checked against every one's fields
            elif not ok:
                if why is None:
                    unread.add(fld.name)
                    continue
                other = (", or leave it out of --passthrough (a list of the columns to keep, or none)"
                         if why == "passthrough" else "")
                if pa.types.is_struct(t0) or pa.types.is_struct(fld.type):
                    other += (", or write it as JSON text (a string column) in every file" if
                              fld.name in ("json_schema", "response_format") else "")
                raise InputError(
                    f"Column {fld.name!r} has type {t0} in {unstrip(fs, f0.path)} but {fld.type} in "
                    f"{unstrip(fs, f.path)}. Mixed schemas cannot be read as one dataset: cast the "
                    f"column to one type in every file{other}.")
    schemas = [plain(f.schema) for f in files]
    if unread:
        schemas = [pa.schema([x for x in sc if x.name not in unread]) for sc in schemas]
    try:
        return pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise InputError(f"The files of {url} have schemas that cannot be read as one dataset "
                         f"({first_line(e)}). Cast the columns to one type in every file.") from None


def check_columns(cfg: InputConfig, fs, url: str, files: list, schema: pa.Schema, notes: bool = True) -> None:
    """The columns a job needs: the prompt (or chat) column in every file, the id column's type and presence, the
    passthrough columns; with notes, a warning for columns a user may mean as a row's setting that are not read."""
    names = set(schema.names)
    prompt, messages = cfg.prompt_column, cfg.messages_column
    if prompt not in names and messages not in names:
        raise InputUsageError(
            f"{url} has no column {prompt!r} (columns: {', '.join(schema.names)}). "
            f"Name the prompt column with --prompt-column, or add a {messages!r} column of chats.")
    for f in files:
        fnames = set(f.schema.names)
        if prompt not in fnames and messages not in fnames and f.num_rows:  # (an empty file has no rows to ask)
            raise InputUsageError(f"{unstrip(fs, f.path)} has no column {prompt!r} or {messages!r} "
                             f"(columns: {', '.join(f.schema.names)}). Every input file needs the prompt column.")
    if prompt in names and not is_text(schema.field(prompt).type):
        raise InputUsageError(
            f"Column {prompt!r} in {url} has type {schema.field(prompt).type}; prompts must be strings. "
            f"Pick the text column with --prompt-column.")
    if cfg.id_column not in names and cfg.id_column != InputConfig.id_column:
        raise InputUsageError(f"Id column {cfg.id_column!r} is not in {url} (columns: {', '.join(schema.names)}). "
                         f"Fix --id-column, or leave it out to derive each row's id from its file and row.")
    if cfg.id_column in names:
        having = next(f for f in files if cfg.id_column in f.schema.names)
        for f in files:
            if cfg.id_column not in f.schema.names and f.num_rows:  # its rows would all be null-id errors
                raise InputUsageError(
                    f"{unstrip(fs, f.path)} has no id column {cfg.id_column!r}, which other input files "
                    f"have ({unstrip(fs, having.path)}). Add the column to it, or run it as a job of its "
                    f"own (without one, each row's id comes from its file and row).")
        from overnight.pipeline.records import RESULT_FIELDS, SAMPLE_FIELDS

        clash = next((c for c in RESULT_FIELDS + SAMPLE_FIELDS if c.lower() == cfg.id_column.lower()), None)
        if clash:  # the output's own column of that name would take its place (DuckDB reads names without case)
            raise InputUsageError(
                f"Id column {cfg.id_column!r} in {url} has the name of a column the output writes itself ({clash!r}). "
                f"Rename the column in the input, or name another with --id-column.")
        t = schema.field(cfg.id_column).type
        if not is_id_type(t):
            raise InputUsageError(f"Id column {cfg.id_column!r} in {url} has type {t}; ids must be integers "
                             f"or strings. Cast it, or name another column with --id-column.")
    if notes:
        say_unread_columns(cfg, url, names)
    if isinstance(cfg.passthrough, list):
        missing = [c for c in cfg.passthrough if c not in names]
        if missing:
            raise InputUsageError(f"Passthrough column {missing[0]!r} is not in {url} "
                             f"(columns: {', '.join(schema.names)}). Fix --passthrough.")


def say_unread_columns(cfg: InputConfig, url: str, names: set) -> None:
    """Warn, once, of columns named as a row's setting that overnight does not read: another tool's (NOT_PER_ROW),
    or a setting's name in another case (Top_K)."""
    from overnight.pipeline.input.source import REQUEST_COLUMNS

    log = logging.getLogger("overnight")
    unread = sorted(n for n in names if n.lower() in NOT_PER_ROW)
    if unread:
        log.warning(
            f"{url}: column{'s' if len(unread) > 1 else ''} {', '.join(repr(n) for n in unread)} "
            f"{'are' if len(unread) > 1 else 'is'} not read as a row's request setting (an ordinary column, passed "
            f"through as --passthrough says). The per-row columns are max_tokens, temperature, top_p, top_k, "
            f"min_p, repetition_penalty, seed, stop, stop_token_ids, presence_penalty, frequency_penalty, "
            f"min_tokens, json_schema, response_format, regex, choice, n, logprobs and lora (README: Per-row "
            f"columns).")
    # Names that are settings only: a data column called N, Value, Priority or Stop is left unsaid, as are the
    # columns the options name and those --passthrough lists.
    named = {cfg.id_column, cfg.prompt_column, cfg.messages_column}
    named |= set(cfg.passthrough) if isinstance(cfg.passthrough, list) else set()
    settings = REQUEST_COLUMNS - {"n", "value", "priority", "deadline", "choice", "stop"}
    cased = sorted(n for n in names - named if n not in settings and n.lower() in settings and n.lower() not in names)
    if cased:  # (Parquet's names, and overnight's, are case-sensitive)
        many, targets = len(cased) > 1, " and ".join(sorted({n.lower() for n in cased}))
        them = "them" if many else "it"
        log.warning(
            f"{url}: column{'s' if many else ''} {', '.join(repr(n) for n in cased)} {'are' if many else 'is'} not "
            f"read as a row's {targets} (column names are case-sensitive): rename {them} to {targets} to have "
            f"{them} read per row. As {'they are' if many else 'it is'}, "
            f"{'they are ordinary columns' if many else 'it is an ordinary column'}, passed through as --passthrough "
            f"says.")
