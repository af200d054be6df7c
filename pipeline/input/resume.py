"""The resume filter: which input rows this attempt still has to answer.

A row is skipped when a completed part already holds its id (it counts as
resumed; if its prompt changed since, that is reported and the old result is
kept), or when an earlier row in this pass had the same id (a duplicate).
After a full pass, ids that were done but are no longer in the input are
reported. Runs in the input thread; it only updates the tally's counters.

It works on whole source batches, before the per-row parse, with ids as keys
(``pipeline/idkeys.py``): the ids done are the Scan's table, whose flags mark
those this pass has met; the other ids met in this pass are a second table.
10M ids done take 352 MB (the scan's table), 10M ids met and not done 217 MB
(this pass's), where a dict and a set of Python objects took some 2.4 GB; a
rerun that finds every row done parses no row in Python. What is left of a batch goes on as
a SourceBatch of those rows, with their row numbers.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Iterable, Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from overnight.pipeline.idkeys import KeyTable, U64, string_parts, first_of_each, keys_of, u64_to_hex16
from overnight.pipeline.input.source import SourceBatch
from overnight.pipeline.output.checkpoint import Scan
from overnight.pipeline.tally import Tally

log = logging.getLogger("overnight")

MET = 1  # flag of a done id: this pass has met it in the input
GROUP_ROWS = 16384  # input rows filtered at a time by filter_batches


class _Group:
    """Consecutive source batches filtered as one: row r of the group is row r - offsets[j] of batch j."""

    def __init__(self, batches: list[SourceBatch], offsets: np.ndarray):
        self.batches = batches
        self.offsets = offsets
        self.num_rows = int(offsets[-1])
        self._columns: dict = {}

    def column(self, name: str) -> pa.Array:
        if name not in self._columns:
            cols = [sb.batch.column(name) for sb in self.batches]
            self._columns[name] = cols[0] if len(cols) == 1 else pa.concat_arrays(cols)
        return self._columns[name]

    def locate(self, r: int) -> tuple[SourceBatch, int]:
        j = int(np.searchsorted(self.offsets, r, side="right")) - 1
        return self.batches[j], r - int(self.offsets[j])

    def origin(self, r: int) -> str:
        sb, i = self.locate(r)
        return f"{sb.file.name}#{sb.row_number(i)}"

    def split(self, rows: np.ndarray) -> list[tuple[SourceBatch, np.ndarray]]:
        """Group rows (ascending) as (batch, its row indices), batch by batch."""
        j = np.searchsorted(self.offsets, rows, side="right") - 1
        return [(self.batches[b], rows[j == b] - self.offsets[b]) for b in np.unique(j)]


class ResumeFilter:
    def __init__(self, scan: Scan, tally: Tally, out_url: str):
        self.scan = scan
        self.tally = tally
        self.out_url = out_url
        self.done = scan.done
        if len(self.done):
            self.done.flags[...] = 0  # a new pass has met none of them
        self.seen = KeyTable()  # ids met in this pass that no part holds

    def filter(self, sb: SourceBatch, cfg) -> Optional[SourceBatch]:
        """The rows of ``sb`` still to answer (``sb`` itself when that is all of them), or None when none is.

        cfg: the InputConfig (id, prompt and messages columns)."""
        return self._filter_group([sb], cfg)[0]

    def filter_batches(self, batches: Iterable[SourceBatch], cfg) -> Iterator[SourceBatch]:
        """``filter`` over a stream of batches, in order, leaving out those with no row left.

        Batch by batch while rows are kept, so nothing is read ahead of need (a source that hands out work as
        it is asked, as Ray workers' does, is asked no sooner); while whole batches are done, in growing groups
        up to some 16k rows, so a rerun over rows already done pays the array work's fixed cost once a group."""
        group: list[SourceBatch] = []
        rows, target = 0, 0
        for sb in batches:
            group.append(sb)
            rows += sb.batch.num_rows
            if rows >= target:
                kept = [k for k in self._filter_group(group, cfg) if k is not None]
                target = 0 if kept else min(GROUP_ROWS, 2 * rows)
                group, rows = [], 0
                yield from kept
        if group:
            yield from (k for k in self._filter_group(group, cfg) if k is not None)

    def _filter_group(self, group: list[SourceBatch], cfg) -> list[Optional[SourceBatch]]:
        rows_in = [sb.batch.num_rows for sb in group]
        g = _Group(group, np.cumsum([0] + rows_in))
        n = g.num_rows
        if n == 0:
            return [None] * len(group)
        if cfg.id_column in group[0].batch.schema.names:
            ids = g.column(cfg.id_column)
        else:
            ids = pa.concat_arrays([self._origins(sb, np.arange(sb.batch.num_rows)) for sb in group])
        keys, checks, valid = keys_of(ids)
        keep = np.zeros(n, bool)

        rows = np.flatnonzero(valid)
        dup = np.zeros(n, bool)
        if len(rows):
            first = rows[first_of_each(keys[rows], checks[rows])]
            dup[rows] = True
            dup[first] = False  # a later row with the same id is a duplicate
            slots = self.done.find(keys[first], checks[first])
            done = slots >= 0
            met = np.zeros(len(first), bool)
            if done.any():
                met[done] = (self.done.flags_at(slots[done]) & MET) != 0
            resumed = done & ~met
            dup[first[done & met]] = True
            if resumed.any():
                self.done.set_flags(slots[resumed], MET)
                self.tally.num_resumed += int(resumed.sum())
                self._check_prompts(g, cfg, first[resumed], self.done.value_at(slots[resumed]))
            fresh = first[~done]
            if len(fresh):
                seen = self.seen.contains(keys[fresh], checks[fresh])
                dup[fresh[seen]] = True
                new = fresh[~seen]
                self.seen.insert_new(keys[new], checks[new])
                keep[new] = True
        if not valid.all():
            # A null id becomes an error row, matched by its origin: kept unless a part holds that error.
            null = np.flatnonzero(~valid)
            if len(self.scan.null_origins):
                origins = pa.concat_arrays([self._origins(sb, i) for sb, i in g.split(null)])
                ok, oc, _ = keys_of(origins)
                held = self.scan.null_origins.contains(ok, oc)
                keep[null[~held]] = True
                self.tally.num_resumed += int(held.sum())  # its error row is done, as a resumed id's row is
            else:
                keep[null] = True
        if dup.any():
            self._warn_duplicates(g, ids, np.flatnonzero(dup))
        out: list[Optional[SourceBatch]] = []
        for j, sb in enumerate(group):
            k = keep[g.offsets[j]:g.offsets[j + 1]]
            if k.all():
                out.append(sb)
                continue
            idx = np.flatnonzero(k)
            out.append(None if not len(idx) else SourceBatch(
                sb.file, sb.start, sb.batch.take(pa.array(idx)), [sb.row_number(int(i)) for i in idx]))
        return out

    # -- reports ---------------------------------------------------------------------------------
    def _warn_duplicates(self, g: "_Group", ids, rows: np.ndarray) -> None:
        before = self.tally.num_duplicates
        self.tally.num_duplicates += len(rows)
        for r in rows[:max(0, 5 - before)]:
            log.warning("duplicate id %r at %s: the first row with this id is kept, this one is skipped",
                        ids[int(r)].as_py(), g.origin(int(r)))

    def _check_prompts(self, g: "_Group", cfg, rows: np.ndarray, old: np.ndarray) -> None:
        """Count (and warn about the first 5) resumed rows whose prompt changed since their result was written.

        A plain prompt's hash is BLAKE2b of its UTF-8 bytes, computed here from the column's bytes; a row with a
        chat, or whose bytes hash differently, is parsed as ``validate`` parses it, which decides."""
        has = old != 0
        if not has.any():
            return
        rows, old = rows[has], old[has]
        names = g.batches[0].batch.schema.names
        plain = np.ones(len(rows), bool)
        if cfg.messages_column in names:
            msgs = g.column(cfg.messages_column)
            if msgs.null_count < len(msgs):
                plain &= np.asarray(msgs.is_null(), dtype=bool)[rows]
        prompts = g.column(cfg.prompt_column) if cfg.prompt_column in names else None
        if prompts is None:
            plain[:] = False
        elif prompts.null_count:
            # No prompt and no chat: no hash to compare (a chat row is decided by the parse below).
            has_prompt = ~np.asarray(prompts.is_null(), dtype=bool)[rows]
            skip = plain & ~has_prompt
            rows, old, plain = rows[~skip], old[~skip], plain[~skip]
        same = np.zeros(len(rows), bool)
        if plain.any() and (pa.types.is_string(prompts.type) or pa.types.is_large_string(prompts.type)
                            or pa.types.is_binary(prompts.type) or pa.types.is_large_binary(prompts.type)):
            starts, lengths, data = string_parts(prompts)
            mv = memoryview(data)
            b2 = hashlib.blake2b
            pr = rows[plain]
            digests = b"".join(b2(mv[s:s + ln], digest_size=8).digest()
                               for s, ln in zip(starts[pr].tolist(), lengths[pr].tolist()))
            same[plain] = np.frombuffer(digests, dtype=">u8").astype(U64) == old[plain]
        unsure = np.flatnonzero(~same)
        if len(unsure):
            self._check_parsed(g, cfg, rows[unsure], old[unsure])

    def _check_parsed(self, g: "_Group", cfg, rows: np.ndarray, old: np.ndarray) -> None:
        from overnight.pipeline.input.validate import parse_batch

        now = {}
        for sb, idx in g.split(rows):
            sub = SourceBatch(sb.file, sb.start, sb.batch.take(pa.array(idx)), [sb.row_number(int(i)) for i in idx])
            parsed, errors = parse_batch(sub, cfg, {}, [])
            now.update((p.origin, (p.id, p.prompt_hash)) for p in parsed)
            now.update((e.error.split(": ", 1)[0], (e.id, e.prompt_hash)) for e in errors)
        for r, was in zip(rows.tolist(), old.tolist()):
            origin = g.origin(r)
            row_id, new = now.get(origin, (None, None))
            was_hex = u64_to_hex16(was)
            if not new or new == was_hex:
                continue
            self.tally.num_changed += 1
            if self.tally.num_changed <= 5:
                log.warning(f"id {row_id!r} at {origin}: its prompt changed since its result was written "
                            f"(prompt_hash {was_hex} -> {new}); the old result is kept. Use --fresh to answer every "
                            f"row again, or a new --out")

    def report_removed(self, limited: bool) -> None:
        """After a full pass (not cut short by --limit): finished rows whose ids are no longer in the input. Once:
        when the input has been read (``stage.prepare``), and at the job's end if not then."""
        if limited or not len(self.done) or self.tally.num_removed is not None:
            return
        occupied = self.done.occupied()
        gone = int((occupied & ((self.done.flags & MET) == 0)).sum())
        self.tally.num_removed = gone
        if gone:
            flags = self.done.flags.reshape(-1)
            examples = self.scan.find_ids(lambda slots: (flags[slots] & MET) == 0, 3)
            log.warning(f"{gone} rows in {self.out_url} are no longer in the input (e.g. ids "
                        f"{', '.join(repr(i) for i in examples)}); their results are kept")

    @staticmethod
    def _origins(sb: SourceBatch, rows: np.ndarray) -> pa.Array:
        """"<file>#<row>" of these rows of the batch: the ids of an input without an id column."""
        if sb.row_numbers is None:
            numbers = pa.array(rows + sb.start)
        else:
            numbers = pa.array(np.asarray(sb.row_numbers, dtype=np.int64)[rows])
        return pc.binary_join_element_wise(f"{sb.file.name}#", pc.cast(numbers, pa.string()), "")


def done_within(scan: Scan, batches: Iterable[SourceBatch], cfg) -> int:
    """The rows of these batches (a --limit's rows, say) that a part in OUT holds: the distinct ids done, and
    the null-id rows whose error row a part holds. The output's other rows are outside this job's rows, which
    the progress, the rows left and the forecast must not count as done (runner.py)."""
    if not scan.num_done:
        return 0
    slots_met: list[np.ndarray] = []
    num_null = 0
    for sb in batches:
        n = sb.batch.num_rows
        names = sb.batch.schema.names
        ids = sb.batch.column(cfg.id_column) if cfg.id_column in names else ResumeFilter._origins(sb, np.arange(n))
        keys, checks, valid = keys_of(ids)
        if len(scan.done):
            slots = scan.done.find(keys[valid], checks[valid])
            slots_met.append(slots[slots >= 0])
        if not valid.all() and len(scan.null_origins):
            ok, oc, _ = keys_of(ResumeFilter._origins(sb, np.flatnonzero(~valid)))
            num_null += int(scan.null_origins.contains(ok, oc).sum())
    return (len(np.unique(np.concatenate(slots_met))) if slots_met else 0) + num_null


def reads_every_row(source, cfg) -> bool:
    """Whether a full pass reads every row of the input (cfg: the InputConfig): not a Ray worker's units, and no
    --limit that cuts it. Then the ids done that the pass did not meet are gone from the input (report_removed);
    past a limit that cuts it they are outside this job's rows (rows_outside)."""
    return source.sees_every_row and (cfg.limit is None or source.num_rows < cfg.limit)


def rows_outside(job) -> int:
    """Rows the output holds that are outside this job's rows, where a --limit cuts the input (a rerun with a
    lower --limit than the output's): found by a pass over the limit's ids, before the run (0.3 s at 150k ids
    of a Parquet input on this machine; an OpenAI Batch file's lines are parsed whole, some 1 s per 100k)."""
    scan, source, cfg = job.scan, job.source, job.cfg.input
    if not scan.num_done or not source.sees_every_row or reads_every_row(source, cfg):
        return 0
    try:
        done = done_within(scan, source.batches([cfg.id_column] if source.has_id_column else []), cfg)
    except Exception as e:  # the run's own pass meets it again, answers the rows before it and says so
        log.warning(f"the rows done within --limit {cfg.limit} could not be counted ({e}); the progress and the "
                    f"forecast count all {scan.num_done} rows the output holds as done")
        return 0
    if scan.num_done > done:
        log.info(f"{scan.num_done - done} of the rows done are past --limit {cfg.limit}: not this run's rows")
    return max(0, scan.num_done - done)


class DoneRows:
    """The inverse of the ResumeFilter, for a second pass over the input (plan's factor, a resumed run's warm
    start: pipeline/input/done_rows.py): the rows that a part in OUT holds (the first row of each id), in input
    order, up to ``limit`` of them, reading no further once it has them or every id done.

    scan: the Scan the ResumeFilter went by (a bit of its flags marks the ids taken)."""

    TAKEN = 2

    def __init__(self, scan: Scan, limit: int):
        self.done = scan.done
        self.limit = limit
        self.num_taken = 0

    def filter_batches(self, batches: Iterable[SourceBatch], cfg) -> Iterator[SourceBatch]:
        want = min(self.limit, len(self.done))  # (not a second pass over the whole input for a few done ids)
        if not want:
            return
        for sb in batches:
            n = sb.batch.num_rows
            names = sb.batch.schema.names
            ids = sb.batch.column(cfg.id_column) if cfg.id_column in names else ResumeFilter._origins(sb, np.arange(n))
            keys, checks, valid = keys_of(ids)
            slots = self.done.find(keys, checks)
            idx = np.flatnonzero(valid & (slots >= 0))
            idx = idx[(self.done.flags_at(slots[idx]) & self.TAKEN) == 0]
            idx = idx[first_of_each(keys[idx], checks[idx])][:want - self.num_taken]
            if len(idx):
                self.done.set_flags(slots[idx], self.TAKEN)
                self.num_taken += len(idx)
                yield sb if len(idx) == n else SourceBatch(sb.file, sb.start, sb.batch.take(pa.array(idx)),
                                                           [sb.row_number(int(i)) for i in idx])
            if self.num_taken >= want:  # read no further
                return

    def report_removed(self, limited: bool) -> None:
        """(Nothing to report: the ResumeFilter's pass did.)"""
