"""The record types that cross stage boundaries: a Row goes into the scheduler, a Result comes out."""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass
from typing import Any, Optional

# Phrases of error rows that `overnight export --format openai` tells apart (pipeline/tools/export.py): a row
# whose own deadline passed (written as OpenAI's batch_expired), the engine's own internal error (an HTTP 500), a
# prompt too long for the context (OpenAI's context_length_exceeded); every other error row is a bad request (400).
DEADLINE_PASSED = "passed before the row could start"
ENGINE_INTERNAL_ERROR = "the engine ended the request with an internal error"
NO_ROOM_FOR_OUTPUT = "which leaves no room for output within max_model_len"


@dataclass(slots=True)
class Row:
    """One valid input row, tokenized and ready for the engine."""

    # The row's id as it appears in the output (input id value, or "<file>#<row>").
    id: Any
    # Prompt after the chat template, as token ids.
    prompt_token_ids: list[int]
    # Sampling parameters for this row (defaults merged with per-row columns).
    sampling: dict
    # Input columns copied to the output.
    passthrough: dict
    # Where the row came from, for messages: "<file>#<row>".
    origin: str
    # Predicted output tokens and its bucket (filled by buckets/; None when no predictor ran).
    predicted_tokens: Optional[int] = None
    bucket: Optional[int] = None
    # The prediction at admission in the forecast's currency (Scheduler.forecast_scale): what the deadline
    # tracker learns from and forecasts with.
    forecast_tokens: Optional[float] = None
    # Admitted as a row drawn at random where rows run by predicted length (Scheduler.sample_every): the draw's number,
    # from 1 (0: not drawn).
    drawn: int = 0
    # Per-row `priority` column: lower runs sooner, as in vLLM's priority scheduling.
    priority: int = 0
    # Per-row `value` column: what completing the row is worth (auto's deadline mode maximises value per token).
    value: float = 1.0
    # Per-row `deadline` column, as seconds since the epoch.
    deadline_at: Optional[float] = None
    # Prediction features, kept so the online predictor can refresh the prediction and learn from the result.
    features: Any = None
    prompt_hash: str = ""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling["max_tokens"]


@dataclass(slots=True)
class Sample:
    """One of a request's completions (vLLM's CompletionOutput), kept when a row asks for n > 1 or logprobs."""

    # 0 .. n-1: the output row's sample_index.
    index: int
    text: str
    finish_reason: Optional[str]
    num_output_tokens: int
    # Per generated token, when logprobs were asked for: {"token_id", "token", "logprob", "top_logprobs": [{"token_id",
    # "token", "logprob"}, ...]} (the K most likely, best first), the shape of the output's logprobs column.
    logprobs: Optional[list] = None


@dataclass(slots=True)
class Finished:
    """What the engine reports for one finished request."""

    request_id: str
    # The first completion's text and finish reason.
    text: str
    # "stop" (EOS or a stop string), "length" (max_tokens or the context) or "abort".
    finish_reason: Optional[str]
    num_prompt_tokens: int
    # Tokens generated for the request: every completion's.
    num_output_tokens: int
    # Wall-clock seconds since the epoch; first_token_at is None when the engine does not report it.
    first_token_at: Optional[float]
    finished_at: float
    # Every completion, when the row asked for n > 1 or logprobs; None otherwise (text above is all there is).
    samples: Optional[list[Sample]] = None


@dataclass(slots=True)
class Result:
    """One output row, ok or error."""

    id: Any
    passthrough: dict
    status: str  # "ok" | "error"
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    prompt_tokens: Optional[int] = None
    output_tokens: Optional[int] = None
    predicted_tokens: Optional[int] = None
    bucket: Optional[int] = None
    queued_at: Optional[float] = None
    first_token_at: Optional[float] = None
    finished_at: Optional[float] = None
    error: Optional[str] = None
    prompt_hash: Optional[str] = None
    # The row's share of the engine's time: each step it ran in, divided by the rows in that step.
    engine_seconds: Optional[float] = None
    # The row's completions when it asked for n > 1 or logprobs: the writer makes one output row of each.
    samples: Optional[list[Sample]] = None
    # The LoRA adapter that answered the row (its name, as registered with --lora): the output's model column.
    adapter: Optional[str] = None

    @classmethod
    def failed(cls, id: Any, passthrough: dict, error: str, at: Optional[float] = None) -> "Result":
        return cls(id=id, passthrough=passthrough, status="error", error=error, finished_at=at)

    @classmethod
    def expired(cls, row: Row) -> "Result":
        """A row whose own deadline passed before it could start: it is not run."""
        when = dt.datetime.fromtimestamp(row.deadline_at, dt.timezone.utc).isoformat(timespec="seconds")
        return cls.failed(row.id, row.passthrough, f"{row.origin}: its deadline {when} {DEADLINE_PASSED}",
                          time.time())

    @classmethod
    def from_engine(cls, row: Row, fin: Finished, queued_at: float,
                    engine_seconds: Optional[float] = None) -> "Result":
        return cls(
            id=row.id,
            passthrough=row.passthrough,
            status="ok",
            text=fin.text,
            finish_reason=fin.finish_reason,
            prompt_tokens=fin.num_prompt_tokens,
            output_tokens=fin.num_output_tokens,
            predicted_tokens=row.predicted_tokens,
            bucket=row.bucket,
            queued_at=queued_at,
            first_token_at=fin.first_token_at,
            finished_at=fin.finished_at,
            prompt_hash=row.prompt_hash,
            engine_seconds=engine_seconds,
            samples=fin.samples,
            adapter=row.sampling.get("lora"),
        )


RESULT_FIELDS = (
    "text", "finish_reason", "prompt_tokens", "output_tokens", "predicted_tokens", "bucket",
    "queued_at", "first_token_at", "finished_at", "status", "error", "prompt_hash", "engine_seconds", "run_id",
    "model",
)
# Output columns of jobs that ask for n > 1 or logprobs (job option or input column); absent otherwise.
SAMPLE_FIELDS = ("sample_index", "logprobs")

