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

from overnight.pipeline.input.shards import Fragment, fragments_of
from overnight.pipeline.input.source import ParquetSource, SourceBatch

log = logging.getLogger("overnight")

UNITS_PER_WORKER = 8


@dataclass(frozen=True)
class Unit:
    index: int
    fragments: tuple[Fragment, ...]
    recheck: tuple[str, ...] = ()  # "folder#n": output folders of workers that held this unit and died

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

    def __init__(self, cfg, next_unit: Callable[[], Optional[Unit]], id_column_of: Callable[[str], set]):
        super().__init__(cfg)
        self.next_unit = next_unit
        self.done_in = id_column_of  # the ids already written in a dead worker's folder ("folder#n")
        self.on_unit: Callable[[int], None] = lambda n: None
        self.rows_taken = 0
        self.sees_every_row = False  # its resume must not call the ids other workers wrote "removed"

    @property
    def num_rows(self) -> int:
        return self.rows_taken

    def batches(self) -> Iterator[SourceBatch]:
        columns = self.read_columns()
        while True:
            unit = self.next_unit()
            if unit is None:
                return
            self.rows_taken += unit.num_rows
            self.on_unit(unit.num_rows)
            skip: set = set()
            for folder in unit.recheck:
                skip |= self.done_in(folder)
            for sb in self._read(iter(unit.fragments), columns):
                sb = _without(sb, skip, self.cfg.id_column if self.has_id_column else None) if skip else sb
                if sb is not None:
                    yield sb


def _without(sb: SourceBatch, skip: set, id_column: Optional[str]) -> Optional[SourceBatch]:
    import pyarrow as pa

    n = sb.batch.num_rows
    ids = sb.batch.column(id_column).to_pylist() if id_column else [None] * n
    keep = [i for i in range(n) if (ids[i] if ids[i] is not None else f"{sb.file.name}#{sb.row_number(i)}")
            not in skip]
    if not keep:
        return None
    if len(keep) == n:
        return sb
    return SourceBatch(sb.file, sb.start, sb.batch.take(pa.array(keep)), [sb.row_number(i) for i in keep])
