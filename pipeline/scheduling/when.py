"""When a job must stop, from what its user gave: a time budget (``--time-budget 90m``) or a deadline as an ISO time
(``--deadline 2026-11-23T06:00``). Each parser names the option's bad value and the forms it takes."""

from __future__ import annotations

import datetime as dt
import re

from overnight.pipeline.config import ConfigError


def parse_budget(text: str, what: str = "--time-budget") -> float:
    """'90m', '1h30m', '45s', '2h', or plain seconds -> seconds; what: the flag or key it was given as."""
    t = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", t):
        return float(t)
    m = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m(?:in)?)?\s*(?:(\d+(?:\.\d+)?)s)?", t)
    if not t or not m or not any(m.groups()):
        raise ConfigError(f"{what} {text!r} is not a duration; use e.g. 90m, 1h30m, 45s or 3600.")
    h, mnt, s = (float(g) if g else 0.0 for g in m.groups())
    return h * 3600 + mnt * 60 + s


def parse_deadline(text: str, now: float) -> float:
    """An ISO time (local when it has no offset) -> seconds since the epoch; must be in the future."""
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigError(f"--deadline (scheduler.deadline) {text!r} is not an ISO time; use e.g. "
                          f"2026-11-23T06:00 (local time) or 2026-11-23T06:00+01:00.") from None
    at = when.timestamp()
    if at <= now:
        shown = dt.datetime.fromtimestamp(now).isoformat(timespec="seconds")
        raise ConfigError(f"--deadline (scheduler.deadline) {text} is in the past (it is now {shown}). Give a "
                          f"later time, or a --time-budget such as 90m.")
    return at
