"""What a job tells the operator: the status file's snapshot and the closing summary."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Optional

from overnight.pipeline.progress import fmt_duration

EXIT_OK = 0
EXIT_FAILED = 1
# sysexits EX_UNAVAILABLE: the engine failed to start or died mid-run; finished rows are saved.
EXIT_ENGINE = 69
# sysexits EX_TEMPFAIL: stopped early (deadline, signal); rerun the same command to continue.
EXIT_PARTIAL = 75


@dataclass
class Summary:
    run_id: str
    out: str
    state: str
    exit_code: int
    num_rows: int
    num_done: int
    num_ok: int
    num_error: int
    num_resumed: int
    num_duplicates: int
    num_output_tokens: int
    elapsed_s: float
    output_tokens_per_s: float
    message: Optional[str] = None
    extra: dict = field(default_factory=dict)

    def line(self) -> str:
        head = {"completed": "done", "partial": "stopped early (resumable)", "interrupted": "interrupted (resumable)",
                "failed": "FAILED"}.get(self.state, self.state)
        resumed = f", {self.num_resumed} already done" if self.num_resumed else ""
        dup = f", {self.num_duplicates} duplicate ids skipped" if self.num_duplicates else ""
        tail = f"; {self.message}" if self.message and (self.state in ("partial", "interrupted") or
                                                       not self.num_rows) else ""
        return (f"overnight: {head}: {self.num_done}/{self.num_rows} rows ({self.num_ok} ok, {self.num_error} error"
                f"{resumed}{dup}), {self.num_output_tokens} output tokens in {fmt_duration(self.elapsed_s)} "
                f"({self.output_tokens_per_s:.0f} tok/s) -> {self.out}{tail}")


def iso(t: Optional[float]) -> Optional[str]:
    if t is None:
        return None
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="seconds")


def forecast_dict(f, deadline: Optional[float], mode: str) -> dict:
    if f is None:
        return {"deadline": iso(deadline), "mode": mode}
    return {
        "deadline": iso(deadline),
        "mode": mode,
        "tokens_per_s": round(f.tokens_per_s, 2),
        "remaining_tokens_predicted": round(f.remaining_tokens),
        "eta_s": None if f.eta_s is None else round(f.eta_s, 1),
        "time_left_s": None if f.time_left_s == float("inf") else round(f.time_left_s, 1),
        "will_miss": f.will_miss,
        "rows_expected_left": f.rows_expected_left,
    }
