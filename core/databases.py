"""Whether an SQLite file can serve as a task's database: the launcher's checks (slurm/planning/checks.py)
and the SQL scorer (eval/sql.py) ask the same question, so its one answer lives here."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from urllib.parse import quote


class NotADatabaseError(ValueError):
    """The file exists but cannot serve: not SQLite, or SQLite without a table (every query would fail)."""

    def __init__(self, path: Path, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"{path}: {reason}")


def connect_read_only(path: Path) -> sqlite3.Connection:
    """A read-only connection to an SQLite file holding at least one table; says why not otherwise.

    An empty file (0 bytes) is a valid, empty database to SQLite: every query on it fails, and a score
    made over it would only look like one."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such SQLite file")
    conn = None
    try:  # mode=ro: the file itself cannot be written
        conn = sqlite3.connect(f"file:{quote(str(path))}?mode=ro", uri=True, isolation_level=None)
        (tables,) = conn.execute(
            "SELECT count(*) FROM sqlite_master WHERE type IN ('table', 'view')"
        ).fetchone()
    except sqlite3.DatabaseError as exc:
        if conn is not None:
            conn.close()
        raise NotADatabaseError(path, f"not a readable SQLite database ({exc})") from None
    if not tables:
        conn.close()
        empty = "the file is empty, 0 bytes" if path.stat().st_size == 0 else "an empty SQLite database"
        raise NotADatabaseError(path, f"no tables in it ({empty}): every query on it would fail")
    return conn


def check_database(path: str | os.PathLike) -> None:
    """Raises FileNotFoundError or NotADatabaseError unless `path` is an SQLite file with tables."""
    connect_read_only(Path(path).resolve()).close()
