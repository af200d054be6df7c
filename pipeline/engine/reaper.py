"""Make vLLM's processes die with the job, however the job dies.

vLLM's engine-core and worker processes outlive a parent that is SIGKILLed
(an OOM kill, `kill -9`, a container stopped hard): they keep the model and
the KV cache in memory, on a GPU too, and the rerun's engine then finds no
room. So the job starts a small reaper process and tells it, over a pipe, the
pids of the engine's processes. When the pipe closes (the job exited, however
it exited), the reaper terminates whichever of those processes are still
alive, and exits. After a clean shutdown there is nothing left to kill.

The pipe closing is not the only sign: a process forked from the job (vLLM's
`fork` start method, an engine restarted in-process) inherits the pipe's write
end and keeps it open after the job is gone, so the reaper also stops waiting
when its parent, the job, has changed. Each pid comes with its start time, so a
pid the kernel has handed to another process since is never signalled, and the
processes the engine started below a reported one (workers) are found at reap
time, before anything is signalled.

    python -m overnight.pipeline.engine.reaper JOB_PID   # reads "pid start_time" lines from stdin
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
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


def _running(proc) -> bool:
    """Alive and not a zombie (a zombie has exited; only its parent's wait() is missing)."""
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _parse(data: bytes) -> list[tuple[int, float | None]]:
    """"pid start_time" lines (a bare pid is accepted too)."""
    out = []
    for line in data.decode(errors="replace").splitlines():
        fields = line.split()
        if fields and fields[0].isdigit():
            started = None
            if len(fields) > 1:
                try:
                    started = float(fields[1])
                except ValueError:
                    pass
            out.append((int(fields[0]), started))
    return out


def _targets(entries: list[tuple[int, float | None]]) -> list:
    """The reported processes that are still the ones reported, and every process below them."""
    import psutil

    found: dict[int, "psutil.Process"] = {}
    for pid, started in entries:
        try:
            p = psutil.Process(pid)
            if started is not None:
                if abs(p.create_time() - started) > 0.01:
                    continue  # the pid was reused by another process
            elif not _is_engine(pid):
                continue
        except psutil.Error:
            continue
        found.setdefault(pid, p)
        try:
            # Collected now, while the tree is whole: once an engine core dies its workers go to init.
            for c in p.children(recursive=True):
                if not _is_resource_tracker(c):
                    found.setdefault(c.pid, c)
        except psutil.Error:
            pass
    return [p for p in found.values() if _running(p)]


def _is_resource_tracker(proc) -> bool:
    # multiprocessing's resource tracker ignores SIGTERM and exits by itself once the processes that use
    # it are gone, unlinking the shared memory they left; a SIGKILL would leave that memory behind.
    try:
        return "multiprocessing.resource_tracker" in " ".join(proc.cmdline())
    except Exception:
        return False


def reap(entries: list[tuple[int, float | None]], grace: float = 3.0) -> list[int]:
    """SIGTERM the engine processes still running, then SIGKILL what is left after `grace` seconds."""
    import psutil

    targets = _targets(entries)
    for p in targets:
        try:
            p.terminate()  # psutil checks the pid still names the same process before it signals
        except psutil.Error:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_running(p) for p in targets):
        time.sleep(0.1)
    for p in targets:
        if _running(p):
            try:
                p.kill()
            except psutil.Error:
                pass
    return [p.pid for p in targets]


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the job's to handle; the pipe tells us when it ends
    job = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else os.getppid()
    fd = sys.stdin.fileno()
    data = b""
    while True:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break  # the pipe closed: the job exited, however it exited
            data += chunk
        elif os.getppid() != job:
            break  # the job is gone, but a process forked from it still holds the pipe open
    reap(_parse(data))


def engine_child_pids() -> list[int]:
    """Pids of vLLM's running processes (engine core, workers) below this process; zombies left out."""
    return [p.pid for p in _engine_children()]


def _engine_children() -> list:
    try:
        import psutil

        children = psutil.Process().children(recursive=True)
    except Exception:
        return []
    return [c for c in children if _is_engine(c.pid) and _running(c)]


def own_engine_pids() -> set[int]:
    """This process's own children that are vLLM processes, exited (zombies) or not."""
    try:
        import psutil

        return {c.pid for c in psutil.Process().children() if _is_engine(c.pid)}
    except Exception:
        return set()


def is_running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        import psutil

        return _running(psutil.Process(pid))
    except Exception:
        return False


class Reaper:
    """The job's side: start the reaper, report engine processes to it.

    It is started before the engine, and while an engine starts (``engine_starting``) a thread reports what is
    new below this process every `interval` seconds, so an engine killed with the job while it loads and a
    process that takes its VLLM title after it was first seen are reported too. Between starts the thread
    sleeps: scanning the process table costs the engine loop's GIL a millisecond or more each time.
    """

    def __init__(self, interval: float = 1.0):
        self.proc = subprocess.Popen([sys.executable, "-m", "overnight.pipeline.engine.reaper", str(os.getpid())],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True, text=True)
        self.reported: set[tuple[int, float]] = set()
        self._lock = threading.Lock()
        self._interval = interval
        self.starting = threading.Event()
        threading.Thread(target=self._watch, name="overnight-reaper-reports", daemon=True).start()

    def _watch(self) -> None:
        while self.proc.poll() is None:
            self.starting.wait()
            time.sleep(self._interval)
            try:
                self.watch_children()
            except Exception:  # pragma: no cover - best effort, the next round tries again
                pass

    def watch_children(self) -> None:
        """Report every engine process below this one not reported yet."""
        with self._lock:
            new = []
            for c in _engine_children():
                if c.pid == self.proc.pid:
                    continue
                try:
                    key = (c.pid, c.create_time())
                except Exception:
                    continue
                if key not in self.reported:
                    new.append(key)
            if new and self.proc.poll() is None:
                try:
                    self.proc.stdin.write("".join(f"{pid} {started!r}\n" for pid, started in new))
                    self.proc.stdin.flush()
                except OSError:
                    return
                self.reported.update(new)


_REAPER: Reaper | None = None


@contextlib.contextmanager
def engine_starting():
    """Around an engine's start: the reaper runs (started once per process) and reports each engine process as
    it appears, then every one running once the engine is up."""
    global _REAPER
    if _REAPER is None:
        _REAPER = Reaper()
    _REAPER.starting.set()
    try:
        yield
    finally:
        _REAPER.starting.clear()
        _REAPER.watch_children()


if __name__ == "__main__":
    main()
