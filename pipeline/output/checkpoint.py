"""The output folder: Parquet parts that count only when complete, a manifest, a status file.

    OUT/parts/part-00000.parquet ...   finished rows; a part exists whole or not at all
    OUT/manifest.json                  the run: id, resolved config, fingerprint, counts, state, attempts
    OUT/status.json                    the latest progress snapshot (rows, tokens/s, ETA, exit code)
    OUT/timeline.json                  progress over time: a sample every few seconds, for `overnight report`

The parts are the truth. A kill between writing a part and updating the
manifest leaves the manifest's counts stale; the next start recounts them
from the parts. A part's columns are ``schema.OutputSchema``'s; ``writer.CheckpointWriter`` writes them.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import re
from typing import Optional

import pyarrow as pa

from overnight.pipeline.config import ConfigError
from overnight.pipeline.output.faults import failpoint
from overnight.pipeline.output.scan import Scan, id_kind
from overnight.pipeline.output.storage import (StorageError, join, read_text, redact, unstrip, url_to_fs, with_retries,
                                        write_atomic)

log = logging.getLogger("overnight")

PART_RE = re.compile(r"^part-(\d{5,})\.parquet$")
TMP_RE = re.compile(r"^\.tmp-[0-9a-f]{32}-.+$")  # storage.write_atomic's temporary files
MANIFEST = "manifest.json"
STATUS = "status.json"
TIMELINE = "timeline.json"
PARTS = "parts"
# Part rows turned into keys at a time by OutputDir.scan.
SCAN_CHUNK_ROWS = 65536


class OutputError(Exception):
    "The output folder cannot be used; the message names it and the fix."


class OutputUsageError(OutputError, ConfigError):
    """An OUT that holds another job's results than these options ask for (other settings, another split):
    bad usage, exit 2, as a rerun meets the same; a folder that cannot be used now stays an OutputError, exit 1."""


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


# The manifest's keys that the commands read, and the JSON type each must have
_MANIFEST_KEYS = {"fingerprint_fields": dict, "input": dict, "counts": dict, "attempts": list}


def _manifest_shape(manifest) -> Optional[str]:
    """What is wrong with a manifest's shape (a key missing or of another type), or None."""
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, not an object"
    for key, kind in _MANIFEST_KEYS.items():
        if not isinstance(manifest.get(key), kind):
            what = "missing" if key not in manifest else f"a {type(manifest[key]).__name__}"
            return f"its {key!r} is {what}, where a {kind.__name__} belongs"
    if not all(isinstance(a, dict) for a in manifest["attempts"]):
        return "an entry of its 'attempts' is not an object"
    return None


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

    def remove_leftovers(self) -> int:
        """Remove the temporary files of a run killed while it wrote a file (``write_atomic``'s .tmp-<hex>-<name>:
        a part, the manifest, status or timeline), which a glob such as OUT/**/*.parquet would read. Called by the
        run that holds the lock, the folder's only writer. Local folders only (object stores write no temporary
        files). Returns how many were removed."""
        from overnight.pipeline.output.storage import is_local

        if not is_local(self.fs):
            return 0
        removed = 0
        for folder in (self.root, self.path(PARTS)):
            try:
                names = os.listdir(folder)
            except OSError:
                continue
            for name in names:
                if TMP_RE.match(name) and not name.endswith(".overnight.lock"):
                    try:
                        os.unlink(os.path.join(folder, name))
                        removed += 1
                    except OSError:
                        pass
        return removed

    def parts_digest(self) -> str:
        """The parts as they are (names and sizes), from one listing: a completed job records it, and a rerun
        whose input is unchanged skips the scan only where it is unchanged too (a part truncated or replaced by
        hand since is then read, and named if it is damaged)."""
        import hashlib

        folder = self.path(PARTS)
        if not self.fs.exists(folder):
            return ""
        listed = sorted((e["name"].rsplit("/", 1)[-1], int(e.get("size") or 0))
                        for e in self.fs.ls(folder, detail=True))
        text = ";".join(f"{n}:{size}" for n, size in listed if PART_RE.match(n))
        return hashlib.sha1(text.encode()).hexdigest()[:16]

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

    def drop_errors(self, id_column: str) -> tuple[int, int]:
        """Remove the error rows from the parts, so that a resume answers those rows again (--retry-errors).
        Returns (error rows removed, parts rewritten or removed).

        Each part that holds an error row is written again without it, in place (``write_atomic``: a reader, or
        a run killed meanwhile, finds the old part or the new one, never a mix); a part of error rows only is
        removed. The manifest's counts follow. A part whose footer says every row is "ok" is not read.

        Before the first part changes, the manifest stops saying the job completed: a run killed meanwhile would
        otherwise leave a completed job over an unchanged input, whose rerun skips the scan, and the rows dropped
        would never be answered."""
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        dropped = touched = 0
        marked = False
        for p in self.part_paths():
            try:
                with self.fs.open(p, "rb") as f:
                    pf = pq.ParquetFile(f, pre_buffer=False)
                    names = pf.schema_arrow.names
                    if "status" not in names or _footer_says(pf.metadata, names, id_column)[0]:
                        continue
                    table = pf.read(use_threads=False)
            except (pa.ArrowInvalid, OSError) as e:
                raise OutputError(f"Part {unstrip(self.fs, p)} cannot be read ({e}). Delete it and rerun: "
                                  f"its rows will be processed again.") from None
            keep = table.filter(pc.fill_null(pc.not_equal(table.column("status"), "error"), True))
            if keep.num_rows == table.num_rows:
                continue
            if not marked:
                marked = True
                manifest = self.read_manifest()
                if manifest is not None and manifest.get("state") == "completed":
                    manifest["state"] = "partial"  # rows are about to be not done
                    self.write_manifest(manifest)
            dropped += table.num_rows - keep.num_rows
            touched += 1
            if keep.num_rows == 0:
                self.fs.rm(p)
            else:
                buf = io.BytesIO()
                pq.write_table(keep, buf, compression="zstd")
                self._write(p, buf.getvalue())
        manifest = self.read_manifest() if dropped else None
        if manifest is not None and isinstance(manifest.get("counts"), dict):
            counts = manifest["counts"]
            for name in ("num_done", "num_error"):
                if isinstance(counts.get(name), int):
                    counts[name] = max(0, counts[name] - dropped)
            counts["num_parts"] = len(self.part_paths())
            self.write_manifest(manifest)
        return dropped, touched

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
        try:
            text = read_text(self.fs, self.path(MANIFEST))
            if text is None:
                return None
            manifest = json.loads(text)
        except ValueError:  # (bytes that are not UTF-8 too)
            raise OutputError(f"{self.shown(MANIFEST)} is not valid JSON. Rerun with --fresh to start over, "
                              f"or restore the file.") from None
        wrong = _manifest_shape(manifest)
        if wrong:
            raise OutputError(f"{self.shown(MANIFEST)} is not an overnight manifest ({wrong}); edited by hand, or "
                              f"another tool's file. Restore it, or rerun with --fresh to start over.")
        return manifest

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
        try:
            text = read_text(self.fs, self.path(name))
            if not text:
                return None
            return json.loads(text)
        except ValueError as e:  # (bytes that are not UTF-8 too)
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
            if isinstance(e, (FileExistsError, NotADirectoryError)) or e.errno in (errno.EEXIST, errno.ENOTDIR):
                raise StorageError(f"Cannot write {shown}: {e.strerror or e}: a file stands where overnight keeps a "
                                   f"folder ({redact(unstrip(self.fs, path.rsplit('/', 1)[0]))}). Move that file "
                                   f"away, or choose another --out.") from e
            raise StorageError(f"Cannot write {shown}: {e.strerror or e}. Make --out writable or free space there "
                               f"(rows already in completed parts are kept; rerun to continue), or choose "
                               f"another --out.") from e
