"""An input's files: a folder's data files (as pyarrow.dataset chooses them), a glob's matches, and each file's
version, which tells a rewritten file from the same one."""

from __future__ import annotations

import posixpath

GLOB_CHARS = "*?["
# What a folder's Parquet files end with.
PARQUET_SUFFIXES = (".parquet", ".parq", ".pq")
# What tells a rewritten file from the same one, besides its size: the first of these keys a file system's info()
# has; a hash of the content first (S3: ETag; GCS: md5Hash), so that the same file uploaded again is the same (a
# shard refuses an input whose files changed), then a time (local: mtime; memory: created).
VERSION_KEYS = ("ETag", "etag", "md5Hash", "md5", "mtime", "LastModified", "last_modified", "updated", "created")


def glob_base(root: str) -> str:
    """The folder a glob's matches are named relative to: its fixed prefix, up to the last "/"."""
    base = root[: min(root.index(c) for c in GLOB_CHARS if c in root)]
    return base.rsplit("/", 1)[0] if "/" in base else ""


def is_data_file(path: str, suffixes: tuple[str, ...] = PARQUET_SUFFIXES, base: str = "") -> bool:
    """A data file of a folder input: its name ends with one of suffixes, and it is not hidden (``is_hidden``)."""
    return posixpath.basename(path).endswith(suffixes) and not is_hidden(path, base)


def is_hidden(path: str, base: str = "") -> bool:
    """Whether the file, or a folder between it and ``base``, starts with "." or "_", as pyarrow.dataset skips
    _SUCCESS, _temporary/, _delta_log/ and .snapshot/ (a folder's listing and a glob's matches alike)."""
    root = base.rstrip("/")
    rel = path[len(root) + 1:] if root and path.startswith(root + "/") else posixpath.basename(path)
    return any(part.startswith((".", "_")) for part in rel.split("/"))


def file_version(fs, path: str) -> str:
    """The file's size and its modification time (else ETag, checksum or creation time, as the file system tells
    them): tells a rewritten file from the same one. "" when the file system tells none of them, so a rewrite of
    the same size could not be told (``input_stamp`` then trusts nothing)."""
    try:
        info = fs.info(path)
    except OSError:
        return ""
    mark = next((info[k] for k in VERSION_KEYS if info.get(k)), None)
    return f"{info.get('size')}:{mark}" if mark is not None else ""
