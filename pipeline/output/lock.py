"""One run at a time per output folder: OUT/.overnight.lock names the holder and carries a heartbeat.

A second run on the same OUT refuses, naming the first (host, pid, start
time). A lock left by a run that died is stale, and taken over: on the same
host at once when its process is gone (its pid not running, or reused by a
process started after the lock), anywhere when its heartbeat is older than
STALE_S. "The same host" is the same host name, boot and pid namespace:
containers that share a host name (host networking) each have pids of their
own, so another container's lock is watched as another host's is. A lock of
this very process is a live one while a job here holds it (two jobs in one
process, on threads), and stale otherwise. A lock from another host whose
heartbeat is recent is watched: a heartbeat that moves is a live run (refused
within HEARTBEAT_S or so), one that stays still until it is STALE_S old is a
run that died a moment ago (a Kubernetes pod killed, retried on another
node), and is taken over. Taking
over writes our own lock, waits SETTLE_S, and reads it back: of two runs
racing for a stale lock (two retried pods whose watches end together), the one
that wrote last wins and the other refuses. A racer reads the lock a moment
before it writes, so the wait is far longer than the window in which the other
can still write over it. A new lock on a local disk is created exclusively and
whole (a hard link to a file already written), so no run reads it half-written;
on object storage every write is followed by the wait.

A thread refreshes the heartbeat every HEARTBEAT_S while the lock is held, so
an engine that takes minutes to start, or to restart, keeps it. A heartbeat
reads the lock back first: if another run has taken it over, this run stops
refreshing it and says so (``lost``) rather than write over the other's. The
run then stops: ``confirm`` is asked before each part is written, and a run
that lost its folder writes no more parts, manifest or status there (its part
numbers would collide with the other run's).
"""

from __future__ import annotations

import datetime as dt
import errno
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from typing import Optional

from overnight.pipeline.output.checkpoint import OutputDir, OutputError
from overnight.pipeline.output.storage import StorageError, is_local, read_text, write_atomic

log = logging.getLogger("overnight")

LOCK = ".overnight.lock"
# A lock whose heartbeat is older than this belongs to a run that is gone.
STALE_S = 120.0
HEARTBEAT_S = 30.0
WATCH_S = 5.0  # how often a lock from another host is read again while it is watched
SETTLE_S = 2.0  # after a write that another run may race (a takeover; object storage), before it is read back


class LockError(OutputError):
    "Another run holds the output folder."


_HELD: set[str] = set()  # the tokens of the locks this process holds now


def _namespace() -> Optional[str]:
    """What makes a pid on "this host" mean this process table: the boot and the pid namespace (Linux). Containers
    may share a host name (host networking) while each has its own pids; a pid from another is not ours to ask
    about. None where there is no /proc (another OS: one process table per host)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def _holder_alive(pid: int, started_at: Optional[str]) -> bool:
    """Whether the process that wrote a lock on this host still runs: its pid is alive and was not reused by a
    process started after the lock was."""
    import psutil

    try:
        created = psutil.Process(pid).create_time()
    except (psutil.Error, ValueError, OverflowError):
        return False
    try:
        started = dt.datetime.fromisoformat(started_at).timestamp() if started_at else None
    except ValueError:
        started = None
    return started is None or created <= started + 1.0  # the lock's start is rounded to the second


class RunLock:
    def __init__(self, out: OutputDir, run_id: str = "", clock=time.time, sleep=time.sleep,
                 split: Optional[str] = None):
        self.out = out
        self.path = out.path(LOCK)
        self.clock = clock
        self.sleep = sleep
        self.token = uuid.uuid4().hex
        self.info = {"host": socket.gethostname(), "ns": _namespace(), "pid": os.getpid(), "run_id": run_id,
                     "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                     "token": self.token}
        if split:  # how the holder splits the job ("ray"): a shard run refuses an OUT a live Ray driver holds
            self.info["split"] = split
        self.last_beat = 0.0
        self.is_held = False
        self.lost = False  # another run took the lock over while this one held it
        self.lost_to = ""  # which run, for the message
        self._beat_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def holder(self) -> Optional[dict]:
        try:
            text = read_text(self.out.fs, self.path)
            if text is None:
                return None
            return json.loads(text)
        except StorageError as e:  # a folder where the lock belongs: an OSError, as the lock's callers expect
            raise OSError(errno.EISDIR, str(e)) from None
        except ValueError:  # (bytes that are not UTF-8 too)
            return {"corrupt": True, "heartbeat": 0}

    def _same_processes(self, other: dict) -> bool:
        """Whether the lock's pid is one of this process table's: the same host, and (where the lock says) the
        same boot and pid namespace. A lock written before the namespace was recorded goes by the host alone."""
        return other.get("host") == self.info["host"] and other.get("ns", self.info["ns"]) == self.info["ns"]

    def is_stale(self, other: dict) -> bool:
        if other.get("corrupt"):
            return True
        if self._same_processes(other):
            if other.get("pid") == os.getpid():
                # this very process: a job that holds it now (another thread's), or one that ended without
                # releasing it (an earlier job in a notebook, a test)
                return other.get("token") not in _HELD
            if not _holder_alive(int(other.get("pid", -1)), other.get("started_at")):
                return True
        # (another container's pid, on a host of the same name, is not ours to ask about: its heartbeat decides)
        return self.clock() - float(other.get("heartbeat", 0)) > STALE_S

    def _in_use(self, other: dict) -> LockError:
        return LockError(
            f"{self.out.url} is in use by another overnight run: host {other.get('host')}, pid "
            f"{other.get('pid')}, started {other.get('started_at')} ({other.get('run_id') or 'run'}). "
            f"Wait for it to finish, or stop it; if that process is gone, its lock is taken over once its "
            f"heartbeat is {STALE_S:.0f} s old.")

    def _watch(self, other: dict) -> Optional[dict]:
        """A recent lock from another host: a live run's heartbeat moves (refused), a dead one's stays still
        until it is stale (returned, to be taken over). None: it was released meanwhile."""
        if self._same_processes(other):
            raise self._in_use(other)  # its process runs here: no need to watch
        start = self.clock()
        # stale by its own timestamp, or still for STALE_S as this run sees it (the hosts' clocks may differ);
        # watched at least a heartbeat's interval and two reads, so that a live run is seen to beat however far
        # ahead this host's clock is
        age = start - float(other.get("heartbeat", 0))
        until = start + min(STALE_S, max(HEARTBEAT_S + 2 * WATCH_S, STALE_S - age))
        log.warning("%s is locked by host %s, pid %s (heartbeat %.0f s ago): watching it for up to %.0f s; a "
                    "live run refreshes it, a run that died does not and its lock is then taken over",
                    self.out.url, other.get("host"), other.get("pid"), start - float(other.get("heartbeat", 0)),
                    until - start)
        while True:
            self.sleep(max(0.1, min(WATCH_S, until - self.clock() + 0.1)))
            try:
                now = self.holder()
            except OSError as e:  # a storage blip: read it again at the next look, while the watch lasts
                if self.clock() > until:
                    raise LockError(f"Cannot read the lock {self.out.url}/{LOCK} ({e}); check that the output "
                                    f"folder is readable, and rerun.") from None
                log.debug("could not read the lock on %s: %s", self.out.url, e)
                continue
            if now is None:
                return None
            if now.get("corrupt"):
                return now  # stale, as acquire takes a corrupt lock
            if (now.get("token"), now.get("heartbeat")) != (other.get("token"), other.get("heartbeat")):
                raise self._in_use(now)
            if self.clock() > until:
                return now

    def acquire(self) -> None:
        try:
            self._acquire()
        except OSError as e:  # OUT cannot be made or read: under a file, on a read-only mount, no permission
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise LockError(f"Cannot write the lock {self.out.url}/{LOCK}: {e.strerror}. Free space there, "
                                f"or choose another --out.") from None
            raise LockError(f"Output folder {self.out.url} cannot be used ({type(e).__name__}: "
                            f"{getattr(e, 'strerror', None) or e}); give an --out that is a folder, or where one "
                            f"can be made, and that this run may write.") from None

    def name_run(self, run_id: str) -> None:
        """The run's id, known once the job's manifest is read or made: written into the lock at the next
        confirm() (before the manifest's write), so that a run refused meanwhile names the holder's run."""
        self.info["run_id"] = run_id
        self.last_beat = -math.inf

    def _acquire(self) -> None:
        other = self.holder()
        if other is not None and not self.is_stale(other):
            other = self._watch(other)
        if other is not None:
            log.warning("taking over a stale lock on %s (host %s, pid %s, started %s)", self.out.url,
                        other.get("host"), other.get("pid"), other.get("started_at"))
        exclusive = other is None and is_local(self.out.fs)
        self._write(exclusive=exclusive)
        try:
            if not exclusive:  # another run may be writing its own lock over ours just now: the last writer wins
                self.sleep(SETTLE_S)
            mine = self.holder()
        except (OSError, KeyboardInterrupt) as e:  # ours is left there, and would be watched as a live run's
            self._remove_if_ours()
            if isinstance(e, KeyboardInterrupt):
                raise
            raise LockError(f"Cannot read back the lock {self.out.url}/{LOCK} just written ({e}); check that the "
                            f"output folder is readable, and rerun.") from None
        if not mine or mine.get("token") != self.token:
            raise LockError(f"{self.out.url} was just locked by another run (host {mine and mine.get('host')}, pid "
                            f"{mine and mine.get('pid')}). Only one run may write to an output folder.")
        _HELD.add(self.token)
        self.is_held = True
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat_until_released, name="overnight-lock", daemon=True)
        self._thread.start()

    def _beat_until_released(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self.heartbeat()

    def _write(self, exclusive: bool) -> None:
        info = dict(self.info, heartbeat=self.clock())
        data = json.dumps(info).encode()
        fs = self.out.fs
        fs.makedirs(self.out.root, exist_ok=True)
        if exclusive and is_local(fs):
            # written whole under a name of its own, then linked in place: a run that reads the lock never finds
            # it empty (which it would take for a corrupt lock, and over), and only one link can succeed
            tmp = f"{self.path}.{self.token}"
            try:
                with open(tmp, "wb") as f:  # (a full disk fails here: the file made is removed below)
                    f.write(data)
                try:
                    os.link(tmp, self.path)
                except FileExistsError:
                    raise
                except OSError:  # a file system without hard links: created exclusively, then written
                    fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
            except FileExistsError:
                raise LockError(f"{self.out.url} was just locked by another run. Only one run may write to an "
                                f"output folder.") from None
            finally:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
        else:
            write_atomic(fs, self.path, data)
        self.last_beat = self.clock()

    def heartbeat(self) -> None:
        if not self._beat_lock.acquire(blocking=False):
            return  # the other caller (the thread, or the loop) is beating now
        try:
            self._beat()
        finally:
            self._beat_lock.release()

    def confirm(self) -> bool:
        """Whether this run still holds the lock, asked before a write: a heartbeat that is due (this run was
        held up for a while: another may have taken the lock over as stale) is made first, which reads the
        lock back."""
        with self._beat_lock:
            self._beat()
            return not self.lost  # (a lock not held at all: a Ray worker's folder, which the driver's lock covers)

    def lose(self, to: str) -> None:
        """This run's folder is no longer its own (``to``: whose it is now): it writes nothing more there."""
        self.lost, self.lost_to = True, self.lost_to or to

    def taken_by(self) -> str:
        """Who took the lock over, for the message of a run that lost it."""
        return self.lost_to or "another run"

    def _beat(self) -> None:
        if not self.is_held or self.lost or self.clock() - self.last_beat < HEARTBEAT_S:
            return
        try:
            mine = self.holder()
            if mine is None:  # removed: by a run that took it over and finished (its parts are numbered too)
                self.lose("a run that took the lock over and has removed it since")
                log.error("the lock on %s is gone: another run must have taken it over; this run stops and "
                          "writes nothing more there", self.out.url)
                return
            if mine.get("token") != self.token:
                whose = ("a lock file this run cannot read (not JSON), written over its own" if mine.get("corrupt")
                         else f"host {mine.get('host')}, pid {mine.get('pid')}, started {mine.get('started_at')}")
                self.lose(whose)
                log.error("another run took over the lock on %s (%s): this run stops and writes nothing more "
                          "there", self.out.url, whose)
                return
            self._write(exclusive=False)
        except OSError as e:  # a missed heartbeat is not worth failing the job for
            log.warning("could not refresh the lock on %s: %s", self.out.url, e)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._beat_lock:  # a heartbeat still writing finishes first, and none follows
            if not self.is_held:
                return
            self.is_held = False
            _HELD.discard(self.token)
            self._remove_if_ours()

    def _remove_if_ours(self) -> None:
        try:
            mine = self.holder()
            if mine and mine.get("token") == self.token:
                self.out.fs.rm(self.path)
        except OSError as e:
            log.warning("could not remove the lock on %s: %s", self.out.url, e)
