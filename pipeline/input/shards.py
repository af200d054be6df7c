"""Shard K of N: which part of the input one job reads, as a pure function of the input listing and N.

Every shard lists the input and reads the files' footers (never their rows), then computes the same
partition on its own, with no coordinator:

- at least N files: whole files;
- else at least N row groups: row groups;
- else (fewer fragments than shards): each shard reads the input and keeps the rows whose id hashes to it.
  That is logged, since every shard then reads every row.

Fragments go to shards largest first, each to the shard with the fewest rows so far (ties: the lower shard,
then input order), so each shard gets at least one fragment and about 1/N of the rows. A shard reads its
fragments in input order.

``--shard auto`` reads K and N from the cluster: a Slurm array (SLURM_ARRAY_TASK_ID, SLURM_ARRAY_TASK_COUNT,
with SLURM_ARRAY_TASK_MIN and SLURM_ARRAY_TASK_STEP so that --array=1-8 or 0-14:2 count from 0), or a
Kubernetes Indexed Job (JOB_COMPLETION_INDEX, with N from --shards or OVERNIGHT_SHARDS).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

from overnight.pipeline.config import ConfigError

SHARD_RE = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")
SLURM_VARS = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT")
K8S_INDEX = "JOB_COMPLETION_INDEX"
SHARDS_VAR = "OVERNIGHT_SHARDS"


@dataclass(frozen=True)
class Shard:
    k: int
    n: int

    def __str__(self) -> str:
        return f"{self.k}/{self.n}"

    @property
    def name(self) -> str:
        """Its folder in OUT: shards/<name>/."""
        return f"{self.k:05d}-of-{self.n:05d}"


@dataclass(frozen=True)
class Fragment:
    """A file, or one row group of it (or rows [start, stop) of that row group): what a shard or a Ray work
    unit reads."""
    file_index: int
    row_group: Optional[int]  # None: the whole file
    num_rows: int
    rows: Optional[tuple[int, int]] = None  # a slice of the row group, counted from its first row


@dataclass(frozen=True)
class Selection:
    """What one shard reads: its fragments in input order, or (hash fallback) every row whose id hashes to k."""
    fragments: tuple[Fragment, ...]
    hash_of: Optional[Shard] = None
    how: str = ""

    @property
    def num_rows(self) -> Optional[int]:
        """Rows selected; None under the hash fallback, where it is known only after reading the ids."""
        return None if self.hash_of else sum(f.num_rows for f in self.fragments)


def parse_shard(text: Optional[str], shards: Optional[int] = None,
                environ: Optional[Mapping[str, str]] = None) -> Optional[Shard]:
    """``K/N`` or ``auto`` -> Shard; None -> None (not sharded)."""
    if text is None:
        return None
    if text.strip().lower() == "auto":
        return _from_environment(os.environ if environ is None else environ, shards)
    m = SHARD_RE.match(text)
    if not m:
        raise ConfigError(f"--shard is {text!r}; give K/N (shard K of N, K from 0 to N-1, e.g. 0/4) or auto.")
    return _checked(int(m.group(1)), int(m.group(2)), "--shard")


def _checked(k: int, n: int, where: str) -> Shard:
    if n < 1 or not 0 <= k < n:
        raise ConfigError(f"{where} gives shard {k} of {n}; K counts from 0 and must be below N (N at least 1).")
    return Shard(k, n)


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ConfigError(f"${name} is {environ[name]!r}, not a whole number.") from None


def _from_environment(environ: Mapping[str, str], shards: Optional[int]) -> Shard:
    if all(v in environ for v in SLURM_VARS):
        first = _int(environ, "SLURM_ARRAY_TASK_MIN") if "SLURM_ARRAY_TASK_MIN" in environ else 0
        step = _int(environ, "SLURM_ARRAY_TASK_STEP") if "SLURM_ARRAY_TASK_STEP" in environ else 1
        k = (_int(environ, "SLURM_ARRAY_TASK_ID") - first) // max(step, 1)
        return _checked(k, _int(environ, "SLURM_ARRAY_TASK_COUNT"), "the Slurm array (SLURM_ARRAY_TASK_*)")
    if K8S_INDEX in environ:
        n = shards if shards is not None else (_int(environ, SHARDS_VAR) if SHARDS_VAR in environ else None)
        if n is None:
            raise ConfigError(f"--shard auto found ${K8S_INDEX} (a Kubernetes Indexed Job) but not the number of "
                              f"shards: pass --shards N (the Job's completions) or set ${SHARDS_VAR}.")
        return _checked(_int(environ, K8S_INDEX), n, f"${K8S_INDEX} with {n} shards")
    raise ConfigError(
        f"--shard auto found no shard in the environment. It looks for {' and '.join('$' + v for v in SLURM_VARS)} "
        f"(a Slurm job array), or ${K8S_INDEX} (a Kubernetes Indexed Job) with --shards N or ${SHARDS_VAR}. "
        f"Pass --shard K/N to name the shard yourself.")


def fragments_of(files) -> tuple[list[Fragment], list[Fragment]]:
    """(whole files, row groups) of the input listing."""
    whole = [Fragment(i, None, f.num_rows) for i, f in enumerate(files)]
    groups = [Fragment(i, g, rows) for i, f in enumerate(files) for g, rows in enumerate(f.row_groups)]
    return whole, groups


def split(files, shard: Shard) -> Selection:
    """Shard ``shard.k``'s part of the input: a pure function of the listing (names, row groups) and N."""
    whole, groups = fragments_of(files)
    if len(whole) >= shard.n:
        frags, how = whole, f"{len(whole)} files"
    elif len(groups) >= shard.n:
        frags, how = groups, f"{len(groups)} row groups in {len(whole)} files"
    else:
        return Selection((), hash_of=shard, how=f"the input has {len(groups)} row groups in {len(whole)} files, "
                                                 f"fewer than {shard.n} shards: split by a hash of the id")
    return Selection(tuple(assign(frags, shard.n)[shard.k]), how=f"split by {how}")


def assign(frags: list[Fragment], n: int) -> list[list[Fragment]]:
    """Largest first to the least loaded shard; each shard's fragments back in input order."""
    order = sorted(range(len(frags)), key=lambda i: (-frags[i].num_rows, i))
    loads, owned = [0] * n, [[] for _ in range(n)]
    for i in order:
        s = min(range(n), key=lambda j: (loads[j], j))
        loads[s] += frags[i].num_rows
        owned[s].append(i)
    return [[frags[i] for i in sorted(idx)] for idx in owned]


def hash_shard(row_id, n: int) -> int:
    """The shard of an id under the hash fallback: the same in every process and on every machine."""
    digest = hashlib.blake2b(str(row_id).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % n
