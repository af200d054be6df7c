"""All file access goes through here, so local paths, memory:// and s3:// share one code path.

Credentials for remote stores come from the environment or the store's
standard config files (e.g. AWS_* variables, ~/.aws), never from arguments.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import time
import uuid
from typing import Callable, Optional, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem


log = logging.getLogger("overnight")
T = TypeVar("T")

# Errors that retrying will not fix: fail at once, with the fix in the message.
PERMANENT_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG, errno.ENOTDIR,
                    errno.EISDIR, errno.EDQUOT, errno.ENAMETOOLONG, errno.EEXIST}
RETRY_DELAYS = (0.5, 1.0, 2.0, 4.0)


class StorageError(Exception):
    "A path could not be read or written; the message names it and the fix."


def is_permanent(e: BaseException) -> bool:
    return isinstance(e, (PermissionError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                          FileExistsError)) or (
        isinstance(e, OSError) and e.errno in PERMANENT_ERRNOS)


def with_retries(fn: Callable[[], T], what: str, delays=None, sleep=time.sleep) -> T:
    """Run fn, retrying transient I/O errors with exponential backoff."""
    delays = RETRY_DELAYS if delays is None else delays
    for attempt, delay in enumerate((*delays, None), start=1):
        try:
            return fn()
        except Exception as e:
            transient = isinstance(e, (OSError, ConnectionError, TimeoutError)) and not is_permanent(e)
            if not transient or delay is None:
                raise
            log.warning("%s failed (%s), retry %d of %d in %.1f s", what, e, attempt, len(delays), delay)
            sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


def url_to_fs(url: str):
    """Return ``(fs, path)`` for a local path or fsspec URL."""
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path


def is_local(fs) -> bool:
    return isinstance(fs, LocalFileSystem)


def unstrip(fs, path: str) -> str:
    """Turn an fs-internal path back into a URL a user (or DuckDB) recognises."""
    return path if is_local(fs) else fs.unstrip_protocol(path)


def redact(url: str) -> str:
    """A URL fit for logs and manifests: credentials written into it (user:secret@host) are masked."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, tail = rest.partition("/")
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    return f"{scheme}://{netloc}{slash}{tail}"


def join(*parts: str) -> str:
    return posixpath.join(*parts)


def open_file(url: str, mode: str = "rb"):
    fs, path = url_to_fs(url)
    return fs.open(path, mode)


def write_atomic(fs, path: str, data: bytes) -> None:
    """Write ``data`` so that ``path`` is either absent, the old content, or complete.

    Local files are written under a temporary name, fsynced and renamed. Object
    stores make an object visible only when its upload completes, and memory://
    on close, so there a direct write is already atomic.
    """
    from overnight.pipeline.output.faults import failpoint

    failpoint("storage.write")
    if is_local(fs):
        directory = os.path.dirname(path) or "."
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex}-{os.path.basename(path)}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            failpoint("storage.before_rename")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        _fsync_dir(directory)
    else:
        with fs.open(path, "wb") as f:
            f.write(data)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def read_text(fs, path: str) -> Optional[str]:
    """The file's text, or None when it does not exist. A folder in its place is a StorageError naming it; bytes
    that are not UTF-8 a UnicodeDecodeError (a ValueError, as JSON that does not parse)."""
    try:
        with fs.open(path, "rb") as f:
            return f.read().decode("utf-8")
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise StorageError(f"{unstrip(fs, path)} is a folder, where overnight keeps a file of that name. Move it "
                           f"away, or choose another --out.") from None


def unwritable(url: str) -> Optional[str]:
    """Why a file cannot be written at this local path (a folder there, a file where a folder must be, a folder
    without write permission), checked before the work that makes it; None when it can, or for remote storage,
    which says so only when written."""
    if not url.strip():
        return "no path given"
    fs, path = url_to_fs(url)
    if not is_local(fs):
        return None
    if os.path.isdir(path):
        return "it is a folder"
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is a file, not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable"
    return None
