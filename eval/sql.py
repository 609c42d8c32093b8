"""Execution accuracy of generated SQL against a SQLite file, read-only and time-limited.

A generated query is untrusted: it may try to write (DROP, DELETE, ATTACH...), run forever (an endless
recursive CTE), return a cartesian product or a result too big to hold (`SELECT zeroblob(9e6), ...` over
hundreds of columns). Each is an error for that one example, never a damaged database, a hung or aborted
eval job or an exhausted node. Many queries run in a process pool whose workers each open the database once.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import os
import re
import sqlite3
import sys
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from core.databases import check_database, connect_read_only
from core.names import SQL_TIMEOUT_S

log = logging.getLogger("eval.sql")

MAX_ROWS = 10_000
MAX_VALUE_BYTES = 10_000_000  # one string/blob: stops `SELECT randomblob(1e9)` allocating a gigabyte
# A whole result as the Python objects it becomes, counted row by row as it is fetched: 10,000 rows of
# 6 KB. Real answers are far smaller; past it the result is refused, not held.
MAX_RESULT_BYTES = 64 * 2**20
# What SQLite may hold at once in a process that runs queries. This bounds what no count in Python can:
# one row, which is computed and converted whole (300 columns of zeroblob(9e6) are 2.7 GB, twice: SQLite's
# copy and Python's). Real queries need a few MB (the page cache and the sorter spill to disk past ~2 MB).
# SQLite's limit is process-wide and can only be lowered, so it is one constant, not a parameter.
SQLITE_HEAP_BYTES = 128 * 2**20
PROGRESS_EVERY = 1_000  # VM instructions between deadline checks: ~1 ms granularity, little overhead
TIMEOUT = "timeout"
MIN_POOLED = 32  # starting worker processes costs more than running this many simple queries here

# Everything a SELECT needs; anything else (writes, ATTACH, PRAGMA, transactions) is refused at prepare time.
_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
# What running one query and reading its result can raise: that example's error, never the whole eval's.
# sqlite3.Warning: "one statement at a time" on 3.11; ValueError: a NUL or lone surrogate in the query, or
# text that is not UTF-8; MemoryError: past SQLITE_HEAP_BYTES, or the process's own memory limit.
QUERY_FAILURES = (sqlite3.Error, sqlite3.Warning, MemoryError, OverflowError, RecursionError, ValueError)


@dataclass(frozen=True)
class ExecResult:
    rows: tuple | None  # tuple of row tuples; None when the query failed
    error: str | None = None  # "timeout", or what went wrong


def _authorize(action: int, *_args) -> int:
    return sqlite3.SQLITE_OK if action in _ALLOWED else sqlite3.SQLITE_DENY


class ReadOnlyDB:
    """One read-only connection that runs one SELECT at a time under a deadline and size bounds."""

    def __init__(self, path: str | os.PathLike, max_rows: int = MAX_ROWS, max_bytes: int = MAX_RESULT_BYTES):
        self.conn = connect_read_only(Path(path).resolve())
        self.conn.execute(f"PRAGMA hard_heap_limit = {SQLITE_HEAP_BYTES}")  # only ever lowers it
        # query_only and the authorizer stop writes to temp tables and ATTACHed files, which mode=ro
        # alone would allow.
        self.conn.execute("PRAGMA query_only = ON")
        self.conn.set_authorizer(_authorize)
        if hasattr(self.conn, "setlimit"):  # Python 3.11+; on 3.10 the authorizer alone refuses ATTACH
            self.conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
            self.conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        self.conn.set_progress_handler(self._expired, PROGRESS_EVERY)
        self.max_rows, self.max_bytes = max_rows, max_bytes
        self._deadline = math.inf

    def _expired(self) -> bool:
        return time.monotonic() > self._deadline  # true aborts the statement ("interrupted")

    def execute(self, query: str, timeout_s: float) -> ExecResult:
        self._deadline = time.monotonic() + timeout_s
        cursor = self.conn.cursor()
        try:
            cursor.execute(query)
            if cursor.description is None:  # e.g. an empty string or a comment: it selects nothing
                return ExecResult(None, "not a query: it returns no result set")
            return self._fetch(cursor)
        except QUERY_FAILURES as exc:
            return ExecResult(None, self._describe(exc))
        finally:
            cursor.close()  # frees what SQLite holds for the statement, also when it failed midway
            self._deadline = math.inf

    def _fetch(self, cursor: sqlite3.Cursor) -> ExecResult:
        """The rows, each counted as it arrives, so a result stops at its first row past a bound, before
        the rest exists. The deadline is checked here too: SQLite's progress handler sees the query run,
        not its rows being turned into Python objects."""
        rows, size = [], 0
        getsizeof, append = sys.getsizeof, rows.append  # once per row: kept cheap (~0.5 us a row)
        for row in cursor:
            append(row)
            size += getsizeof(row) + sum(map(getsizeof, row))
            if len(rows) > self.max_rows or size > self.max_bytes or time.monotonic() > self._deadline:
                return ExecResult(None, self._refusal(len(rows), size))
        return ExecResult(tuple(rows))

    def _refusal(self, rows: int, size: int) -> str:
        if rows > self.max_rows:
            return f"too many rows (more than {self.max_rows})"
        if size > self.max_bytes:
            return f"result too large (more than {self.max_bytes:,} bytes as Python objects by row {rows})"
        return TIMEOUT

    def _describe(self, exc: Exception) -> str:
        if isinstance(exc, MemoryError):
            needs = "the query or one row of its result needs more than SQLite may hold"
            return f"out of memory: {needs} ({SQLITE_HEAP_BYTES // 2**20} MiB)"
        message = str(exc)
        if not isinstance(exc, (sqlite3.Error, sqlite3.Warning)):
            return f"{type(exc).__name__}: {message}"
        if "interrupt" in message and time.monotonic() > self._deadline:
            return TIMEOUT
        if "authoriz" in message:  # the authorizer's bare "not authorized" does not say why
            return f"{message} (read-only: only SELECT statements may run)"
        return message

    def close(self) -> None:
        self.conn.close()


def execute_serial(
    db_path: str | os.PathLike,
    queries: Sequence[str],
    timeout_s: float = SQL_TIMEOUT_S,
    max_rows: int = MAX_ROWS,
    max_bytes: int = MAX_RESULT_BYTES,
) -> list[ExecResult]:
    db = ReadOnlyDB(db_path, max_rows, max_bytes)
    try:
        return [db.execute(query, timeout_s) for query in queries]
    finally:
        db.close()


_worker_db: ReadOnlyDB | None = None


def _init_worker(db_path: str, max_rows: int, max_bytes: int) -> None:
    global _worker_db
    _worker_db = ReadOnlyDB(db_path, max_rows, max_bytes)


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
    timeout_s: float = SQL_TIMEOUT_S,
    workers: int | None = None,
    max_rows: int = MAX_ROWS,
    max_bytes: int = MAX_RESULT_BYTES,
) -> list[ExecResult]:
    """Results in the queries' order. workers=0 runs here, serially; None uses the CPUs available (and
    runs a handful of queries here)."""
    if workers is None:
        workers = default_workers() if len(queries) >= MIN_POOLED else 0
    workers = min(workers, len(queries))
    if workers <= 1:
        return execute_serial(db_path, queries, timeout_s, max_rows, max_bytes)
    path = str(Path(db_path).resolve())
    check_database(path)  # a missing, foreign or empty file fails here, clearly, not as a broken pool
    # spawn, not fork: the eval job calls this after torch has started threads (and maybe CUDA).
    context = multiprocessing.get_context("spawn")
    # Small chunks, so a runaway query holds up few others queued behind it in the same worker.
    chunksize = max(1, len(queries) // (workers * 16))
    bounds = (path, max_rows, max_bytes)
    with ProcessPoolExecutor(workers, context, initializer=_init_worker, initargs=bounds) as pool:
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
    timeout_s: float = SQL_TIMEOUT_S,
    workers: int | None = None,
    ids: Sequence | None = None,
    max_rows: int = MAX_ROWS,
    max_bytes: int = MAX_RESULT_BYTES,
) -> dict:
    """sql_exec_accuracy, sql_record_f1, sql_error_rate, and sql_gold_errors ({count, ids}: the examples
    whose gold query fails or returns too much). Those examples are a data bug, not the model's error:
    they are left out of every denominator, and a warning names them. When that leaves no example, the
    three scores are absent and sql_unscored_reason says why: a score over nothing would read as a real
    0.0 (the usual cause is the wrong database). `ids` name the examples (default: their positions)."""
    if len(preds) != len(golds):
        raise ValueError(f"{len(preds)} predicted queries but {len(golds)} gold queries: they must pair up")
    ids = list(range(len(golds))) if ids is None else list(ids)
    # One pool for both lists.
    results = execute_many(db_path, [*golds, *preds], timeout_s, workers, max_rows, max_bytes)
    gold_results, pred_results = results[: len(golds)], results[len(golds) :]
    bad = [i for i, gold in enumerate(gold_results) if gold.error is not None]
    gold_errors = {"count": len(bad), "ids": [ids[i] for i in bad]}
    kept = sorted(set(range(len(golds))) - set(bad))
    if not kept:
        return {
            "sql_unscored_reason": unscored_reason(db_path, ids, gold_results),
            "sql_gold_errors": gold_errors,
        }
    if bad:
        warn_gold_errors(db_path, [ids[i] for i in bad], [gold_results[i].error for i in bad], len(golds))
    pairs = [pred_results[i] for i in kept], [gold_results[i] for i in kept], [golds[i] for i in kept]
    return {**score_pairs(*pairs), "sql_gold_errors": gold_errors}


def unscored_reason(db_path, ids: list, gold_results: list[ExecResult]) -> str:
    if not gold_results:
        return "no examples to score"
    first = f"id {json.dumps(ids[0])}: {gold_results[0].error}"
    return f"no example could be scored: all {len(ids)} gold queries fail on {db_path} ({first})"


def pair_scores(pred: ExecResult, gold: ExecResult, gold_query: str) -> dict[str, float]:
    """One example's scores: the eval's means are over these, and a GRPO stage's SQL rewards are these."""
    return {
        "sql_exec_accuracy": float(same_result(pred, gold, orders_rows(gold_query))),
        "sql_record_f1": record_f1(pred, gold),
        "sql_executes": float(pred.error is None),
    }


def score_pairs(
    preds: list[ExecResult], golds: list[ExecResult], gold_queries: list[str]
) -> dict[str, float]:
    """The three fractions over one or more pairs: means of pair_scores (the error rate is 1 - executes)."""
    n = len(preds)
    each = [pair_scores(p, g, q) for p, g, q in zip(preds, golds, gold_queries, strict=True)]
    return {
        "sql_exec_accuracy": sum(e["sql_exec_accuracy"] for e in each) / n,
        "sql_record_f1": sum(e["sql_record_f1"] for e in each) / n,
        "sql_error_rate": sum(e["sql_executes"] == 0.0 for e in each) / n,
    }


def warn_gold_errors(db_path, ids: list, errors: list[str], total: int) -> None:
    shown = "; ".join(f"id {json.dumps(i)}: {e}" for i, e in zip(ids[:5], errors[:5], strict=True))
    more = f" and {len(ids) - 5} more" if len(ids) > 5 else ""
    log.warning(
        "%d of %d gold queries fail on %s or return too much (a data bug: fix them); those examples "
        "are left out of the sql metrics: %s%s",
        len(ids),
        total,
        db_path,
        shown,
        more,
    )
