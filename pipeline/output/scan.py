"""What a job's completed parts already hold, as a resume needs it (``OutputDir.scan`` in checkpoint.py fills it):
their counts, the kinds of their ids, and the ids themselves as compact keys (``pipeline/idkeys.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pyarrow as pa


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
