"""When a job must stop, from what its user gave: a time budget (``--time-budget 90m``) or a deadline as an ISO time
(``--deadline 2026-11-23T06:00``). Each parser names the option's bad value and the forms it takes."""

from __future__ import annotations

import datetime as dt
import re
from typing import Optional

from overnight.pipeline.config import ConfigError
from overnight.pipeline.progress import fmt_duration


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


def short_budget_warning(last_startup: Optional[dict], time_left: float) -> Optional[str]:
    """Before the engine starts: the time left is shorter than the engine took to start last time (the start-up
    a --time-budget includes), so this attempt will likely end before its first row, as the last one may have."""
    took = (last_startup or {}).get("engine_ready_s")
    if took is None or time_left == float("inf") or time_left >= took:
        return None
    return (f"{fmt_duration(time_left)} are left before the stop, and the engine took {fmt_duration(took)} to start in the last "
            f"attempt: this one will likely stop before its first row. Give a --time-budget (or --deadline) longer "
            f"than the engine's start-up")


def no_row_started(startup: dict, stopping: Optional[str]) -> str:
    """What a stop at the deadline before any row went to the engine adds to its message."""
    if not (stopping or "").startswith("deadline") or startup.get("first_row_s") is not None:
        return ""
    took = startup.get("engine_ready_s")
    if took is None:  # the job's opening (its input, tokenizer, OUT's scan or lock) took the time
        return " (the time went before the engine could start: give a longer --time-budget or a later --deadline)"
    return (f" (the engine took {fmt_duration(took)} to start, and no row started before the stop: a rerun with the "
            f"same budget will do the same; give a --time-budget (or --deadline) longer than the engine's start-up)")
