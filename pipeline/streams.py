"""Clean streams: stdout carries only what overnight means to print; everything else goes to stderr, quiet.

vLLM logs to stdout by default, and its engine process, torch, Triton and tqdm print straight to the file
descriptors. So a command that runs an engine first takes a private copy of stdout for its own summary (or
--json document), then points file descriptor 1 at stderr: whatever a library or a child process prints
lands on stderr, and stdout stays parseable (`overnight run ... --json | jq .state`).

Unless -v, the libraries are told to keep to errors: vLLM's log level, torch's C++ log level, transformers'
verbosity, Python warnings (also in the engine's processes, through PYTHONWARNINGS), and vLLM's progress
bars. -v shows all of it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import threading
import warnings
from typing import Iterator, TextIO

QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONWARNINGS": "ignore",
    "RAY_DEDUP_LOGS": "1",
}


# Lines that the engine's processes print straight to their file descriptors and that tell an operator
# nothing (each was seen on a plain run); dropped unless -v. Anything else, errors above all, passes.
NOISE = re.compile("|".join([
    r"Triton is installed, but doesn't include CPU backend",
    r"Triton is not installed",
    r"libtcmalloc is not found",
    r"Passing raw prompts to InputProcessor is deprecated",
    r"Loading safetensors checkpoint shards",
    r"NUMA binding",
    r"\bFutureWarning\b|\bDeprecationWarning\b|\bUserWarning\b",
    r"^\s*(warnings\.warn|if hasattr\(value|wrapper = lookup)",
    r"force.?kill|forcefully kill|Engine core proc .* did not terminate",
    r"This model does not officially support disabling chunked prefill",
    r"Enforce eager set|Inductor compilation was disabled|Reset SSM cache type",
    r"^\s*$",
]), re.IGNORECASE)


def quiet_libraries(verbose: bool) -> None:
    """Send vLLM's logs to stderr always; unless verbose, keep the libraries to their errors."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        return
    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)
    # vLLM's loggers warn before vLLM configures its logging (Python's last-resort handler prints them).
    logging.getLogger("vllm").addHandler(logging.NullHandler())
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)


@contextlib.contextmanager
def reserved_stdout() -> Iterator[TextIO]:
    """A private stdout for overnight's own output, while file descriptor 1 points at stderr."""
    try:
        real = sys.stdout.fileno() == 1
    except (AttributeError, OSError, ValueError):  # a test runner's buffer, a notebook: nothing to protect
        real = False
    if not real:
        yield sys.stdout
        return
    sys.stdout.flush()
    saved = os.dup(1)
    out = os.fdopen(os.dup(saved), "w", buffering=1)
    os.dup2(2, 1)
    try:
        yield out
    finally:
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        os.dup2(saved, 1)
        os.close(saved)
        out.flush()
        out.close()


JOIN_S = 0.25  # seconds the reader gets to pass on what is left in the pipe when the command ends


@contextlib.contextmanager
def filtered_stderr(verbose: bool, as_json: bool = False) -> Iterator[None]:
    """Point file descriptor 2 (what the engine's processes inherit) at a pipe whose lines are passed on to the
    real stderr without the known NOISE (unless verbose), each as a JSON object with ``as_json`` (--log-format
    json: a log shipper's every line, the engine's too); overnight's own log lines and progress bar write to the
    real stderr directly (``sys.stderr``)."""
    try:
        real = sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):
        real = False
    if (verbose and not as_json) or not real:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    r, w = os.pipe()
    os.dup2(w, 2)
    os.close(w)
    previous = sys.stderr
    sys.stderr = os.fdopen(os.dup(saved), "w", buffering=1)
    if as_json:  # what this process prints that is not a log line of overnight's own (vLLM's logger, a print)
        sys.stderr = _JsonLines(sys.stderr)
    thread = threading.Thread(target=_pass_on, args=(r, saved, not verbose, as_json), name="overnight-stderr",
                              daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes our end of the pipe; the reader ends once the engine's processes are gone
        # A crashed engine's last lines are already in the pipe. A live engine keeps the pipe open until the
        # command's end shuts it down (jobs/cli.py main()); the reader, a daemon, passes its lines on meanwhile.
        # Waiting here for that cost 2 s at every finished job's exit.
        thread.join(timeout=JOIN_S)
        # flushed, not closed: vLLM's logger holds it (VLLM_LOGGING_STREAM) and logs as the engine shuts down
        # after this ("ValueError: I/O operation on closed file" under -v)
        sys.stderr.flush()
        sys.stderr = previous


def _pass_on(r: int, out: int, quiet: bool = True, as_json: bool = False) -> None:
    pending = b""
    with os.fdopen(r, "rb", buffering=0) as pipe:
        while True:
            chunk = pipe.read(65536)
            if not chunk:
                break
            pending += chunk
            *lines, pending = re.split(rb"(?<=[\n\r])", pending)
            _write(out, lines, quiet, as_json)
    _write(out, [pending] if pending else [], quiet, as_json)


_LEVEL = re.compile(r"\b(ERROR|CRITICAL|WARNING|DEBUG)\b|Traceback|Error:")


def _as_json(line: str) -> bytes:
    """A line another process wrote, as a JSON object as overnight's own log lines are (level from its words); a
    line that is a JSON object already (a process that logs JSON itself) as it is."""
    import datetime as dt
    import json

    if line.startswith("{") and line.endswith("}"):
        try:
            if isinstance(json.loads(line), dict):
                return (line + "\n").encode()
        except (ValueError, RecursionError):
            pass
    found = _LEVEL.search(line)
    word = found.group(1) if found and found.group(1) else ("ERROR" if found else "INFO")
    level = {"CRITICAL": "critical", "ERROR": "error", "WARNING": "warning", "DEBUG": "debug"}.get(word, "info")
    return (json.dumps({"time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds"),
                        "level": level, "logger": "engine", "message": line}) + "\n").encode()


class _JsonLines(io.TextIOBase):
    """A text stream that writes each line as it is where it is a JSON object already (overnight's own log
    lines), and as one (``_as_json``) where it is not."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.pending = ""

    @property
    def encoding(self) -> str:
        return self.stream.encoding

    @property
    def errors(self) -> str:
        return self.stream.errors

    def write(self, text: str) -> int:
        *lines, self.pending = re.split(r"[\r\n]", self.pending + text)  # (a bar's redraw ends with \r)
        for line in lines:
            self._line(line)
        return len(text)

    def _line(self, line: str) -> None:
        if line.startswith("{"):
            self.stream.write(line + "\n")
        elif line.strip():
            self.stream.write(_as_json(line.strip()).decode())

    def flush(self) -> None:
        if self.pending:  # a line without its end yet (a progress bar's): one object too
            self._line(self.pending)
            self.pending = ""
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return False


def _write(out: int, lines: list, quiet: bool = True, as_json: bool = False) -> None:
    kept = [ln for ln in lines if not (quiet and NOISE.search(ln.decode("utf-8", "replace")))]
    if as_json:
        kept = [_as_json(text) for text in (ln.decode("utf-8", "replace").strip() for ln in kept) if text]
    if kept:
        try:
            os.write(out, b"".join(kept))
        except OSError:
            pass
