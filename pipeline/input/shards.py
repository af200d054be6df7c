"""Shard K of N: which part of the input one job reads, as a pure function of the input listing and N.

Every shard lists the input and reads the files' footers (never their rows), then computes the same
partition on its own, with no coordinator. The input's rows, in input order, are cut into N ranges of equal
size (within one row): shard K reads rows [K*T//N, (K+1)*T//N) of the T rows. A range takes whole files and
row groups where it can; at its two ends it reads a slice of one row group (a JSONL chunk), so two shards may
each read the row group they share, and keep their own rows of it.

OUTs begun before this rule (stop 42) keep the rule they started with, ``FRAGMENTS``, since a shard's resume
is its own and a new rule would move rows between shards: whole files when there are at least N, else row
groups, each to the shard with the fewest rows so far (which left one large file and three small ones as
shards of very unequal size), else a hash of the id. ``split_rule`` in a shard's manifest says which.

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
ROWS = "rows"            # equal ranges of the input's rows (OUTs begun from stop 42 on)
FRAGMENTS = "fragments"  # whole files, else row groups, else a hash of the id (OUTs begun before)


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
    rule: str = ROWS

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


def split(files, shard: Shard, rule: str = ROWS) -> Selection:
    """Shard ``shard.k``'s part of the input: a pure function of the listing (names, row groups), N and the rule."""
    if rule == FRAGMENTS:
        return _by_fragments(files, shard)
    if rule != ROWS:
        raise ConfigError(f"This OUT's shards split the input by {rule!r}, a rule this version of overnight does "
                          f"not know. Finish the job with the version that began it, or choose another --out.")
    total = sum(f.num_rows for f in files)
    lo, hi = shard.k * total // shard.n, (shard.k + 1) * total // shard.n
    frags, at = [], 0
    for i, f in enumerate(files):
        if at >= hi:
            break
        if f.num_rows and lo <= at and at + f.num_rows <= hi:
            frags.append(Fragment(i, None, f.num_rows))
        elif f.num_rows and at + f.num_rows > lo:
            below = at
            for g, rows in enumerate(f.row_groups):
                a, b = max(lo, below), min(hi, below + rows)
                if a < b:
                    frags.append(Fragment(i, g, b - a, None if (a, b) == (below, below + rows)
                                          else (a - below, b - below)))
                below += rows
        at += f.num_rows
    files_read = len({fr.file_index for fr in frags})
    how = (f"the input's {total} rows in {shard.n} equal ranges; this one is rows {lo} to {hi - 1}, in "
           f"{files_read} file{'s' if files_read != 1 else ''}" if hi > lo else
           f"the input's {total} rows in {shard.n} equal ranges; this one is empty (more shards than rows)")
    return Selection(tuple(frags), how=how, rule=ROWS)


def _by_fragments(files, shard: Shard) -> Selection:
    """The rule of OUTs begun before stop 42: whole files, else row groups, else a hash of the id."""
    whole, groups = fragments_of(files)
    if len(whole) >= shard.n:
        frags, how = whole, f"{len(whole)} files"
    elif len(groups) >= shard.n:
        frags, how = groups, f"{len(groups)} row groups in {len(whole)} files"
    else:
        return Selection((), hash_of=shard, rule=FRAGMENTS,
                         how=f"the input has {len(groups)} row groups in {len(whole)} files, fewer than "
                             f"{shard.n} shards: split by a hash of the id")
    return Selection(tuple(assign(frags, shard.n)[shard.k]), how=f"split by {how}", rule=FRAGMENTS)


def rule_of(input_info: Optional[dict]) -> str:
    """The split rule a shard's manifest (its ``input``) records; one written before stop 42 records none."""
    return (input_info or {}).get("split_rule") or FRAGMENTS


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
