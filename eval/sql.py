"""Execution accuracy of generated SQL against a SQLite file, read-only and time-limited.

A generated query is untrusted: it may try to write (DROP, DELETE, ATTACH...), run forever (an endless
recursive CTE) or return a cartesian product. Each is an error for that one example, never a damaged
database, a hung eval job or an exhausted node. Many queries run in a process pool whose workers each open
the database once.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import sqlite3
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

MAX_ROWS = 10_000
MAX_VALUE_BYTES = 10_000_000  # one string/blob: stops `SELECT randomblob(1e9)` allocating a gigabyte
PROGRESS_EVERY = 1_000  # VM instructions between deadline checks: ~1 ms granularity, little overhead
TIMEOUT = "timeout"
MIN_POOLED = 32  # starting worker processes costs more than running this many simple queries here

# Everything a SELECT needs; anything else (writes, ATTACH, PRAGMA, transactions) is refused at prepare time.
_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}


@dataclass(frozen=True)
class ExecResult:
    rows: tuple | None  # tuple of row tuples; None when the query failed
    error: str | None = None  # "timeout", or SQLite's message


class GoldQueryError(ValueError):
    """A reference query that fails on the database: a data bug, not a model error."""

    def __init__(self, index: int, query: str, error: str):
        self.index, self.query, self.error = index, query, error
        super().__init__(f"gold query #{index} fails on the database: {error}: {query}")


class NotADatabaseError(ValueError):
    def __init__(self, path: Path, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"{path}: not a readable SQLite database ({reason})")


def _authorize(action: int, *_args) -> int:
    return sqlite3.SQLITE_OK if action in _ALLOWED else sqlite3.SQLITE_DENY


class ReadOnlyDB:
    """One read-only connection that runs one SELECT at a time under a deadline."""

    def __init__(self, path: str | os.PathLike, max_rows: int = MAX_ROWS):
        path = Path(path).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such SQLite file")
        # mode=ro: the file itself cannot be written; query_only and the authorizer also stop writes to
        # temp tables and ATTACHed files, which mode=ro alone would allow.
        try:
            self.conn = sqlite3.connect(f"file:{quote(str(path))}?mode=ro", uri=True, isolation_level=None)
            self.conn.execute("SELECT count(*) FROM sqlite_master")  # a bad file fails here, not per query
        except sqlite3.DatabaseError as exc:
            raise NotADatabaseError(path, str(exc)) from None
        self.conn.execute("PRAGMA query_only = ON")
        self.conn.set_authorizer(_authorize)
        if hasattr(self.conn, "setlimit"):  # Python 3.11+; on 3.10 the authorizer alone refuses ATTACH
            self.conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
            self.conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        self.conn.set_progress_handler(self._expired, PROGRESS_EVERY)
        self.max_rows = max_rows
        self._deadline = math.inf

    def _expired(self) -> bool:
        return time.monotonic() > self._deadline  # true aborts the statement ("interrupted")

    def execute(self, query: str, timeout_s: float) -> ExecResult:
        self._deadline = time.monotonic() + timeout_s
        try:
            cursor = self.conn.execute(query)
            if cursor.description is None:  # e.g. an empty string or a comment: it selects nothing
                return ExecResult(None, "not a query: it returns no result set")
            rows = cursor.fetchmany(self.max_rows + 1)  # the deadline also covers fetching
        except (sqlite3.Error, sqlite3.Warning) as exc:  # Warning: "one statement at a time" on 3.11
            return ExecResult(None, self._describe(exc))
        finally:
            self._deadline = math.inf
        if len(rows) > self.max_rows:
            return ExecResult(None, f"too many rows (more than {self.max_rows})")
        return ExecResult(tuple(rows))

    def _describe(self, exc: Exception) -> str:
        message = str(exc)
        if "interrupt" in message and time.monotonic() > self._deadline:
            return TIMEOUT
        if "authoriz" in message:  # the authorizer's bare "not authorized" does not say why
            return f"{message} (read-only: only SELECT statements may run)"
        return message

    def close(self) -> None:
        self.conn.close()


def execute_serial(
    db_path: str | os.PathLike, queries: Sequence[str], timeout_s: float = 2.0, max_rows: int = MAX_ROWS
) -> list[ExecResult]:
    db = ReadOnlyDB(db_path, max_rows)
    try:
        return [db.execute(query, timeout_s) for query in queries]
    finally:
        db.close()


_worker_db: ReadOnlyDB | None = None


def _init_worker(db_path: str, max_rows: int) -> None:
    global _worker_db
    _worker_db = ReadOnlyDB(db_path, max_rows)


def _run_in_worker(query: str, timeout_s: float) -> ExecResult:
    assert _worker_db is not None, "worker used without its initializer"
    return _worker_db.execute(query, timeout_s)


def default_workers() -> int:
    """The CPUs this process may use (a SLURM allocation, not the node's core count), at most 8."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cpus, 8))


def execute_many(
    db_path: str | os.PathLike,
    queries: Sequence[str],
    timeout_s: float = 2.0,
    workers: int | None = None,
    max_rows: int = MAX_ROWS,
) -> list[ExecResult]:
    """Results in the queries' order. workers=0 runs here, serially; None uses the CPUs available (and
    runs a handful of queries here)."""
    if workers is None:
        workers = default_workers() if len(queries) >= MIN_POOLED else 0
    workers = min(workers, len(queries))
    if workers <= 1:
        return execute_serial(db_path, queries, timeout_s, max_rows)
    path = str(Path(db_path).resolve())
    ReadOnlyDB(path).close()  # a missing or foreign file fails here, clearly, not as a broken pool
    # spawn, not fork: the eval job calls this after torch has started threads (and maybe CUDA).
    context = multiprocessing.get_context("spawn")
    # Small chunks, so a runaway query holds up few others queued behind it in the same worker.
    chunksize = max(1, len(queries) // (workers * 16))
    with ProcessPoolExecutor(workers, context, initializer=_init_worker, initargs=(path, max_rows)) as pool:
        return list(pool.map(_run_in_worker, queries, [timeout_s] * len(queries), chunksize=chunksize))


def same_result(pred: ExecResult, gold: ExecResult) -> bool:
    """Same rows as multisets: row order is not part of the answer unless the question asks for it."""
    return pred.rows is not None and gold.rows is not None and Counter(pred.rows) == Counter(gold.rows)


def record_f1(pred: ExecResult, gold: ExecResult) -> float:
    if pred.rows is None or gold.rows is None:
        return 0.0
    if not pred.rows and not gold.rows:
        return 1.0
    overlap = sum((Counter(pred.rows) & Counter(gold.rows)).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred.rows), overlap / len(gold.rows)
    return 2 * precision * recall / (precision + recall)


def sql_metrics(
    preds: Sequence[str],
    golds: Sequence[str],
    db_path: str | os.PathLike,
    timeout_s: float = 2.0,
    workers: int | None = None,
) -> dict[str, float]:
    """sql_exec_accuracy, sql_record_f1 and sql_error_rate; raises GoldQueryError if a gold query fails."""
    if len(preds) != len(golds):
        raise ValueError(f"{len(preds)} predicted queries but {len(golds)} gold queries: they must pair up")
    results = execute_many(db_path, [*golds, *preds], timeout_s, workers)  # one pool for both
    gold_results, pred_results = results[: len(golds)], results[len(golds) :]
    for index, (query, gold) in enumerate(zip(golds, gold_results, strict=True)):
        if gold.error is not None:
            raise GoldQueryError(index, query, gold.error)
    n = len(preds)
    if n == 0:
        return {"sql_exec_accuracy": 0.0, "sql_record_f1": 0.0, "sql_error_rate": 0.0}
    pairs = list(zip(pred_results, gold_results, strict=True))
    return {
        "sql_exec_accuracy": sum(same_result(p, g) for p, g in pairs) / n,
        "sql_record_f1": sum(record_f1(p, g) for p, g in pairs) / n,
        "sql_error_rate": sum(p.error is not None for p in pred_results) / n,
    }
