"""Where a job's files live in OUT, sharded or not, and how commands that read OUT find every shard's.

    OUT/manifest.json, OUT/parts/, OUT/status.json      a job run without --shard
    OUT/shards/00001-of-00004/                          shard 1 of 4: its own manifest.json, parts/,
                                                        status.json and lock; no shard writes another's
    OUT/workers/w00002/                                 Ray worker 2 (--workers): the same, without a lock
                                                        (the driver holds OUT's); OUT/status.json is the
                                                        driver's, for the whole job

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
from overnight.pipeline.output.checkpoint import MANIFEST, OutputDir, OutputUsageError
from overnight.pipeline.output.lock import RunLock
from overnight.pipeline.output.storage import join

SHARDS, WORKERS = "shards", "workers"
NAME_RE = re.compile(r"^(\d{5,})-of-(\d{5,})$")
WORKER_RE = re.compile(r"^w(\d{5,})$")


@dataclass
class JobDir:
    """One job's folder in OUT: the root, shards/<K-of-N>/ or workers/w<i>/."""
    shard: Optional[Shard]
    out: OutputDir
    worker: Optional[int] = None

    @property
    def label(self) -> str:
        if self.worker is not None:
            return f"w{self.worker}"
        return "-" if self.shard is None else str(self.shard)

    @property
    def group(self) -> str:
        """Folders of one job share a group: "unsharded", "N shards" or "ray"."""
        if self.worker is not None:
            return "ray"
        return "unsharded" if self.shard is None else f"{self.shard.n} shards"

    def has_results(self) -> bool:
        return self.out.fs.exists(self.out.path(MANIFEST)) or bool(self.out.part_paths())


def job_out(url: str, shard: Optional[Shard]) -> OutputDir:
    """The folder shard ``shard`` of the job in ``url`` writes to (OUT itself without a shard)."""
    return OutputDir(url) if shard is None else OutputDir(join(url.rstrip("/"), SHARDS, shard.name))


def worker_out(url: str, index: int) -> OutputDir:
    return OutputDir(join(url.rstrip("/"), WORKERS, f"w{index:05d}"))


def _names(root: OutputDir, folder: str) -> list[str]:
    path = root.path(folder)
    if not root.fs.exists(path):
        return []
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in root.fs.ls(path, detail=False))


def job_dirs(url: str) -> list[JobDir]:
    """Every job folder in OUT that holds a manifest or parts: the root, the shards in order, the workers."""
    root = OutputDir(url)
    dirs = [JobDir(None, root)]
    for name in _names(root, SHARDS):
        m = NAME_RE.match(name)
        if m:
            shard = Shard(int(m.group(1)), int(m.group(2)))
            dirs.append(JobDir(shard, job_out(url, shard)))
    for name in _names(root, WORKERS):
        m = WORKER_RE.match(name)
        if m:
            dirs.append(JobDir(None, worker_out(url, int(m.group(1))), int(m.group(1))))
    return [d for d in dirs if d.has_results()]


def check_layout(url: str, shard: Optional[Shard], ray: bool = False) -> None:
    """Refuse to mix, in one OUT, jobs split into a different number of shards, unsharded ones and Ray's."""
    mine = "ray" if ray else JobDir(shard, OutputDir(url)).group
    dirs = job_dirs(url)
    driver = not ray and _ray_driver_holds(url)
    if driver:  # its workers may not have written a folder yet
        dirs.append(JobDir(None, OutputDir(url), 0))
    for d in dirs:
        if d.group == mine:
            continue
        ray_held = "a run on Ray workers, running now" if driver else "a run on Ray workers (workers/)"
        held = {"unsharded": "an unsharded run", "ray": ray_held}.get(
            d.group, f"a job split into {d.group} ({SHARDS}/*-of-{d.shard.n:05d})" if d.shard else "")
        this = ("this run is on Ray workers" if ray else "this run has no --shard" if shard is None
                else f"this run is shard {shard}")
        fix = {"unsharded": "run without --shard or --workers", "ray": "run with --workers"}.get(
            d.group, f"run every shard with --shard K/{d.shard.n} (or auto with {d.shard.n} tasks; a Slurm array "
                     f"task submitted alone, as with sbatch --array=2, is shard 0/1 to auto: give it --shard "
                     f"K/{d.shard.n})" if d.shard else "")
        raise OutputUsageError(f"{url} holds the results of {held}, and {this}. Changing how a job is split between "
                          f"attempts would move rows between shards, so it is refused: {fix} to continue, or use "
                          f"another --out (or remove {url}) to start over.")


def _ray_driver_holds(url: str) -> bool:
    """Whether a live Ray driver holds OUT's lock: its workers' folders, what marks the job as Ray's, are written
    only as they start, and a shard run checking meanwhile would find nothing to refuse."""
    lock = RunLock(OutputDir(url))
    try:
        other = lock.holder()
    except OSError:
        return False
    return bool(other) and other.get("split") == "ray" and not lock.is_stale(other)


def read_manifests(url: str) -> list[tuple[JobDir, Optional[dict]]]:
    return [(d, d.out.read_manifest()) for d in job_dirs(url)]


def job_manifest(url: str) -> Optional[dict]:
    """OUT's manifest: the job's own, or for a sharded job the first shard's with the counts of all of them
    (``shards`` lists each shard's run id and state)."""
    found = [(d, m) for d, m in read_manifests(url) if m is not None]
    if not found:
        return None
    if len(found) == 1 and found[0][0].shard is None and found[0][0].worker is None:
        return found[0][1]
    merged = dict(found[0][1])
    counts: dict = {}
    for _, m in found:
        for k, v in m.get("counts", {}).items():
            if isinstance(v, int):
                counts[k] = counts.get(k, 0) + v
    shards = sum(d.shard is not None for d, _ in found)  # (Ray workers' folders are not shards)
    missing = _expected(found) - shards if shards else 0
    if missing > 0:  # shards not started yet: their rows are not known (each counts its own when it starts)
        merged["rows_of_started_shards"] = counts.get("num_rows")
        counts["num_rows"] = None
        merged["shards_not_started"] = missing
    if any(d.worker is not None for d, _ in found):  # Ray: a worker counts the units it took; the driver the job
        rows = (OutputDir(url).read_status() or {}).get("rows") or {}
        if isinstance(rows.get("total"), int):
            counts["num_rows"] = rows["total"]
        if isinstance(rows.get("removed"), int):  # the folders' rows no longer in the input: the driver's pass
            counts["num_removed"] = rows["removed"]
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
