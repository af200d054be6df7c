"""OpenAI Batch input: `overnight run requests.jsonl` reads the Batch API's request lines directly.

Each line is one request::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64}}

A line becomes one row with the columns a Parquet input would have: the id column (``custom_id``), ``messages``
(``/v1/chat/completions``; text content parts are joined) or ``prompt`` (``/v1/completions``, marked in
RAW_PROMPT_COLUMN: the prompt goes to the model as given, without the chat template, as OpenAI and vLLM's run_batch
send it), ``lora`` (filled by ModelRoute: the adapter a line's ``body.model`` names), and the per-row
columns ``max_tokens`` (or ``max_completion_tokens``), ``temperature``, ``top_p``, ``seed``, ``stop``,
``presence_penalty``, ``frequency_penalty``, ``min_tokens``, ``stop_token_ids``, ``response_format`` (as JSON
text), ``n`` and ``logprobs`` (the number of top alternatives: chat's ``logprobs: true`` with ``top_logprobs: K``
is K, without it 0; a completions request's integer ``logprobs`` is K itself), and vLLM's own ``top_k``,
``min_p``, ``repetition_penalty`` and structured outputs (``guided_json``, ``guided_regex``, ``guided_choice``,
``structured_outputs``: the ``json_schema``, ``regex`` and ``choice`` columns), read from the body by
``openai_body``. ``validate`` checks their values as for any input. A key that would change the answer and is not
run here (``logit_bias``, ``tools``, ``echo``, ``suffix``, ``best_of`` above 1, ...: ``openai_body.REFUSED``)
makes the line an error, not an answer without it.

A line that cannot be a request (not JSON, no ``custom_id``, a ``method`` other than POST, an unsupported
``url``, a body without ``messages`` / ``prompt``, a value of the wrong type) becomes a row whose
INPUT_ERROR_COLUMN holds the problem and the fix; ``validate`` turns it into an error row, and the job goes on.
Body keys overnight does not honour are ignored, with one warning per key (``user``, ``metadata``, ``store``,
``stream``, ``service_tier`` silently). ``model`` goes to MODEL_COLUMN: a line whose model is an adapter registered
with --lora runs through it; any other name is answered by the job's model (one warning names the first line whose
model is neither). The internal columns (INPUT_ERROR_COLUMN, RAW_PROMPT_COLUMN, MODEL_COLUMN) steer only rows read
from a JSONL file (``JsonlFile.internal_columns``) and are never passed through.

Rows are numbered by their 1-based line number, so an error's origin ``requests.jsonl#7`` is line 7; blank
lines are skipped. Opening the source counts each file's lines once, in one streaming pass (~1 GB/s locally,
the store's read speed remotely), and notes the byte offset of every CHUNK_LINES-th line: the chunks are the
file's "row groups", which ``--shard`` and Ray work units split as they split a Parquet file's (a ``.gz`` file
is one chunk, read from its start). Reading streams lines, never loading a file whole, local or through fsspec.
"""

from __future__ import annotations

import json
import logging
import posixpath
import sys
from dataclasses import dataclass
from typing import ClassVar, Collection, Iterator, Optional

import pyarrow as pa

from overnight.pipeline.input.openai_body import (_COLUMNS, GUIDED, REFUSED, LineError, _is_text, _messages,
                                                  _parameters, _prompt, _short, readable_id, refused)
from overnight.pipeline.input.source import (INPUT_ERROR_COLUMN, MODEL_COLUMN, RAW_PROMPT_COLUMN, InputError,
                                             InputFile, ParquetSource, SourceBatch, _first_line)
from overnight.pipeline.input.listing import GLOB_CHARS, file_version, glob_base, is_data_file, is_hidden
from overnight.pipeline.input.shards import ROWS
from overnight.pipeline.output.faults import failpoint
from overnight.pipeline.output.storage import unstrip, url_to_fs

log = logging.getLogger("overnight")

SUFFIXES = (".jsonl", ".jsonl.gz")
# Lines per chunk: a file's chunks are what --shard and Ray units split, like a Parquet file's row groups.
CHUNK_LINES = 8192
ENDPOINTS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}
# Body keys read into columns, besides messages / prompt.
HONOURED = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "presence_penalty",
            "frequency_penalty", "min_tokens", "stop_token_ids", "response_format", "n", "logprobs",
            "top_logprobs", "top_k", "min_p", "repetition_penalty", "structured_outputs", *GUIDED, *REFUSED)
# Body keys that change nothing here (results are written, not streamed); model is ModelRoute's.
SILENT = ("model", "user", "metadata", "store", "stream", "stream_options", "service_tier")
# The columns only this source writes: honoured from its batches alone, never passed through.
INTERNAL_COLUMNS = frozenset({INPUT_ERROR_COLUMN, RAW_PROMPT_COLUMN, MODEL_COLUMN})

MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


UTF16_32_BOMS = (b"\xff\xfe", b"\xfe\xff", b"\x00\x00\xfe\xff")


def is_jsonl_input(path: Optional[str]) -> bool:
    """INPUT names JSONL: a file or glob ending in .jsonl / .jsonl.gz, or a folder or glob whose data files are
    such files and no Parquet files (``dir/*.jsonl*``, ``dir/*``)."""
    if not path:
        return False
    if path.rstrip("/").endswith(SUFFIXES):
        return True
    try:
        fs, root = url_to_fs(path)
        if any(c in root for c in GLOB_CHARS) and not fs.exists(root):  # ("run [v2]/" is a path, if there is one)
            base = glob_base(root)
            paths = [p for p in fs.glob(root) if not is_hidden(p, base) and fs.isfile(p)]
            what = f"The glob {path} matches"
        elif fs.isdir(root):
            base, paths, what = root, fs.find(root), f"Folder {path} holds"
        else:
            return False
    except (OSError, ValueError):
        return False  # the Parquet source says what is wrong with the path
    # the files a folder input reads: none inside a "." or "_" folder (_temporary/, .snapshot/ ...)
    jsonl = any(is_data_file(p, SUFFIXES, base) for p in paths)
    parquet = any(is_data_file(p, ParquetSource.SUFFIXES, base) for p in paths)
    glob = what.startswith("The glob")
    where = glob_base(path) if glob else path.rstrip("/")
    if jsonl and parquet:
        raise InputError(f"{what} both Parquet and JSONL files. Point INPUT at one kind, with a glob "
                         f"such as {where}/*.jsonl or {where}/*.parquet.")
    other = next((p for p in paths if not p.endswith(SUFFIXES)), None) if glob and jsonl else None
    if other is not None:  # a glob reads every file it matches, as the job's input
        raise InputError(f"{what} JSONL files and {unstrip(fs, other)}, which is not one (*.jsonl, *.jsonl.gz). "
                         f"Narrow the glob, e.g. {where}/*.jsonl*.")
    return jsonl


def request_schema(cfg) -> pa.Schema:
    """The columns a request line becomes, named as the job's config names them."""
    return pa.schema([(cfg.id_column, pa.string()), (cfg.messages_column, MESSAGES_TYPE),
                      (cfg.prompt_column, pa.string()), *_COLUMNS, ("lora", pa.string()),
                      (RAW_PROMPT_COLUMN, pa.bool_()), (MODEL_COLUMN, pa.string()), (INPUT_ERROR_COLUMN, pa.string())])


@dataclass(frozen=True)
class JsonlFile(InputFile):
    # Byte offset of each chunk's first line; () for a compressed file (one chunk, read from its start).
    offsets: tuple[int, ...] = ()
    # Lines per chunk when the file was counted (chunk g starts at line g * chunk_lines + 1).
    chunk_lines: int = CHUNK_LINES
    internal_columns: ClassVar[frozenset] = INTERNAL_COLUMNS


class OpenAIBatchSource(ParquetSource):
    """OpenAI Batch request lines (a .jsonl or .jsonl.gz file, a folder or a glob of them) as a source."""

    SUFFIXES = SUFFIXES
    FILES = "JSONL files (*.jsonl, *.jsonl.gz)"

    def __init__(self, cfg, shard=None, split_rule=ROWS):
        self._warned: set[str] = set()
        super().__init__(cfg, shard, split_rule)

    # -- discovery ---------------------------------------------------------------------------
    def _inspect(self, path: str, base: str) -> JsonlFile:
        """Count the file's rows (non-blank lines) per chunk, in one streaming pass."""
        shown = unstrip(self.fs, path)
        compressed = path.endswith(".gz")
        rows, offsets, chunk_lines = [], [], CHUNK_LINES
        try:
            with self._open(path) as f:
                pos, line_no = 0, 0
                for line in f:
                    if line_no == 0 and line.startswith(UTF16_32_BOMS):  # (before every line split on its \n)
                        raise InputError(f"{shown} is UTF-16 or UTF-32 text (it starts with a byte order mark); "
                                         f"JSONL is UTF-8. Re-encode the file as UTF-8 (PowerShell: Out-File "
                                         f"-Encoding utf8), or remove it from the input.")
                    if line_no % chunk_lines == 0:
                        rows.append(0)
                        offsets.append(pos)
                    line_no += 1
                    pos += len(line)
                    if not line.isspace():
                        rows[-1] += 1
        except (OSError, EOFError, ValueError) as e:
            raise InputError(f"{shown} cannot be read as JSONL ({_first_line(e)}). Check the file (a .gz file must "
                             f"be gzip), or remove it from the input.") from None
        if compressed and rows:
            rows, offsets = [sum(rows)], []
        name = posixpath.relpath(path, base) if base else path
        return JsonlFile(path=path, name=name, num_rows=sum(rows), schema=request_schema(self.cfg),
                         row_groups=tuple(rows), version=file_version(self.fs, path), offsets=tuple(offsets),
                         chunk_lines=chunk_lines)

    def _open(self, path: str):
        return self.fs.open(path, "rb", compression="gzip" if path.endswith(".gz") else None)

    # -- columns -----------------------------------------------------------------------------
    def read_columns(self) -> list[str]:
        return [*super().read_columns(), *(n for n in self.schema.names if n in INTERNAL_COLUMNS)]

    def passthrough_columns(self) -> list[str]:
        return [c for c in super().passthrough_columns() if c not in INTERNAL_COLUMNS]

    # -- reading -----------------------------------------------------------------------------
    def _read(self, fragments, columns: list[str]) -> Iterator[SourceBatch]:
        """Batches of the given fragments (a file, one chunk, or rows [a, b) of a chunk), line by line."""
        hashed = self.selection.hash_of if self.selection is not None else None
        schema = pa.schema([self.schema.field(n) for n in columns])
        for frag in fragments:
            file = self.files[frag.file_index]
            for lines in self._chunks(file, frag):
                failpoint("source.batch")
                sb = self._batch(file, lines, schema)
                if hashed is not None:
                    sb = self._hash_filter(sb, hashed)
                    if sb is None:
                        continue
                yield sb

    def _chunks(self, file: JsonlFile, frag) -> Iterator[list[tuple[int, bytes]]]:
        """(line number, line) of the fragment's rows, batch_rows at a time."""
        if frag.row_group is None:
            first, offset, num_rows = 0, 0, file.num_rows
        else:
            first = frag.row_group * file.chunk_lines
            offset = file.offsets[frag.row_group] if file.offsets else 0
            num_rows = file.row_groups[frag.row_group]
        lo, hi = frag.rows if frag.rows else (0, num_rows)
        buf: list[tuple[int, bytes]] = []
        with self._open(file.path) as f:
            if offset:
                f.seek(offset)
            line_no, row = first, 0
            for line in f:
                line_no += 1
                if line.isspace():
                    continue
                if row >= hi:  # the rows counted when the source opened; lines added since wait for a new job
                    break
                if row >= lo:
                    buf.append((line_no, line))
                    if len(buf) == self.cfg.batch_rows:
                        yield buf
                        buf = []
                row += 1
        if buf:
            yield buf

    def _batch(self, file: JsonlFile, lines: list[tuple[int, bytes]], schema: pa.Schema) -> SourceBatch:
        rows = [self._row(raw, file, line_no) for line_no, raw in lines]
        try:
            batch = _to_batch(rows, schema)
        except (pa.ArrowException, OverflowError, UnicodeError, TypeError, ValueError):
            # One row's value has no Arrow form (text with a lone surrogate, say): find it, make it an error row.
            for r, (line_no, _) in zip(rows, lines):
                try:
                    _to_batch([r], schema)
                except (pa.ArrowException, OverflowError, UnicodeError, TypeError, ValueError) as e:
                    custom_id = r.get(self.cfg.id_column)
                    r.clear()
                    if _is_text(custom_id):
                        r[self.cfg.id_column] = custom_id
                    r[INPUT_ERROR_COLUMN] = (f"line {line_no} holds a value that cannot be stored "
                                             f"({_first_line(e)}); fix the line's text (e.g. a lone \\ud800 escape)")
            batch = _to_batch(rows, schema)
        numbers = [n for n, _ in lines]
        consecutive = numbers[-1] - numbers[0] == len(numbers) - 1
        return SourceBatch(file, numbers[0], batch, None if consecutive else numbers)

    def _row(self, raw: bytes, file: JsonlFile, line_no: int) -> dict:
        """A line as column values; a bad line as its id (when it has one) and INPUT_ERROR_COLUMN."""
        cfg = self.cfg
        custom_id = None
        try:
            try:
                req = json.loads(raw.decode("utf-8-sig"))  # strict UTF-8 (json.loads of bytes would take UTF-16)
            except UnicodeDecodeError as e:
                custom_id = readable_id(raw)  # its error row answers its custom_id, where that reads whole
                raise LineError(f"line {line_no} is not valid UTF-8 (at byte {e.start + 1}); re-encode the file as "
                                f"UTF-8") from None
            except json.JSONDecodeError as e:
                why = e.msg.removesuffix(" at")  # ("Invalid control character at": an "at at column")
                raise LineError(f"line {line_no} is not valid JSON ({why} at column {e.colno}); write each "
                                f"request as one JSON object on one line") from None
            except RecursionError:  # json's decoder recurses once per level of nesting
                raise LineError(f"line {line_no} is nested too deeply to read (over about "
                                f"{sys.getrecursionlimit()} levels of arrays and objects); flatten its values")\
                    from None
            if not isinstance(req, dict):
                raise LineError(f"line {line_no} is a JSON {type(req).__name__}, not an object; write each "
                                f"request as {{\"custom_id\", \"method\", \"url\", \"body\"}}")
            custom_id = req.get("custom_id")
            if not isinstance(custom_id, str) or not custom_id:
                custom_id = None
                raise LineError(f"line {line_no} has no custom_id string; give every request a unique custom_id")
            if req.get("method") != "POST":
                raise LineError(f"line {line_no}: method is {_short(req.get('method'))}; OpenAI Batch requests "
                                f"are \"method\": \"POST\"")
            url = req.get("url")
            if url not in ENDPOINTS:
                raise LineError(f"line {line_no}: url {_short(url)} is not supported; use /v1/chat/completions "
                                f"(body.messages) or /v1/completions (body.prompt)")
            body = req.get("body")
            if not isinstance(body, dict):
                raise LineError(f"line {line_no}: body is {_short(body)}; give the request's parameters as a "
                                f"JSON object")
            row = {cfg.id_column: custom_id}
            if ENDPOINTS[url] == "messages":
                if body.get("messages") is None:
                    raise LineError(f"line {line_no}: body has no messages; {url} needs body.messages, a list "
                                    f"of {{role, content}}")
                row[cfg.messages_column] = _messages(body["messages"], line_no)
            else:
                if body.get("prompt") is None:
                    raise LineError(f"line {line_no}: body has no prompt; {url} needs body.prompt, a string")
                row[cfg.prompt_column] = _prompt(body["prompt"], line_no)
                row[RAW_PROMPT_COLUMN] = True
            if isinstance(body.get("model"), str) and body["model"]:
                row[MODEL_COLUMN] = body["model"]
            refused(body, line_no)
            row.update(_parameters(body, line_no, ENDPOINTS[url]))
            self._warn_unknown(body, url, file, line_no)
            return row
        except LineError as e:
            return {cfg.id_column: custom_id, INPUT_ERROR_COLUMN: str(e)}
        except (MemoryError, KeyboardInterrupt):
            raise
        except Exception as e:  # a value no check foresaw: this line is an error row, and the job goes on
            return {cfg.id_column: custom_id, INPUT_ERROR_COLUMN: f"line {line_no} could not be read "
                                                                  f"({type(e).__name__}: {_first_line(e)}); fix it"}

    def _warn_unknown(self, body: dict, url: str, file: JsonlFile, line_no: int) -> None:
        own = ENDPOINTS[url]
        for key in body:
            if key == own or key in HONOURED or key in SILENT or key in self._warned:
                continue
            self._warned.add(key)
            log.warning(f"{file.name} line {line_no}: body.{key} is not supported and is ignored (in every line; "
                        f"said once per key)")


class ModelRoute:
    """body.model as vLLM's run_batch reads it: a line whose model is the name of an adapter registered with
    ``--lora NAME=PATH`` gets that name in its ``lora`` column, so it runs through the adapter; any other name is
    answered by the job's model, and one warning names the first line whose model is neither the job's model
    (``job_names``) nor an adapter. Batches that do not come from a JSONL file pass unchanged."""

    def __init__(self, adapters: Collection[str], job_names: Collection[str], shown: str):
        self.adapters = frozenset(adapters)
        self.known = self.adapters | frozenset(job_names)
        self.shown = shown  # the job's model, as the warning names it
        self.warned = False

    def __call__(self, sb: SourceBatch) -> SourceBatch:
        names = sb.batch.schema.names
        if MODEL_COLUMN not in sb.file.internal_columns or MODEL_COLUMN not in names:
            return sb
        models = sb.batch.column(MODEL_COLUMN).to_pylist()
        if not self.warned:
            for i, m in enumerate(models):
                if m is not None and m not in self.known:
                    self.warned = True
                    log.warning(f"{sb.file.name} line {sb.row_number(i)}: body.model {_short(m)} is neither the "
                                f"job's model ({self.shown}) nor an adapter registered with --lora; the job's model "
                                f"answers it (and every such line; said once)")
                    break
        if not self.adapters or "lora" not in names or not any(m in self.adapters for m in models):
            return sb
        picked = pa.array([m if m in self.adapters else None for m in models], pa.string())
        j = names.index("lora")
        batch = sb.batch.set_column(j, sb.batch.schema.field(j), picked)
        return SourceBatch(sb.file, sb.start, batch, sb.row_numbers)


def model_route(cfg, model) -> ModelRoute:
    """The job's ModelRoute: cfg a JobConfig, model its ``stage.OpenModel``. The job's model goes by the name it
    was given (alias, folder or hub id), the folder or hub id vLLM loads, and that folder's name."""
    resolved = model.resolved
    names = {resolved.requested, resolved.path, posixpath.basename(resolved.path.rstrip("/"))}
    return ModelRoute(cfg.engine.lora, {n for n in names if n}, resolved.requested)


class _Lines(OpenAIBatchSource):
    """Only the listing of an input's JSONL files (no line counts, no schema): what export orders rows by."""

    def __init__(self, url: str):
        self.url = url
        self.fs, root = url_to_fs(url)
        self.paths, self.base = self._listing(root)


def request_lines(url: str) -> Iterator[tuple[Optional[str], bool, Optional[str]]]:
    """Each request line's custom_id in input order (None for a line without one; blank lines skipped), whether it
    asks /v1/completions, and for a line without a custom_id its origin ("<file>#<line>", which its error row's
    message starts with), as the source reads them: the files in the source's order, each streamed line by line."""
    lines = _Lines(url)
    for path in lines.paths:
        name = posixpath.relpath(path, lines.base) if lines.base else path
        with lines._open(path) as f:
            for line_no, line in enumerate(f, 1):
                if line.isspace():
                    continue
                try:
                    req = json.loads(line.decode("utf-8-sig"))  # as the source reads it
                except UnicodeDecodeError:  # an error row, of its custom_id where that reads whole
                    cid = readable_id(line)
                    req = {"custom_id": cid} if cid else None
                except (ValueError, RecursionError):  # not JSON, nested too deeply (an error row)
                    req = None
                cid = req.get("custom_id") if isinstance(req, dict) else None
                if isinstance(cid, str) and cid and _is_text(cid):
                    yield cid, req.get("url") == "/v1/completions", None
                else:
                    yield None, isinstance(req, dict) and req.get("url") == "/v1/completions", f"{name}#{line_no}"



def _to_batch(rows: list[dict], schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array([r.get(f.name) for r in rows], f.type) for f in schema],
                                      schema=schema)
