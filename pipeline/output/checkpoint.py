"""The output folder: Parquet parts that count only when complete, a manifest, a status file.

    OUT/parts/part-00000.parquet ...   finished rows; a part exists whole or not at all
    OUT/manifest.json                  the run: id, resolved config, fingerprint, counts, state, attempts
    OUT/status.json                    the latest progress snapshot (rows, tokens/s, ETA, exit code)
    OUT/timeline.json                  progress over time: a sample every few seconds, for `overnight report`

The parts are the truth. A kill between writing a part and updating the
manifest leaves the manifest's counts stale; the next start recounts them
from the parts. A part's columns are ``schema.OutputSchema``'s.
"""

from __future__ import annotations

import io
import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import pyarrow as pa

from overnight.pipeline.records import Result
from overnight.pipeline.output.faults import failpoint
from overnight.pipeline.output.schema import OutputSchema
from overnight.pipeline.output.storage import (StorageError, join, read_text, redact, unstrip, url_to_fs, with_retries,
                                        write_atomic)

log = logging.getLogger("overnight")

PART_RE = re.compile(r"^part-(\d{5,})\.parquet$")
MANIFEST = "manifest.json"
STATUS = "status.json"
TIMELINE = "timeline.json"
PARTS = "parts"
# Part rows turned into keys at a time by OutputDir.scan.
SCAN_CHUNK_ROWS = 65536


class OutputError(Exception):
    "The output folder cannot be used; the message names it and the fix."


def id_kind(t: pa.DataType) -> str:
    """Ids of one kind match each other whatever their width (int32 and int64, string and large_string)."""
    return "integer" if pa.types.is_integer(t) else "string"


@dataclass
class Scan:
    """What the completed parts already hold: their counts, and their ids in compact form.

    Each id is a key (``pipeline/idkeys.py``: 12 bytes, not a Python object) in ``done``, with its prompt hash as
    the slot's value (0: none) and flags the resume filter sets; error rows with a null id, which cannot be
    matched by id, by their origin ("<file>#<row>", where their error message starts) in ``null_origins``.
    ``OutputDir.scan(id_column, into=scan)`` adds a folder's parts to the same Scan.
    """

    num_ok: int = 0
    num_error: int = 0
    num_output_tokens: int = 0
    num_parts: int = 0
    next_index: int = 0
    # (folder, id column, part paths) scanned, to read a few ids again (examples in messages)
    sources: list = field(default_factory=list)
    # ids read but not yet in the table: (keys, checks, prompt hashes) chunks; the table is built on first use
    _pending: list = field(default_factory=list, repr=False)
    _done: Any = field(default=None, repr=False)
    _null_origins: Any = field(default=None, repr=False)
    # the kinds of id the parts hold ("integer", "string"), each with the first part that holds it: 1 and "1" are
    # different keys, so the input's ids must stay of the kind the parts have (``id_kind``)
    id_kinds: dict = field(default_factory=dict)

    @property
    def num_done(self) -> int:
        return self.num_ok + self.num_error

    @property
    def done(self):
        """The ids of the rows in the parts (null ids left out): a KeyTable with prompt hashes and flags."""
        from overnight.pipeline.idkeys import KeyTable

        if self._done is None:
            self._done = KeyTable(sum(len(k) for k, _, _ in self._pending), values=True, flags=True)
        while self._pending:
            keys, checks, hashes = self._pending.pop(0)
            self._done.add(keys, checks, hashes)
        return self._done

    @property
    def null_origins(self):
        """Origins ("<file>#<row>") of the error rows whose id is null, as keys: a KeyTable."""
        from overnight.pipeline.idkeys import KeyTable

        if self._null_origins is None:
            self._null_origins = KeyTable()
        return self._null_origins

    @property
    def num_ids(self) -> int:
        """Distinct ids in the parts (null ids left out)."""
        return len(self.done)

    def contains(self, ids) -> list[bool]:
        """Whether each of these ids (a list or an Arrow array) is in the parts."""
        from overnight.pipeline.idkeys import keys_of

        keys, checks, valid = keys_of(ids if isinstance(ids, (pa.Array, pa.ChunkedArray)) else pa.array(list(ids)))
        return (self.done.contains(keys, checks) & valid).tolist()

    def add_rows(self, ids, prompt_hashes=None, errors=None) -> None:
        """Add the ids of some part rows (Arrow arrays: ids, their prompt_hash strings, their error messages)."""
        import pyarrow.compute as pc

        from overnight.pipeline.idkeys import hex16_to_u64, keys_of

        keys, checks, valid = keys_of(ids)
        hashes = hex16_to_u64(prompt_hashes) if prompt_hashes is not None else np.zeros(len(keys), np.uint64)
        if not valid.all():
            if errors is not None:
                null = pc.is_null(ids)
                messages = [e for e in pc.filter(errors, null).to_pylist() if e]
                if messages:
                    self.add_null_origins([e.split(": ", 1)[0] for e in messages])
            keys, checks, hashes = keys[valid], checks[valid], hashes[valid]
        if len(keys):
            if self._done is not None:
                self._done.add(keys, checks, hashes)
            else:
                self._pending.append((keys, checks, hashes))

    def add_null_origins(self, origins: list[str]) -> None:
        from overnight.pipeline.idkeys import keys_of

        keys, checks, _ = keys_of(pa.array(origins, pa.string()))
        self.null_origins.add(keys, checks)

    def find_ids(self, pick: Callable[[Any], Any], limit: int) -> list:
        """Up to ``limit`` ids, in part order, whose slots in ``done`` ``pick(slots)`` selects (a bool array):
        the parts' id columns are read again."""
        import pyarrow.parquet as pq

        from overnight.pipeline.idkeys import keys_of

        found: list = []
        table = self.done
        for out, id_column, paths in self.sources:
            for p in paths:
                with out.fs.open(p, "rb") as f:
                    ids = pq.ParquetFile(f, pre_buffer=False).read(columns=[id_column]).column(0)
                keys, checks, valid = keys_of(ids)
                slots = table.find(keys, checks)
                hit = valid & (slots >= 0)
                hit[hit] = pick(slots[hit])
                for i in np.flatnonzero(hit):
                    value = ids[int(i)].as_py()
                    if value not in found:
                        found.append(value)
                        if len(found) >= limit:
                            return found
        return found


def _footer_says(meta, names: list[str], id_column: str) -> tuple[bool, bool]:
    """(every row's status is "ok", no id is null), as far as a part's footer statistics tell; False where
    they do not."""
    try:
        index = _COLUMN_INDEX.get(tuple(names))
        if index is None:
            index = _COLUMN_INDEX[tuple(names)] = {meta.schema.column(i).path: i for i in range(meta.num_columns)}
        all_ok = no_nulls = True
        for g in range(meta.num_row_groups):
            rg = meta.row_group(g)
            st = rg.column(index["status"]).statistics if "status" in index else None
            all_ok = all_ok and st is not None and st.has_min_max and st.null_count == 0 and st.min == st.max == "ok"
            ids = rg.column(index[id_column]).statistics if id_column in index else None
            no_nulls = no_nulls and ids is not None and ids.has_null_count and ids.null_count == 0
        return all_ok, no_nulls
    except Exception:  # statistics are an optimisation: without them both columns are read
        return False, False


_COLUMN_INDEX: dict = {}


class OutputDir:
    def __init__(self, url: str):
        self.url = url.rstrip("/") or url
        self.fs, self.root = url_to_fs(url)
        self.root = self.root.rstrip("/") or self.root
        if self.fs.exists(self.root) and not self.fs.isdir(self.root):
            raise OutputError(f"Output {url} is a file. --out needs a folder (it is created when missing).")

    def path(self, *parts: str) -> str:
        return join(self.root, *parts)

    def shown(self, *parts: str) -> str:
        return unstrip(self.fs, self.path(*parts))

    # -- parts ---------------------------------------------------------------------------------
    def part_paths(self) -> list[str]:
        folder = self.path(PARTS)
        if not self.fs.exists(folder):
            return []
        names = [p.rsplit("/", 1)[-1] for p in self.fs.ls(folder, detail=False)]
        return sorted(self.path(PARTS, n) for n in names if PART_RE.match(n))

    def scan(self, id_column: str, into: Optional[Scan] = None) -> Scan:
        """Read the id, status, token and prompt_hash columns of every completed part, adding them to ``into``
        when given (a job can scan several folders into one Scan), else to a new Scan.

        Parts are read one at a time and their ids turned into keys some 64k rows at a time (10M rows in 10k
        parts: 7 s on 2 cores, and 21 bytes a table slot, 28 to 56 bytes an id; see ``pipeline/idkeys.py``). A part whose footer says every
        row is "ok" and no id is null is read without its status and error columns."""
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        scan = into if into is not None else Scan()
        paths = self.part_paths()
        ids: list = []
        hashes: list = []
        tokens: list = []
        statuses: list = []
        rows = 0

        def flush() -> None:
            nonlocal ids, hashes, tokens, statuses, rows
            if not ids:
                return
            cat = (lambda xs: xs[0] if len(xs) == 1 else pa.concat_arrays(xs))
            for st in statuses:
                ok = pc.sum(pc.equal(st, "ok")).as_py() or 0
                scan.num_ok += ok
                scan.num_error += len(st) - ok
            scan.num_output_tokens += int(pc.sum(cat(tokens)).as_py() or 0)
            scan.add_rows(cat(ids), cat(hashes))
            ids, hashes, tokens, statuses, rows = [], [], [], [], 0

        for p in paths:
            try:
                with self.fs.open(p, "rb") as f:
                    pf = pq.ParquetFile(f, pre_buffer=False)
                    names = pf.schema_arrow.names
                    if id_column not in names or "output_tokens" not in names or "status" not in names:
                        missing = next(c for c in (id_column, "output_tokens", "status") if c not in names)
                        raise KeyError(f"no column {missing!r}")
                    all_ok, no_null_ids = _footer_says(pf.metadata, names, id_column)
                    cols = [id_column, "output_tokens"] + (["prompt_hash"] if "prompt_hash" in names else []) + (
                        [] if all_ok else ["status"]) + ([] if no_null_ids or "error" not in names else ["error"]) + (
                        ["sample_index"] if "sample_index" in names else [])
                    t = pf.read(columns=cols, use_threads=False)
            except (pa.ArrowInvalid, OSError, KeyError) as e:
                raise OutputError(f"Part {unstrip(self.fs, p)} cannot be read ({e}). Delete it and rerun: "
                                  f"its rows will be processed again.") from None
            tokens.append(t.column("output_tokens").combine_chunks())  # every sample's tokens
            if "sample_index" in t.column_names:  # n > 1: a row is counted, and its id kept, once
                t = t.filter(pc.fill_null(pc.equal(t.column("sample_index"), 0), True))
            id_col = t.column(id_column).combine_chunks()
            if not pa.types.is_null(id_col.type):
                scan.id_kinds.setdefault(id_kind(id_col.type), unstrip(self.fs, p))
            if ids and id_col.type != ids[0].type:
                flush()
            if not no_null_ids and id_col.null_count:
                null = pc.is_null(id_col)
                errors = t.column("error").filter(null).to_pylist() if "error" in t.column_names else []
                origins = [e.split(": ", 1)[0] for e in errors if e]
                if origins:
                    scan.add_null_origins(origins)
            ids.append(id_col)
            hashes.append(t.column("prompt_hash").combine_chunks() if "prompt_hash" in t.column_names
                          else pa.nulls(t.num_rows, pa.string()))
            if "status" in t.column_names:
                statuses.append(t.column("status").combine_chunks())
            else:
                scan.num_ok += t.num_rows
            rows += t.num_rows
            if rows >= SCAN_CHUNK_ROWS:
                flush()
            scan.num_parts += 1
            index = int(PART_RE.match(p.rsplit("/", 1)[-1]).group(1))
            scan.next_index = max(scan.next_index, index + 1)
        flush()
        if paths:
            scan.sources.append((self, id_column, paths))
        return scan

    def write_part(self, index: int, table: pa.Table) -> str:
        import pyarrow.parquet as pq

        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        path = self.path(PARTS, f"part-{index:05d}.parquet")
        failpoint("part.before_write")
        self._write(path, buf.getvalue())
        failpoint("part.after_write")  # the part counts; the manifest does not know it yet
        return path

    # -- manifest and status -----------------------------------------------------------------
    def read_manifest(self) -> Optional[dict]:
        text = read_text(self.fs, self.path(MANIFEST))
        if text is None:
            return None
        try:
            return json.loads(text)
        except ValueError:
            raise OutputError(f"{self.shown(MANIFEST)} is not valid JSON. Rerun with --fresh to start over, "
                              f"or restore the file.") from None

    def write_manifest(self, manifest: dict) -> None:
        failpoint("manifest.before_write")
        self._write(self.path(MANIFEST), json.dumps(manifest, indent=2, default=str).encode())
        failpoint("manifest.after_write")

    def read_status(self) -> Optional[dict]:
        status = self._snapshot(STATUS)
        return status if isinstance(status, dict) else None

    def _snapshot(self, name: str):
        """status.json or timeline.json, or None where it is absent or damaged (each is a snapshot of the run's
        progress, written again at the next flush: a damaged one is said once and read as absent)."""
        text = read_text(self.fs, self.path(name))
        if not text:
            return None
        try:
            return json.loads(text)
        except ValueError as e:
            log.warning(f"{self.shown(name)} is damaged ({e}); it is read as absent, and written again at the "
                        f"run's next flush")
            return None

    def write_status(self, status: dict) -> None:
        self._write(self.path(STATUS), json.dumps(status, indent=2, default=str).encode())

    def read_timeline(self) -> list:
        samples = self._snapshot(TIMELINE)
        return samples if isinstance(samples, list) else []

    def write_timeline(self, samples: list) -> None:
        """The run's progress over time (``overnight report`` plots it), one attempt after another."""
        self._write(self.path(TIMELINE), json.dumps(samples, default=str).encode())

    def clear(self) -> None:
        """Remove what overnight wrote here (parts, manifest, status), for --fresh."""
        for p in self.part_paths():
            self.fs.rm(p)
        for name in (MANIFEST, STATUS, TIMELINE):
            if self.fs.exists(self.path(name)):
                self.fs.rm(self.path(name))

    def _write(self, path: str, data: bytes) -> None:
        def attempt() -> None:
            if "/" in path:
                self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            write_atomic(self.fs, path, data)

        try:
            with_retries(attempt, f"writing {redact(unstrip(self.fs, path))}")
        except OSError as e:
            shown = redact(unstrip(self.fs, path))
            raise StorageError(f"Cannot write {shown}: {e.strerror or e}. Make --out writable or free space there "
                               f"(rows already in completed parts are kept; rerun to continue), or choose "
                               f"another --out.") from e


class CheckpointWriter:
    """Buffers results and flushes them as a new part every N rows or T seconds."""

    def __init__(self, out: OutputDir, schema: OutputSchema, run_id: str, model: str, first_index: int,
                 flush_rows: int, flush_seconds: float, clock: Callable[[], float] = time.monotonic,
                 on_flush: Optional[Callable[[list[Result], str], None]] = None,
                 may_write: Optional[Callable[[], bool]] = None):
        self.out = out
        self.schema = schema
        self.run_id = run_id
        self.model = model
        self.next_index = first_index
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self.clock = clock
        self.on_flush = on_flush
        self.may_write = may_write  # asked before each part: False once another run took the folder over
        self.num_unsaved = 0  # results not written because of it
        self.buffer: list[Result] = []
        self.last_flush = clock()

    def add(self, results: list[Result]) -> None:
        self.buffer.extend(results)
        if len(self.buffer) >= self.flush_rows:
            self.flush()

    def maybe_flush(self) -> None:
        if self.buffer and self.clock() - self.last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        self.last_flush = self.clock()
        if not self.buffer:
            return
        results, self.buffer = self.buffer, []
        if self.may_write is not None and not self.may_write():
            self.num_unsaved += len(results)
            return
        table = self.schema.table(results, self.run_id, self.model)
        try:
            path = self.out.write_part(self.next_index, table)
        except Exception:
            self.buffer = results + self.buffer  # keep them: a later flush may succeed
            raise
        self.next_index += 1
        if self.on_flush:
            self.on_flush(results, path)
