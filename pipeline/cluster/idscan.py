"""What the Ray driver reads of the input's ids before any worker starts, in one pass over that column alone.

A worker reads only its units, so none of them sees the whole input: not an id that repeats one in another
worker's unit (on one engine the resume filter skips it as a duplicate), nor a done id that left the input (on
one engine reported as no longer in it, and not counted as done). The driver reads the ids once, in input order:
each row whose id was met before is handed to its unit as a row to skip (the worker counts it a duplicate), and
the worker folders' ids are matched against the input (the job's rows done at its start). An input without an id
column has neither (its ids are its rows' origins) unless a folder holds rows, and is not read for the first.
Measured on this machine (2 cores): 1M string ids in 1.05 s fresh, 1.6 s on a resume whose folders hold every
id; 100k JSONL lines (each parsed for its custom_id) in 0.94 s (benchmarks/ray_id_scan.py; docs/BENCHMARKS.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from overnight.pipeline.output.layout import job_dirs


@dataclass
class IdScan:
    done_in_input: int = 0      # the folders' rows whose ids are the input's (each id once)
    gone: int = 0               # the folders' ids no longer in the input
    examples: list = field(default_factory=list)   # up to 3 of those
    skips: dict = field(default_factory=dict)  # unit index -> the row numbers (as its batches number them) of its
    num_duplicates: int = 0                    # rows whose id repeats one met earlier in the input


def scan_input_ids(cfg, source, fresh: bool, units: list) -> IdScan:
    """The pass over the ids of the job's units, in order (the input up to its --limit): each unit's rows are read
    as its worker will read them, so the rows to skip are numbered as that worker's batches number them (a JSONL
    file's line numbers, blank lines counted)."""
    from overnight.pipeline.idkeys import KeyTable, first_of_each, keys_of
    from overnight.pipeline.output.checkpoint import Scan

    out = IdScan()
    scan = Scan()
    if not fresh:
        for d in job_dirs(cfg.output.path):
            if d.worker is not None:
                d.out.scan(cfg.input.id_column, into=scan)
    id_col = cfg.input.id_column if source.has_id_column else None
    if not scan.num_done and id_col is None:
        return out
    done, met_flag = scan.done, 1
    if len(done):
        done.flags[...] = 0
    met = KeyTable() if id_col else None
    found_null = set()
    for unit, sb in ((u, sb) for u in units for sb in source._read(iter(u.fragments), [id_col] if id_col else [])):
        n = sb.batch.num_rows
        origins = None
        if id_col:
            ids = sb.batch.column(id_col)
        else:  # derived ids: "<file>#<row>"
            origins = ids = pa.array([f"{sb.file.name}#{sb.row_number(i)}" for i in range(n)])
        keys, checks, valid = keys_of(ids)
        rows = np.flatnonzero(valid)
        if met is not None and len(rows):
            seen = met.find(keys[rows], checks[rows]) >= 0
            new = rows[~seen]
            first = new[first_of_each(keys[new], checks[new])] if len(new) else new
            again = np.setdiff1d(rows, first, assume_unique=True)
            if len(again):
                out.skips.setdefault(unit.index, []).extend(sb.row_number(int(i)) for i in again)
            met.add(keys[first], checks[first])
        if len(done) and len(rows):
            slots = done.find(keys[rows], checks[rows])
            done.set_flags(slots[slots >= 0], met_flag)
        if not valid.all() and len(scan.null_origins):  # error rows of null ids, matched by their origin
            null = np.flatnonzero(~valid)
            o = (origins.take(pa.array(null)) if origins is not None
                 else pa.array([f"{sb.file.name}#{sb.row_number(int(i))}" for i in null]))
            k, c, _ = keys_of(o)
            found_null.update(o.filter(pa.array(scan.null_origins.find(k, c) >= 0)).to_pylist())
    out.skips = {u: tuple(int(r) for r in rows) for u, rows in out.skips.items()}
    out.num_duplicates = sum(len(r) for r in out.skips.values())
    if len(done):
        occupied = done.occupied()
        flagged = (done.flags & met_flag) != 0
        in_input = int((occupied & flagged).sum())
        # (past a --limit, a done id is not the input's rows, and not gone from it either)
        out.gone = 0 if cfg.input.limit is not None else int((occupied & ~flagged).sum())
        if out.gone:
            flags = done.flags.reshape(-1)
            out.examples = scan.find_ids(lambda slots: (flags[slots] & met_flag) == 0, 3)
        null_done = scan.num_done - len(done)   # error rows without an id (each its own row)
        out.done_in_input = in_input + min(len(found_null), max(0, null_done))
    return out
