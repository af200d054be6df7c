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


def from_iso(text: str) -> dt.datetime:
    """datetime.fromisoformat, with a trailing Z for UTC also before Python 3.11 (which reads it only since)."""
    text = text.strip()
    return dt.datetime.fromisoformat(text[:-1] + "+00:00" if text[-1:] in ("Z", "z") and ":" in text else text)


def parse_deadline(text: str, now: float) -> float:
    """An ISO time (local when it has no offset) -> seconds since the epoch; must be in the future."""
    try:
        when = from_iso(text)
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
    """Before the engine starts: less time is left than the engine took to start in the last attempt, so this one
    will likely stop before its first row, as the last one may have."""
    took = (last_startup or {}).get("engine_start_s")  # (an attempt before stop 46 did not record it)
    if took is None or time_left == float("inf") or time_left >= took:
        return None
    return (f"{fmt_duration(time_left)} are left before the stop, and the engine took {fmt_duration(took)} to start "
            f"in the last attempt: this one will likely stop before its first row. Give a --time-budget (or "
            f"--deadline) longer than the job's opening and the engine's start-up")


def no_row_started(tally, stopping: Optional[str], ready_after_stop: bool) -> str:
    """What a stop at the deadline before any row went to the engine adds to its message: what took the time."""
    if not (stopping or "").startswith("deadline") or tally.first_admitted_at is not None:
        return ""
    longer = "give a longer --time-budget or a later --deadline"
    if tally.engine_ready_at is None:  # the job's opening (its input, tokenizer, OUT's scan or lock) took the time
        return f" (the time went before the engine could start: {longer})"
    if ready_after_stop:
        return (f" (the engine took {fmt_duration(tally.engine_start_s or 0.0)} to start, and the stop came before "
                f"it was ready: a rerun with the same budget will do the same; {longer}, past the job's opening "
                f"and the engine's start-up)")
    return f" (the engine was ready, but no row reached it before the stop: {longer})"


RERUN = "rerun the same command to continue"


def not_done_message(reason: str, left: int, why: str = "") -> str:
    """The message of a job that stopped short (exit 75)."""
    return f"{reason}: {left} rows not done; {RERUN}{why}"


def workers_stop_message(stop: Optional[str], said: list, left: int) -> str:
    """A Ray job stopped short: the driver's reason, else the first worker's (said: each worker's message, None for
    one that completed); and, at a deadline, what the first said took the time, where no worker's rows reached
    the engine."""
    reason = stop or next((m.split(":")[0] for m in said if m), "stopped")
    whys = [(m or "").partition(RERUN)[2] for m in said]  # (a worker that completed has no message)
    return not_done_message(reason, left, whys[0] if "deadline" in reason and whys and all(whys) else "")
