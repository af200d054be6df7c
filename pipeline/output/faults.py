"""Failpoints: named places where fault-injection tests make the job crash or fail on purpose.

Inert unless OVERNIGHT_FAILPOINTS is set, e.g.

    OVERNIGHT_FAILPOINTS="part.after_write=kill@3,storage.write=oserror@1-2"

``name=kill@N`` SIGKILLs the process the N-th time the point is reached;
``name=oserror@A-B`` raises OSError on hits A through B (a transient storage
fault); ``@N`` alone is hit N only. The points cover every step where a crash
could leave output inconsistent: reading, a part written but not yet counted,
a manifest half-written, a status update.
"""

from __future__ import annotations

import errno
import os
import signal

_ENV = "OVERNIGHT_FAILPOINTS"
_hits: dict[str, int] = {}
_spec: dict[str, tuple[str, int, int]] | None = None


def _parse() -> dict[str, tuple[str, int, int]]:
    spec = {}
    for item in filter(None, (x.strip() for x in os.environ.get(_ENV, "").split(","))):
        name, _, action = item.partition("=")
        kind, _, when = action.partition("@")
        lo, _, hi = (when or "1").partition("-")
        spec[name] = (kind, int(lo), int(hi or lo))
    return spec


def failpoint(name: str) -> None:
    global _spec
    if _spec is None:
        _spec = _parse()
    if not _spec or name not in _spec:
        return
    _hits[name] = n = _hits.get(name, 0) + 1
    kind, lo, hi = _spec[name]
    if lo <= n <= hi:
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "oserror":
            raise OSError(errno.EIO, f"injected I/O error at {name} (hit {n})")


def reset() -> None:
    """Re-read OVERNIGHT_FAILPOINTS (tests that change it in-process)."""
    global _spec
    _spec = None
    _hits.clear()
