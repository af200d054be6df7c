"""The resume filter: which input rows this attempt still has to answer.

A row is skipped when a completed part already holds its id (it counts as
resumed; if its prompt changed since, that is reported and the old result is
kept), or when an earlier row in this pass had the same id (a duplicate).
After a full pass, ids that were done but are no longer in the input are
reported. Runs in the input thread; it only updates the tally's counters.
"""

from __future__ import annotations

import logging
from typing import Optional

from overnight.pipeline.output.checkpoint import Scan
from overnight.pipeline.records import Result
from overnight.pipeline.tally import Tally

log = logging.getLogger("overnight")


class ResumeFilter:
    def __init__(self, scan: Scan, tally: Tally, out_url: str):
        self.scan = scan
        self.tally = tally
        self.out_url = out_url
        self.emitted: set = set()  # ids this run has handed on (or skipped as already done)

    def is_new(self, row_id, origin: str, prompt_hash: Optional[str]) -> bool:
        done = self.scan.done_ids
        if row_id in done and row_id not in self.emitted:
            self.tally.num_resumed += 1
            self.emitted.add(row_id)  # a later duplicate of a resumed id is a duplicate
            old = done[row_id]
            if old and prompt_hash and old != prompt_hash:
                self.tally.num_changed += 1
                if self.tally.num_changed <= 5:
                    log.warning(f"id {row_id!r} at {origin.split(': ')[0]}: its prompt changed since its result was "
                                f"written (prompt_hash {old} -> {prompt_hash}); the old result is kept. Use --fresh "
                                f"to answer every row again, or a new --out")
            return False
        if row_id in self.emitted:
            self.tally.num_duplicates += 1
            if self.tally.num_duplicates <= 5:
                log.warning("duplicate id %r at %s: the first row with this id is kept, this one is skipped",
                            row_id, origin.split(": ")[0])
            return False
        self.emitted.add(row_id)
        return True

    def is_new_error(self, e: Result) -> bool:
        if e.id is None:  # matched by origin: its message starts with "<file>#<row>"
            return e.error.split(": ", 1)[0] not in self.scan.null_id_origins
        return self.is_new(e.id, e.error, e.prompt_hash)

    def report_removed(self, limited: bool) -> None:
        """After a full pass (not cut short by --limit): finished rows whose ids are no longer in the input."""
        if limited or not self.scan.done_ids:
            return
        gone = [i for i in self.scan.done_ids if i not in self.emitted and i is not None]
        self.tally.num_removed = len(gone)
        if gone:
            log.warning(f"{len(gone)} rows in {self.out_url} are no longer in the input (e.g. ids "
                        f"{', '.join(repr(i) for i in gone[:3])}); their results are kept")
