"""The output folder: Parquet parts that count only when complete, a manifest, a status file.

    OUT/parts/part-00000.parquet ...   finished rows; a part exists whole or not at all
    OUT/manifest.json                  the run: id, resolved config, fingerprint, counts, state, attempts
    OUT/status.json                    the latest progress snapshot (rows, tokens/s, ETA, exit code)

The parts are the truth. A kill between writing a part and updating the
manifest leaves the manifest's counts stale; the next start recounts them
from the parts.
"""

from __future__ import annotations

import io
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pyarrow as pa

from overnight.pipeline.records import Result
from overnight.pipeline.output.faults import failpoint
from overnight.pipeline.output.storage import (StorageError, join, read_text, redact, unstrip, url_to_fs, with_retries,
                                        write_atomic)

PART_RE = re.compile(r"^part-(\d{5,})\.parquet$")
MANIFEST = "manifest.json"
STATUS = "status.json"
PARTS = "parts"


class OutputError(Exception):
    "The output folder cannot be used; the message names it and the fix."


@dataclass
class Scan:
    """What the completed parts already hold."""

    # id -> prompt hash of every row already in a completed part
    done_ids: dict = field(default_factory=dict)
    # Rows with a null id cannot be matched by id; their error message starts with "<file>#<row>".
    null_id_origins: set = field(default_factory=set)
    num_ok: int = 0
    num_error: int = 0
    num_output_tokens: int = 0
    num_parts: int = 0
    next_index: int = 0

    @property
    def num_done(self) -> int:
        return self.num_ok + self.num_error


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

    def part_glob(self) -> str:
        return self.shown(PARTS, "part-*.parquet")

    def scan(self, id_column: str, into: Optional[Scan] = None) -> Scan:
        """Read the id, status and token columns of every completed part (added to ``into`` when given)."""
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        scan = into if into is not None else Scan()
        for p in self.part_paths():
            try:
                with self.fs.open(p, "rb") as f:
                    names = pq.read_schema(f).names
                    f.seek(0)
                    cols = [id_column, "status", "output_tokens", "error"] + (
                        ["prompt_hash"] if "prompt_hash" in names else [])
                    t = pq.read_table(f, columns=cols)
            except (pa.ArrowInvalid, OSError, KeyError) as e:
                raise OutputError(f"Part {unstrip(self.fs, p)} cannot be read ({e}). Delete it and rerun: "
                                  f"its rows will be processed again.") from None
            ids = t.column(id_column)
            hashes = t.column("prompt_hash").to_pylist() if "prompt_hash" in t.column_names else [None] * t.num_rows
            scan.done_ids.update(zip(ids.to_pylist(), hashes))
            if ids.null_count:
                errors = t.filter(pc.is_null(ids)).column("error").to_pylist()
                scan.null_id_origins.update(e.split(": ", 1)[0] for e in errors if e)
            status = t.column("status").to_pylist()
            ok = sum(1 for s in status if s == "ok")
            scan.num_ok += ok
            scan.num_error += len(status) - ok
            scan.num_output_tokens += int(pc.sum(t.column("output_tokens")).as_py() or 0)
            scan.num_parts += 1
            index = int(PART_RE.match(p.rsplit("/", 1)[-1]).group(1))
            scan.next_index = max(scan.next_index, index + 1)
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
        text = read_text(self.fs, self.path(STATUS))
        return json.loads(text) if text else None

    def write_status(self, status: dict) -> None:
        self._write(self.path(STATUS), json.dumps(status, indent=2, default=str).encode())

    def clear(self) -> None:
        """Remove what overnight wrote here (parts, manifest, status), for --fresh."""
        for p in self.part_paths():
            self.fs.rm(p)
        for name in (MANIFEST, STATUS):
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


class OutputSchema:
    """Arrow schema of output rows: id, passthrough columns, then the result fields."""

    def __init__(self, id_name: str, id_type: pa.DataType, passthrough: list[pa.Field]):
        from overnight.pipeline.records import RESULT_FIELDS

        reserved = set(RESULT_FIELDS) | {id_name}
        self.id_name = id_name
        # Input column name -> output column name; clashes with result fields get an "input_" prefix.
        self.renames = {f.name: (f"input_{f.name}" if f.name in reserved else f.name) for f in passthrough}
        # Naive UTC: DuckDB and pandas read it without a timezone database.
        ts = pa.timestamp("ms")
        self.schema = pa.schema(
            [pa.field(id_name, id_type)]
            + [pa.field(self.renames[f.name], f.type) for f in passthrough]
            + [
                pa.field("text", pa.string()),
                pa.field("finish_reason", pa.string()),
                pa.field("prompt_tokens", pa.int32()),
                pa.field("output_tokens", pa.int32()),
                pa.field("predicted_tokens", pa.int32()),
                pa.field("bucket", pa.int16()),
                pa.field("queued_at", ts),
                pa.field("first_token_at", ts),
                pa.field("finished_at", ts),
                pa.field("status", pa.string()),
                pa.field("error", pa.string()),
                pa.field("prompt_hash", pa.string()),
                pa.field("run_id", pa.string()),
                pa.field("model", pa.string()),
            ]
        )

    def table(self, results: list[Result], run_id: str, model: str) -> pa.Table:
        n = len(results)
        cols: dict[str, Any] = {self.id_name: [r.id for r in results]}
        for src, dst in self.renames.items():
            cols[dst] = [r.passthrough.get(src) for r in results]
        for name in ("text", "finish_reason", "prompt_tokens", "output_tokens", "predicted_tokens", "bucket",
                     "status", "error", "prompt_hash"):
            cols[name] = [getattr(r, name) for r in results]
        for name in ("queued_at", "first_token_at", "finished_at"):
            cols[name] = [None if getattr(r, name) is None else int(getattr(r, name) * 1000) for r in results]
        cols["run_id"] = [run_id] * n
        cols["model"] = [model] * n
        arrays = [pa.array(cols[f.name], type=f.type) for f in self.schema]
        return pa.Table.from_arrays(arrays, schema=self.schema)


class CheckpointWriter:
    """Buffers results and flushes them as a new part every N rows or T seconds."""

    def __init__(self, out: OutputDir, schema: OutputSchema, run_id: str, model: str, first_index: int,
                 flush_rows: int, flush_seconds: float, clock: Callable[[], float] = time.monotonic,
                 on_flush: Optional[Callable[[list[Result], str], None]] = None):
        self.out = out
        self.schema = schema
        self.run_id = run_id
        self.model = model
        self.next_index = first_index
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self.clock = clock
        self.on_flush = on_flush
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
        table = self.schema.table(results, self.run_id, self.model)
        try:
            path = self.out.write_part(self.next_index, table)
        except Exception:
            self.buffer = results + self.buffer  # keep them: a later flush may succeed
            raise
        self.next_index += 1
        if self.on_flush:
            self.on_flush(results, path)
