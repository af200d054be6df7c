"""Where a job's files live in OUT, sharded or not, and how commands that read OUT find every shard's.

    OUT/manifest.json, OUT/parts/, OUT/status.json      a job run without --shard
    OUT/shards/00001-of-00004/                          shard 1 of 4: its own manifest.json, parts/,
                                                        status.json and lock; no shard writes another's

Ids are the resume key across OUT: the split is a pure function of the input listing and N, so shard K of N
always reads the same rows and resumes from its own folder. Changing N between attempts is refused (the rows
would move between shards while another N's results are in OUT); finish the job with the N it started with,
or start over in a new OUT.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from overnight.pipeline.input.shards import Shard
from overnight.pipeline.output.checkpoint import MANIFEST, OutputDir, OutputError
from overnight.pipeline.output.storage import join

SHARDS = "shards"
NAME_RE = re.compile(r"^(\d{5,})-of-(\d{5,})$")


@dataclass
class JobDir:
    """One job's folder in OUT: the root (shard None) or shards/<K-of-N>/."""
    shard: Optional[Shard]
    out: OutputDir

    @property
    def label(self) -> str:
        return "-" if self.shard is None else str(self.shard)

    def has_results(self) -> bool:
        return self.out.fs.exists(self.out.path(MANIFEST)) or bool(self.out.part_paths())


def job_out(url: str, shard: Optional[Shard]) -> OutputDir:
    """The folder shard ``shard`` of the job in ``url`` writes to (OUT itself without a shard)."""
    return OutputDir(url) if shard is None else OutputDir(join(url.rstrip("/"), SHARDS, shard.name))


def job_dirs(url: str) -> list[JobDir]:
    """Every job folder in OUT that holds a manifest or parts: the root first, then the shards in order."""
    root = OutputDir(url)
    dirs = [JobDir(None, root)] if JobDir(None, root).has_results() else []
    folder = root.path(SHARDS)
    if root.fs.exists(folder):
        names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in root.fs.ls(folder, detail=False))
        for name in names:
            m = NAME_RE.match(name)
            if m:
                d = JobDir(Shard(int(m.group(1)), int(m.group(2))), job_out(url, Shard(int(m.group(1)),
                                                                                       int(m.group(2)))))
                if d.has_results():
                    dirs.append(d)
    return dirs


def check_layout(url: str, shard: Optional[Shard]) -> None:
    """Refuse to mix jobs split into a different number of shards (or unsharded) in one OUT."""
    mine = None if shard is None else shard.n
    for d in job_dirs(url):
        theirs = None if d.shard is None else d.shard.n
        if theirs == mine:
            continue
        held = "an unsharded run" if theirs is None else f"a job split into {theirs} shards ({SHARDS}/*-of-{theirs:05d})"
        this = "this run has no --shard" if shard is None else f"this run is shard {shard}"
        fix = ("run without --shard" if theirs is None else f"run every shard with --shard K/{theirs} (or auto with "
               f"{theirs} tasks)")
        raise OutputError(f"{url} holds the results of {held}, and {this}. Changing the number of shards between "
                          f"attempts would move rows between shards, so it is refused: {fix} to continue, or use "
                          f"another --out (or remove {url}) to start over with {mine or 'no'} shards.")


def part_globs(url: str) -> list[str]:
    """DuckDB globs over every completed part in OUT, one per job folder that has parts."""
    return [d.out.part_glob() for d in job_dirs(url) if d.out.part_paths()]


def read_manifests(url: str) -> list[tuple[JobDir, Optional[dict]]]:
    return [(d, d.out.read_manifest()) for d in job_dirs(url)]


def job_manifest(url: str) -> Optional[dict]:
    """OUT's manifest: the job's own, or for a sharded job the first shard's with the counts of all of them
    (``shards`` lists each shard's run id and state)."""
    found = [(d, m) for d, m in read_manifests(url) if m is not None]
    if not found:
        return None
    if len(found) == 1 and found[0][0].shard is None:
        return found[0][1]
    merged = dict(found[0][1])
    counts: dict = {}
    for _, m in found:
        for k, v in m.get("counts", {}).items():
            if isinstance(v, int):
                counts[k] = counts.get(k, 0) + v
    merged["counts"] = counts
    merged["attempts"] = [a for _, m in found for a in m.get("attempts", [])]
    merged["state"] = combined_state([m.get("state") for _, m in found], expected=_expected(found))
    merged["shards"] = [{"shard": d.label, "run_id": m.get("run_id"), "state": m.get("state")} for d, m in found]
    return merged


def _expected(found) -> int:
    return max((d.shard.n for d, _ in found if d.shard is not None), default=1)


def combined_state(states: list[Optional[str]], expected: int) -> str:
    """The job's state from its shards': completed only when all N are."""
    states = [s or "not started" for s in states] + ["not started"] * max(0, expected - len(states))
    for s in ("failed", "running", "interrupted", "partial", "not started"):
        if s in states:
            return s if s != "not started" or len(set(states)) == 1 else "partial"
    return "completed"
