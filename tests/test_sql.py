"""SQL execution scoring on a small real SQLite file: metrics by hand, read-only, time limit, row cap,
bounded result size."""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import subprocess
import sys
import time

import pytest

from eval.sql import (
    MAX_RESULT_BYTES,
    TIMEOUT,
    ExecResult,
    ReadOnlyDB,
    execute_many,
    execute_serial,
    orders_rows,
    sql_metrics,
)

RUNAWAY = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
COUNT = "SELECT count(*) FROM items"


@pytest.fixture()
def db(tmp_path):
    path = tmp_path / "shop.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT, price INTEGER)")
    conn.executemany(
        "INSERT INTO items VALUES (?, ?, ?)", [(1, "apple", 3), (2, "pear", 5), (3, "fig", 5), (4, "kiwi", 2)]
    )
    conn.commit()
    conn.close()
    return path


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


NO_GOLD_ERRORS = {"count": 0, "ids": []}


def rates(scores: dict) -> dict:
    """The three fractions (pytest.approx takes no nested dict), after checking no gold query failed."""
    assert scores.pop("sql_gold_errors") == NO_GOLD_ERRORS
    return scores


# (prediction, gold): exact, reordered (the gold query asks for no order), partial overlap, syntax error.
CASES = [
    ("SELECT name FROM items WHERE price = 5", "SELECT name FROM items WHERE price = 5"),
    ("SELECT name FROM items ORDER BY name DESC", "SELECT name FROM items"),
    # pred {apple, kiwi}, gold {apple, pear, fig}: overlap 1, P 1/2, R 1/3, F1 2/5
    ("SELECT name FROM items WHERE price <= 3", "SELECT name FROM items WHERE price >= 3"),
    ("SELEC name FROM items", "SELECT name FROM items"),
]


@pytest.mark.parametrize("workers", [0, 2])
def test_metrics_by_hand(db, workers):
    preds, golds = zip(*CASES, strict=True)
    scores = sql_metrics(list(preds), list(golds), db, timeout_s=2.0, workers=workers)
    assert rates(scores) == pytest.approx(
        {"sql_exec_accuracy": 2 / 4, "sql_record_f1": (1 + 1 + 2 / 5 + 0) / 4, "sql_error_rate": 1 / 4}
    )


def test_rows_are_multisets(db):
    # gold prices 3, 5, 5, 2; DISTINCT loses a 5: overlap 3, P 1, R 3/4, F1 6/7; not an exact match.
    scores = sql_metrics(["SELECT DISTINCT price FROM items"], ["SELECT price FROM items"], db, workers=0)
    assert rates(scores) == pytest.approx(
        {"sql_exec_accuracy": 0.0, "sql_record_f1": 6 / 7, "sql_error_rate": 0.0}
    )


def test_both_empty_is_a_match(db):
    scores = sql_metrics(
        ["SELECT name FROM items WHERE id < 0"], ["SELECT name FROM items WHERE price > 99"], db
    )
    assert rates(scores) == {"sql_exec_accuracy": 1.0, "sql_record_f1": 1.0, "sql_error_rate": 0.0}


def test_an_ordered_gold_query_is_compared_in_order(db):
    # Gold asks for the cheapest first: kiwi, apple, pear, fig. The same names alphabetically are the
    # right set in the wrong order; under the multiset rule (today's) both would count as a match.
    gold = "SELECT name FROM items ORDER BY price, id"
    preds = ["SELECT name FROM items ORDER BY price, id", "SELECT name FROM items ORDER BY name"]
    scores = rates(sql_metrics(preds, [gold, gold], db, workers=0))
    assert scores == {"sql_exec_accuracy": 1 / 2, "sql_record_f1": 1.0, "sql_error_rate": 0.0}


def test_order_inside_a_subquery_or_window_does_not_order_the_result(db):
    # Neither gold orders its own result: the prediction's order is free, as with no ORDER BY at all.
    golds = [
        "SELECT name FROM (SELECT name FROM items ORDER BY price, id LIMIT 3)",
        "SELECT name, row_number() OVER (ORDER BY price, id) FROM items",
    ]
    preds = [
        "SELECT name FROM items WHERE id != 3 ORDER BY name DESC",
        "SELECT name, row_number() OVER (ORDER BY price, id) FROM items ORDER BY name",
    ]
    assert rates(sql_metrics(preds, golds, db, workers=0))["sql_exec_accuracy"] == 1.0


@pytest.mark.parametrize(
    ("query", "ordered"),
    [
        ("SELECT a FROM t ORDER BY a", True),
        ("select a from t\norder\n  by a desc limit 3", True),
        ("SELECT a FROM t UNION SELECT b FROM u ORDER BY 1", True),
        ("SELECT a FROM (SELECT a FROM t ORDER BY a)", False),
        ("WITH x AS (SELECT a FROM t ORDER BY a) SELECT a FROM x", False),
        ("SELECT rank() OVER (PARTITION BY b ORDER BY a) FROM t", False),
        ("SELECT group_concat(a ORDER BY a) FROM t", False),
        ("SELECT 'order by' FROM t", False),
        ('SELECT "order by" FROM t', False),
        ("SELECT a FROM t -- ORDER BY a", False),
        ("SELECT a FROM t /* ORDER BY a */", False),
        ("SELECT 'it''s (' FROM t ORDER BY a", True),  # a quoted parenthesis opens nothing
        ("SELECT a AS border_by FROM t", False),
    ],
)
def test_orders_rows(query, ordered):
    assert orders_rows(query) is ordered


def test_failing_or_oversized_gold_is_left_out_and_named(db, caplog):
    preds = ["SELECT 1", "SELECT 1", "SELECT name FROM items", "SELEC", "SELECT 2"]
    golds = [
        "SELECT 1",
        "SELECT nope FROM items",  # fails
        "SELECT name FROM items",
        "SELECT name FROM items",
        "SELECT * FROM items a, items b, items c",  # 64 rows: over the cap of 10 below
    ]
    ids = ["q0", "q1", "q2", "q3", "q4"]
    with caplog.at_level("WARNING", logger="eval.sql"):
        scores = sql_metrics(preds, golds, db, workers=0, ids=ids, max_rows=10)
    assert scores.pop("sql_gold_errors") == {"count": 2, "ids": ["q1", "q4"]}
    # Three examples scored: q0 and q2 right, q3 a syntax error.
    assert scores == pytest.approx(
        {"sql_exec_accuracy": 2 / 3, "sql_record_f1": 2 / 3, "sql_error_rate": 1 / 3}
    )
    assert "2 of 5 gold queries fail" in caplog.text
    assert 'id "q1": no such column: nope' in caplog.text and 'id "q4": too many rows' in caplog.text


def test_all_gold_failing_gives_no_score_and_the_reason_not_zeros(db, caplog):
    # Before: accuracy 0.0 and error rate 0.0, which read as a real (bad) score of a model.
    with caplog.at_level("WARNING", logger="eval.sql"):
        scores = sql_metrics(["SELECT 1", "SELECT 2"], ["SELECT nope", "SELECT * FROM gone"], db, workers=0)
    assert scores == {
        "sql_unscored_reason": f"no example could be scored: all 2 gold queries fail on {db} "
        "(id 0: no such column: nope)",
        "sql_gold_errors": {"count": 2, "ids": [0, 1]},
    }
    assert "data bug" not in caplog.text  # the reason says it all; not a warning about a few bad rows


def test_empty_and_mismatched_inputs(db):
    assert sql_metrics([], [], db) == {
        "sql_unscored_reason": "no examples to score",
        "sql_gold_errors": {"count": 0, "ids": []},
    }
    with pytest.raises(ValueError, match="pair up"):
        sql_metrics(["SELECT 1"], [], db)


def test_missing_or_foreign_database_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such SQLite file"):
        execute_many(tmp_path / "absent.sqlite", ["SELECT 1"] * 40, workers=2)
    text = tmp_path / "notes.txt"
    text.write_text("not a database, but long enough to have a header " * 10)
    with pytest.raises(ValueError, match="not a readable SQLite database"):
        execute_many(text, ["SELECT 1"], workers=0)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_database_without_tables_is_refused_not_scored_as_zero(tmp_path, workers):
    # SQLite opens a 0-byte file as an empty database: every query failed, and the eval said 0.0.
    empty = tmp_path / "empty.sqlite"
    empty.touch()
    with pytest.raises(ValueError, match=re.escape(f"{empty}: no tables in it (the file is empty, 0 bytes)")):
        execute_many(empty, ["SELECT 1"] * 40, workers=workers)
    emptied = tmp_path / "emptied.sqlite"
    conn = sqlite3.connect(emptied)
    conn.executescript("CREATE TABLE t (x); DROP TABLE t;")
    conn.close()
    with pytest.raises(ValueError, match=re.escape("no tables in it (an empty SQLite database)")):
        sql_metrics(["SELECT 1"], ["SELECT 1"], emptied, workers=workers)


DESTRUCTIVE = [
    "DROP TABLE items",
    "DELETE FROM items",
    "UPDATE items SET price = 0",
    "INSERT INTO items VALUES (9, 'plum', 1)",
    "CREATE TABLE evil (x)",
    "CREATE TEMP TABLE evil (x)",
    "PRAGMA query_only = OFF",
    "BEGIN IMMEDIATE",
    "VACUUM",
    "SELECT 1; DELETE FROM items",
    "",
]


@pytest.mark.parametrize("workers", [0, 2])
def test_destructive_queries_fail_and_leave_the_file_untouched(db, tmp_path, workers):
    attach = f"ATTACH DATABASE '{tmp_path / 'evil.sqlite'}' AS evil"
    vacuum_into = f"VACUUM INTO '{tmp_path / 'copy.sqlite'}'"
    queries = [*DESTRUCTIVE, attach, vacuum_into]
    before, files_before = digest(db), sorted(p.name for p in tmp_path.iterdir())
    # Each write attempt is followed by a count: nothing may have changed in between.
    results = execute_many(db, [q for query in queries for q in (query, COUNT)], workers=workers)
    for query, result, count in zip(queries, results[::2], results[1::2], strict=True):
        assert result.rows is None and result.error, query
        assert count == ExecResult(((4,),)), query
    assert digest(db) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == files_before  # no attached file, no copy, no journal


def test_no_state_survives_from_one_query_to_the_next(db):
    # mode=ro alone would allow both: a temp table or an attached in-memory database, seen by later queries.
    queries = [
        "CREATE TEMP TABLE scratch AS SELECT 1 AS x",
        "SELECT x FROM scratch",
        "ATTACH DATABASE ':memory:' AS mem",
        "SELECT count(*) FROM mem.sqlite_master",
    ]
    results = execute_serial(db, queries)  # one connection, as in one pool worker
    assert [r.rows for r in results] == [None] * 4
    assert "no such table: scratch" in results[1].error


def test_runaway_query_is_cut_at_the_limit(db):
    database = ReadOnlyDB(db)
    start = time.monotonic()
    result = database.execute(RUNAWAY, timeout_s=0.3)
    elapsed = time.monotonic() - start
    assert result == ExecResult(None, TIMEOUT)
    assert 0.3 <= elapsed < 3.0  # loose: returned at the limit, not after the query ran its course
    assert database.execute(COUNT, timeout_s=0.3) == ExecResult(((4,),))  # the connection still works
    database.close()


def test_runaway_query_in_the_pool_holds_up_nothing_else(db):
    results = execute_many(db, [RUNAWAY, COUNT, "SELEC 1"], timeout_s=0.3, workers=2)
    assert results[0] == ExecResult(None, TIMEOUT)
    assert results[1] == ExecResult(((4,),))
    assert "syntax error" in results[2].error


def test_pool_and_serial_agree(db):
    queries = [q for pair in CASES for q in pair] * 10
    assert execute_many(db, queries, workers=2) == execute_serial(db, queries)


def test_row_cap(db):
    capped = ReadOnlyDB(db, max_rows=15)
    # 4 x 4 = 16 rows: one over the cap is an error, not a truncated (and falsely comparable) result.
    assert "too many rows" in capped.execute("SELECT * FROM items a, items b", 1.0).error
    assert len(capped.execute("SELECT * FROM items a, items b WHERE a.id > 1", 1.0).rows) == 12
    capped.close()


ENDLESS_ROWS = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x, 'some text' FROM c"


def test_a_result_over_the_byte_bound_is_that_examples_error_only(db):
    # 16 rows of 6 values each are ~6 KB as Python objects; 4 rows of one name are well under 2 KB.
    preds = ["SELECT name FROM items", "SELECT * FROM items a, items b", "SELECT 1"]
    golds = ["SELECT name FROM items", "SELECT name FROM items", "SELECT * FROM items a, items b"]
    scores = sql_metrics(preds, golds, db, workers=0, max_bytes=2_000)
    assert scores.pop("sql_gold_errors") == {"count": 1, "ids": [2]}  # a gold over it is left out, named
    assert scores == {"sql_exec_accuracy": 1 / 2, "sql_record_f1": 1 / 2, "sql_error_rate": 1 / 2}
    small = ReadOnlyDB(db, max_rows=10**9, max_bytes=2_000)
    assert small.execute(preds[1], 1.0).error.startswith("result too large (more than 2,000 bytes")
    # Counted as the rows come: an endless result stops at the bound, at once, not at the time limit.
    start = time.monotonic()
    assert small.execute(ENDLESS_ROWS, 30.0).error.startswith("result too large")
    assert time.monotonic() - start < 5.0
    assert small.execute(COUNT, 1.0) == ExecResult(((4,),))  # the connection still works
    small.close()


def test_the_deadline_covers_turning_rows_into_python_objects(db):
    # Ten 5 MB blobs: SQLite runs a few dozen instructions (its progress handler, which holds the
    # deadline, never runs), then turning them into bytes objects takes tens of milliseconds.
    wide = "SELECT " + ", ".join(["zeroblob(5000000)"] * 10)
    database = ReadOnlyDB(db)
    assert database.execute(wide, timeout_s=0.001) == ExecResult(None, TIMEOUT)
    assert len(database.execute(wide, timeout_s=30.0).rows[0]) == 10  # in time, the same query is fine
    database.close()


CAP_BYTES = 2**30  # the child's address space: what a node or a container gives the eval, here small
WIDE_ROW = "SELECT " + ", ".join(["zeroblob(9e6)"] * 300)  # one row of 2.7 GB
MANY_ROWS = (  # 120 rows of 9 MB, ~1 GB in all, each row small enough to be made
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 120) "
    "SELECT zeroblob(9e6), x FROM c"
)


def run_capped(repo_root, code: str) -> dict:
    """Runs `code` in a Python whose memory is capped at CAP_BYTES (its pool workers inherit the cap) and
    returns the JSON it prints last, with its peak memory: an unbounded result fails there with
    MemoryError instead of taking this machine's memory. Its own peak is VmHWM, not ru_maxrss: Linux
    carries a process's peak across fork and exec, so ru_maxrss would report the pytest process's."""
    prologue = (
        f"import json, resource, sys\nresource.setrlimit(resource.RLIMIT_AS, ({CAP_BYTES}, {CAP_BYTES}))\n"
    )
    epilogue = (
        "\nhwm = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:'))"
        "\nprint(json.dumps({'result': result, 'peak_mb': max(hwm, "
        "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) // 1024}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", prologue + code + epilogue],
        cwd=repo_root,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(
    ("hostile", "error"),
    [
        (WIDE_ROW, "out of memory: the query or one row of its result needs more than SQLite may hold"),
        (MANY_ROWS, f"result too large (more than {MAX_RESULT_BYTES:,} bytes as Python objects by row 8)"),
    ],
    ids=["one-wide-row", "many-rows"],
)
def test_a_result_too_big_to_hold_is_one_failed_example_in_bounded_memory(
    repo_root, db, hostile, error, workers
):
    # Before: MemoryError out of the whole scoring (or, without a cap, gigabytes of the node's memory).
    code = (
        "from eval.sql import sql_metrics, execute_many\n"
        f"preds = [{hostile!r}, 'SELECT name FROM items WHERE price = 5', 'SELEC 1']\n"
        "golds = ['SELECT name FROM items', 'SELECT name FROM items WHERE price = 5', 'SELECT 1']\n"
        f"scores = sql_metrics(preds, golds, {str(db)!r}, workers={workers})\n"
        f"errors = [r.error for r in execute_many({str(db)!r}, preds, workers={workers})]\n"
        "result = {'scores': scores, 'errors': errors}"
    )
    ran = run_capped(repo_root, code)
    scores, errors = ran["result"]["scores"], ran["result"]["errors"]
    assert errors[0].startswith(error) and errors[1] is None and "syntax error" in errors[2]
    assert scores["sql_exec_accuracy"] == pytest.approx(1 / 3)
    assert scores["sql_error_rate"] == pytest.approx(2 / 3)
    # Bounded, not merely caught at the cap: the result bound plus SQLite's heap bound, and a copy of it.
    assert ran["peak_mb"] < 500, ran
