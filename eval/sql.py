"""Execution accuracy of generated SQL against a SQLite file, read-only and time-limited.

A generated query is untrusted: it may try to write (DROP, DELETE, ATTACH...), run forever (an endless
recursive CTE) or return a cartesian product. Each is an error for that one example, never a damaged
database, a hung eval job or an exhausted node. Many queries run in a process pool whose workers each open
the database once.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import os
import re
import sqlite3
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

log = logging.getLogger("eval.sql")

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


# What ORDER BY detection skips: string literals, quoted names and comments (their text is not SQL).
_NOT_SQL = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|`[^`]*`|\[[^\]]*\]|--[^\n]*|/\*.*?(?:\*/|$)", re.S)
_ORDER_BY = re.compile(r"\border\s+by\b", re.I)


def orders_rows(query: str) -> bool:
    """Whether the query's own result is ordered: an ORDER BY outside every parenthesis.

    sqlglot is not a dependency, so this is a careful scan, not a parse: strings, quoted names and comments
    are blanked first, then text inside parentheses (subqueries, CTE bodies, `OVER (ORDER BY ...)` windows,
    `group_concat(x ORDER BY y)`) is ignored. An ORDER BY after a UNION orders the whole compound result."""
    text = _NOT_SQL.sub(" ", query)
    depth, top = 0, []
    for char in text:
        depth += (char == "(") - (char == ")")
        top.append(char if depth == 0 and char != ")" else " ")
    return bool(_ORDER_BY.search("".join(top)))


def same_result(pred: ExecResult, gold: ExecResult, ordered: bool = False) -> bool:
    """Same rows in the same order when the gold query orders them (the question asks for an order), else
    the same rows as multisets (row order is then not part of the answer)."""
    if pred.rows is None or gold.rows is None:
        return False
    return pred.rows == gold.rows if ordered else Counter(pred.rows) == Counter(gold.rows)


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
    ids: Sequence | None = None,
    max_rows: int = MAX_ROWS,
) -> dict:
    """sql_exec_accuracy, sql_record_f1, sql_error_rate, and sql_gold_errors ({count, ids}: the examples
    whose gold query fails or returns too many rows). Those examples are a data bug, not the model's
    error: they are left out of every denominator, and a warning names them. `ids` name the examples
    (default: their positions)."""
    if len(preds) != len(golds):
        raise ValueError(f"{len(preds)} predicted queries but {len(golds)} gold queries: they must pair up")
    ids = list(range(len(golds))) if ids is None else list(ids)
    results = execute_many(db_path, [*golds, *preds], timeout_s, workers, max_rows)  # one pool for both
    gold_results, pred_results = results[: len(golds)], results[len(golds) :]
    bad = [i for i, gold in enumerate(gold_results) if gold.error is not None]
    if bad:
        warn_gold_errors(db_path, [ids[i] for i in bad], [gold_results[i].error for i in bad], len(golds))
    kept = sorted(set(range(len(golds))) - set(bad))
    return {
        **score_pairs(
            [pred_results[i] for i in kept], [gold_results[i] for i in kept], [golds[i] for i in kept]
        ),
        "sql_gold_errors": {"count": len(bad), "ids": [ids[i] for i in bad]},
    }


def score_pairs(
    preds: list[ExecResult], golds: list[ExecResult], gold_queries: list[str]
) -> dict[str, float]:
    n = len(preds)
    if n == 0:
        return {"sql_exec_accuracy": 0.0, "sql_record_f1": 0.0, "sql_error_rate": 0.0}
    triples = list(zip(preds, golds, gold_queries, strict=True))
    return {
        "sql_exec_accuracy": sum(same_result(p, g, orders_rows(q)) for p, g, q in triples) / n,
        "sql_record_f1": sum(record_f1(p, g) for p, g, _ in triples) / n,
        "sql_error_rate": sum(p.error is not None for p in preds) / n,
    }


def warn_gold_errors(db_path, ids: list, errors: list[str], total: int) -> None:
    shown = "; ".join(f"id {json.dumps(i)}: {e}" for i, e in zip(ids[:5], errors[:5], strict=True))
    more = f" and {len(ids) - 5} more" if len(ids) > 5 else ""
    log.warning(
        "%d of %d gold queries fail on %s or return too many rows (a data bug: fix them); those examples "
        "are left out of the sql metrics: %s%s",
        len(ids),
        total,
        db_path,
        shown,
        more,
    )
