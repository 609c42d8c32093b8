"""Files under runs/ that other processes read while they change (--status, a resumed job, the report, an
eval job waiting on DONE): each is replaced whole or not at all, and survives a crash once written.

Torch-free and standard library only: the launcher on the login node and the jobs on the nodes share it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never half of one; after return it is on disk.

    A temporary file in the same folder (a rename across file systems is a copy), flushed and synced,
    then renamed over the target; the folder is synced so the rename itself survives a node failure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def write_json_atomic(path: Path, value, indent: int | None = None) -> None:
    write_atomic(path, json.dumps(value, indent=indent) + "\n")


def read_json(path: Path, default=None):
    """The file's JSON, or `default` when it is missing or unreadable (a reader never crashes on it)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return default


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's entry to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
