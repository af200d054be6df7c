"""Work units for Ray workers, and the source a worker reads them through.

The driver cuts the input into units of whole row groups, or slices of row groups where the input has too
few of them, so that there are many more units than workers (UNITS_PER_WORKER each). A worker's source asks
the coordinator for its next unit as its reader needs rows; the reader runs a few batches ahead of the engine
loop, so the next unit is taken before the current one drains and the engine never runs empty between units.

A unit handed out again after its worker died carries that worker's folder (``recheck``): the rows the dead
worker already wrote there are left out, so each id is answered exactly once.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import numpy as np
import pyarrow as pa

from overnight.pipeline.input.openai_batch import OpenAIBatchSource, is_jsonl_input
from overnight.pipeline.input.shards import Fragment, fragments_of
from overnight.pipeline.input.source import ParquetSource, SourceBatch

log = logging.getLogger("overnight")

UNITS_PER_WORKER = 8


@dataclass(frozen=True)
class Unit:
    index: int
    fragments: tuple[Fragment, ...]
    recheck: tuple[str, ...] = ()  # "folder#n": output folders of workers that held this unit and died
    # rows (numbered as the unit's batches number them: a Parquet file's row, a JSONL file's line) whose id repeats
    # one met earlier in the input, maybe in another unit: skipped and counted as duplicates, as one engine's resume
    # filter does (idscan.py)
    skip: tuple[int, ...] = ()

    @property
    def num_rows(self) -> int:
        return sum(f.num_rows for f in self.fragments)


def plan_units(files, num_workers: int, limit: Optional[int] = None) -> list[Unit]:
    """Units in input order, at least UNITS_PER_WORKER per worker where the rows allow, up to ``limit`` rows."""
    _, groups = fragments_of(files)
    total = sum(g.num_rows for g in groups)
    if limit is not None:
        total = min(total, limit)
    target = max(1, num_workers * UNITS_PER_WORKER)
    size = max(1, math.ceil(total / target))
    units, left = [], total
    for g in groups:
        if left <= 0:
            break
        n = min(g.num_rows, left)
        if n == 0:  # an empty file or row group (pq.write_table of an empty table writes one)
            continue
        cuts = max(1, math.ceil(n / size)) if g.num_rows > size else 1
        step = math.ceil(n / cuts)
        for a in range(0, n, step):
            b = min(n, a + step)
            whole = a == 0 and b == g.num_rows
            units.append(Unit(len(units), (Fragment(g.file_index, g.row_group, b - a, None if whole else (a, b)),)))
        left -= n
    return units


class UnitSource(ParquetSource):
    """The input as a worker sees it: units pulled one at a time from ``next_unit``; ``on_unit`` hears the rows
    of each unit taken."""

    # Batches the worker's input thread prepares ahead of its engine loop (one engine's: 4). A unit smaller than a
    # batch is a batch: four ahead held four units that a worker with a free engine would have taken.
    prefetch_depth = 1
    says_column_notes = False  # (the driver's opening of the input said them once)

    def __init__(self, cfg, next_unit: Callable[[], Optional[Unit]], id_column_of: Callable[[str], object]):
        super().__init__(cfg)
        self.next_unit = next_unit
        self.done_in = id_column_of  # a Scan of what a dead worker's folder holds ("folder#n")
        self.on_unit: Callable[[int], None] = lambda n: None
        self.on_duplicates: Callable[[int], None] = lambda n: None  # rows of a unit skipped as duplicates
        # rows of a unit handed out again that a dead worker's folder holds: done, and counted there
        self.on_done_elsewhere: Callable[[int], None] = lambda n: None
        self.rows_taken = 0
        self.sees_every_row = False  # its resume must not call the ids other workers wrote "removed"

    @property
    def num_rows(self) -> int:
        return self.rows_taken

    def second_pass(self) -> "_WholeInput":
        """The whole input from its first row, read directly: reading this source again would ask the driver
        for units, and take other workers' work."""
        return _WholeInput(self)

    def batches(self) -> Iterator[SourceBatch]:
        columns = self.read_columns()
        while True:
            unit = self.next_unit()
            if unit is None:
                return
            self.rows_taken += unit.num_rows
            self.on_unit(unit.num_rows)
            dead = [self.done_in(mark) for mark in unit.recheck]
            skip = np.asarray(unit.skip, np.int64)
            for sb in self._read(iter(unit.fragments), columns):
                if len(skip):
                    sb = _skipping(sb, skip, self.on_duplicates)
                    if sb is None:
                        continue
                for scan in dead:
                    n = sb.batch.num_rows
                    sb = _without(sb, scan, self.cfg.id_column if self.has_id_column else None)
                    if n - (0 if sb is None else sb.batch.num_rows):
                        self.on_done_elsewhere(n - (0 if sb is None else sb.batch.num_rows))
                    if sb is None:
                        break
                if sb is not None:
                    yield sb


class JsonlUnitSource(UnitSource, OpenAIBatchSource):
    """A worker's units of OpenAI Batch request lines (units are chunks of lines, or slices of them)."""


class _WholeInput:
    """A worker's input read whole, in input order (the driver's listing, up to --limit rows), as one engine's
    source reads it."""

    sees_every_row = True

    def __init__(self, units: UnitSource):
        self.units = units

    def batches(self) -> Iterator[SourceBatch]:
        return ParquetSource.batches(self.units)


def unit_source(cfg, next_unit: Callable[[], Optional[Unit]], id_column_of: Callable[[str], object]) -> UnitSource:
    """A worker's source, over Parquet or OpenAI Batch lines as the input is."""
    cls = JsonlUnitSource if is_jsonl_input(cfg.path) else UnitSource
    return cls(cfg, next_unit, id_column_of)


def _skipping(sb: SourceBatch, skip: np.ndarray, counted: Callable[[int], None]) -> Optional[SourceBatch]:
    """The batch without the rows whose file row numbers are in ``skip``; ``counted`` hears how many left out."""
    n = sb.batch.num_rows
    numbers = (np.arange(sb.start, sb.start + n) if sb.row_numbers is None
               else np.asarray(sb.row_numbers, np.int64))
    keep = np.flatnonzero(~np.isin(numbers, skip))
    if len(keep) == n:
        return sb
    counted(n - len(keep))
    if not len(keep):
        return None
    return SourceBatch(sb.file, sb.start, sb.batch.take(pa.array(keep)), row_numbers=numbers[keep].tolist())


def _without(sb: SourceBatch, scan, id_column: Optional[str]) -> Optional[SourceBatch]:
    """The rows of ``sb`` that ``scan`` (a dead worker's folder) does not hold: by id, or for a row without
    one by its origin, as the error row written for it is matched."""
    import numpy as np
    import pyarrow as pa

    from overnight.pipeline.idkeys import keys_of

    n = sb.batch.num_rows
    origins = pa.array([f"{sb.file.name}#{sb.row_number(i)}" for i in range(n)])
    ids = sb.batch.column(id_column) if id_column else origins
    keys, checks, valid = keys_of(ids)
    done = np.zeros(n, bool)
    rows = np.flatnonzero(valid)
    if len(rows) and len(scan.done):
        done[rows] = scan.done.find(keys[rows], checks[rows]) >= 0
    null = np.flatnonzero(~valid)
    if len(null) and len(scan.null_origins):
        ok, oc, _ = keys_of(origins.take(pa.array(null)))
        done[null] = scan.null_origins.contains(ok, oc)
    keep = np.flatnonzero(~done)
    if not len(keep):
        return None
    if len(keep) == n:
        return sb
    return SourceBatch(sb.file, sb.start, sb.batch.take(pa.array(keep)), [sb.row_number(int(i)) for i in keep])
