"""One run at a time per output folder: OUT/.overnight.lock names the holder and carries a heartbeat.

A second run on the same OUT refuses, naming the first (host, pid, start
time). A lock left by a run that died is stale, and taken over: on the same
host when its pid is gone, anywhere when its heartbeat is older than
STALE_S. Taking over writes our own lock and reads it back, so of two runs
racing for a stale lock exactly one wins.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import socket
import time
import uuid
from typing import Optional

from overnight.pipeline.output.checkpoint import OutputDir, OutputError
from overnight.pipeline.output.storage import is_local, read_text, write_atomic

log = logging.getLogger("overnight")

LOCK = ".overnight.lock"
# A lock whose heartbeat is older than this belongs to a run that is gone.
STALE_S = 120.0
HEARTBEAT_S = 30.0


class LockError(OutputError):
    "Another run holds the output folder."


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    def __init__(self, out: OutputDir, run_id: str = "", clock=time.time):
        self.out = out
        self.path = out.path(LOCK)
        self.clock = clock
        self.token = uuid.uuid4().hex
        self.info = {"host": socket.gethostname(), "pid": os.getpid(), "run_id": run_id,
                     "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                     "token": self.token}
        self.last_beat = 0.0
        self.is_held = False

    def holder(self) -> Optional[dict]:
        text = read_text(self.out.fs, self.path)
        if text is None:
            return None
        try:
            return json.loads(text)
        except ValueError:
            return {"corrupt": True, "heartbeat": 0}

    def is_stale(self, other: dict) -> bool:
        if other.get("corrupt"):
            return True
        if other.get("host") == self.info["host"]:
            if other.get("pid") == os.getpid():
                return True  # left by this very process (an earlier job in a notebook, a test)
            if not _pid_alive(int(other.get("pid", -1))):
                return True
        return self.clock() - float(other.get("heartbeat", 0)) > STALE_S

    def acquire(self) -> None:
        other = self.holder()
        if other is not None:
            if not self.is_stale(other):
                raise LockError(
                    f"{self.out.url} is in use by another overnight run: host {other.get('host')}, pid "
                    f"{other.get('pid')}, started {other.get('started_at')} ({other.get('run_id') or 'run'}). "
                    f"Wait for it to finish, or stop it; if that process is gone, its lock is taken over once its "
                    f"heartbeat is {STALE_S:.0f} s old.")
            log.warning("taking over a stale lock on %s (host %s, pid %s, started %s)", self.out.url,
                        other.get("host"), other.get("pid"), other.get("started_at"))
        self._write(exclusive=other is None)
        mine = self.holder()
        if not mine or mine.get("token") != self.token:
            raise LockError(f"{self.out.url} was just locked by another run (host {mine and mine.get('host')}, pid "
                            f"{mine and mine.get('pid')}). Only one run may write to an output folder.")
        self.is_held = True

    def _write(self, exclusive: bool) -> None:
        info = dict(self.info, heartbeat=self.clock())
        data = json.dumps(info).encode()
        fs = self.out.fs
        fs.makedirs(self.out.root, exist_ok=True)
        if exclusive and is_local(fs):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                raise LockError(f"{self.out.url} was just locked by another run. Only one run may write to an "
                                f"output folder.") from None
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        else:
            write_atomic(fs, self.path, data)
        self.last_beat = self.clock()

    def heartbeat(self) -> None:
        if self.is_held and self.clock() - self.last_beat >= HEARTBEAT_S:
            try:
                self._write(exclusive=False)
            except OSError as e:  # a missed heartbeat is not worth failing the job for
                log.warning("could not refresh the lock on %s: %s", self.out.url, e)

    def release(self) -> None:
        if not self.is_held:
            return
        self.is_held = False
        try:
            mine = self.holder()
            if mine and mine.get("token") == self.token:
                self.out.fs.rm(self.path)
        except OSError as e:
            log.warning("could not remove the lock on %s: %s", self.out.url, e)
