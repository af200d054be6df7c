"""Make vLLM's processes die with the job, however the job dies.

vLLM's engine-core and worker processes outlive a parent that is SIGKILLed
(an OOM kill, `kill -9`, a container stopped hard): they keep the model and
the KV cache in memory, on a GPU too, and the rerun's engine then finds no
room. So the job starts a small reaper process and tells it, over a pipe, the
pids of the engine's processes. When the pipe closes (the job exited, however
it exited), the reaper terminates whichever of those processes are still
alive, and exits. After a clean shutdown there is nothing left to kill.

    python -m overnight.pipeline.engine.reaper     # reads pids from stdin, one per line
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def _is_engine(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"VLLM" in f.read() or _comm(pid).startswith("VLLM")
    except OSError:
        return False


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def reap(pids: list[int], grace: float = 3.0) -> list[int]:
    """SIGTERM the engine processes still alive, then SIGKILL what is left after `grace` seconds."""
    targets = [p for p in pids if _alive(p) and _is_engine(p)]
    for p in targets:
        try:
            os.kill(p, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p) for p in targets):
        time.sleep(0.1)
    for p in targets:
        if _alive(p):
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
    return targets


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the job's to handle; the pipe tells us when it ends
    pids: list[int] = []
    for line in sys.stdin:
        line = line.strip()
        if line.isdigit():
            pids.append(int(line))
    reap(pids)


def engine_child_pids() -> list[int]:
    """Pids of vLLM's processes (engine core, workers) below this process."""
    try:
        import psutil

        children = psutil.Process().children(recursive=True)
    except Exception:
        return []
    return [c.pid for c in children if _is_engine(c.pid)]


def is_running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        import psutil

        p = psutil.Process(pid)
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except Exception:
        return False


class Reaper:
    """The job's side: start the reaper, report engine processes to it."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "overnight.pipeline.engine.reaper"], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                     text=True)
        self.reported: set[int] = set()

    def watch_children(self) -> None:
        """Report every engine process below this one (call after the engine starts or restarts)."""
        new = [p for p in engine_child_pids() if p not in self.reported and p != self.proc.pid]
        if new and self.proc.poll() is None:
            self.proc.stdin.write("".join(f"{p}\n" for p in new))
            self.proc.stdin.flush()
            self.reported.update(new)


_REAPER: Reaper | None = None


def watch_engine_processes() -> None:
    """Start the reaper once per process, and report the engine processes running now."""
    global _REAPER
    if _REAPER is None:
        _REAPER = Reaper()
    _REAPER.watch_children()


if __name__ == "__main__":
    main()
