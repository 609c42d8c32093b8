"""Benchmark of SQL execution scoring: serial vs the process pool, and the time limit on a runaway query.

    python -m bench.sql_exec [--json] [--workers N] [--timeout-s S]

Builds its own deterministic demo database in a temporary folder, runs 466 queries (the size of a real dev
set: selects, joins, aggregates, a few invalid ones and one endless recursive CTE) both ways and prints
queries/s and the speed-up. With --json the last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import tempfile
import time
from pathlib import Path

from eval.sql import TIMEOUT, ReadOnlyDB, default_workers, execute_many, execute_serial

N_QUERIES = 466
RUNAWAY = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
INVALID = [
    "SELEC name FROM employees",
    "SELECT name FROM employes",
    "SELECT nom FROM employees",
    "SELECT name FROM employees WHERE",
    "DROP TABLE employees",
]


def build_db(path: Path, seed: int = 0) -> None:
    """20 departments, 4,000 employees, 600 projects, 12,000 assignments; no indexes beyond the keys,
    so joins make SQLite work a little, as on a real schema."""
    rng = random.Random(seed)
    conn = sqlite3.connect(path)
    conn.executescript(
        """
        CREATE TABLE departments (id INTEGER PRIMARY KEY, name TEXT, city TEXT, budget REAL);
        CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT, dept_id INTEGER, salary REAL, hired INTEGER);
        CREATE TABLE projects (id INTEGER PRIMARY KEY, title TEXT, dept_id INTEGER, cost REAL);
        CREATE TABLE assignments (emp_id INTEGER, project_id INTEGER, hours INTEGER);
        """
    )
    cities = ["Lyon", "Oslo", "Porto", "Kyoto", "Quito"]
    conn.executemany(
        "INSERT INTO departments VALUES (?, ?, ?, ?)",
        [(i, f"dept{i}", rng.choice(cities), rng.randint(1, 100) * 1e4) for i in range(20)],
    )
    conn.executemany(
        "INSERT INTO employees VALUES (?, ?, ?, ?, ?)",
        [
            (i, f"emp{i}", rng.randrange(20), rng.randint(30, 200) * 1e3, rng.randint(1990, 2024))
            for i in range(4000)
        ],
    )
    conn.executemany(
        "INSERT INTO projects VALUES (?, ?, ?, ?)",
        [(i, f"proj{i}", rng.randrange(20), rng.randint(1, 500) * 1e3) for i in range(600)],
    )
    conn.executemany(
        "INSERT INTO assignments VALUES (?, ?, ?)",
        [(rng.randrange(4000), rng.randrange(600), rng.randint(1, 40)) for _ in range(12000)],
    )
    conn.commit()
    conn.close()


TEMPLATES = [
    # simple selects
    "SELECT name, salary FROM employees WHERE dept_id = {d} AND hired > {y} ORDER BY salary DESC LIMIT 20",
    "SELECT count(*) FROM employees WHERE salary BETWEEN {s} AND {s} + 40000",
    "SELECT title FROM projects WHERE cost > {c} ORDER BY cost",
    # joins
    "SELECT e.name, d.name FROM employees e JOIN departments d ON d.id = e.dept_id WHERE d.city = '{city}'",
    "SELECT p.title, sum(a.hours) FROM assignments a JOIN projects p ON p.id = a.project_id"
    " WHERE p.dept_id = {d} GROUP BY p.id ORDER BY 2 DESC LIMIT 10",
    "SELECT e.name, count(*) FROM employees e JOIN assignments a ON a.emp_id = e.id"
    " JOIN projects p ON p.id = a.project_id WHERE p.cost > {c} GROUP BY e.id HAVING count(*) > 1",
    # aggregates and subqueries
    "SELECT dept_id, avg(salary), max(salary) FROM employees WHERE hired >= {y} GROUP BY dept_id",
    "SELECT d.city, sum(e.salary) FROM departments d JOIN employees e ON e.dept_id = d.id GROUP BY d.city",
    "SELECT name FROM employees WHERE salary > (SELECT avg(salary) FROM employees WHERE dept_id = {d})"
    " AND dept_id = {d}",
    "SELECT count(DISTINCT emp_id) FROM assignments WHERE project_id IN"
    " (SELECT id FROM projects WHERE dept_id = {d})",
]


def make_queries(seed: int = 0) -> list[str]:
    """N_QUERIES queries: templates with random parameters, the invalid ones spread out, one runaway."""
    rng = random.Random(seed)
    cities = ["Lyon", "Oslo", "Porto", "Kyoto", "Quito"]
    queries = [
        rng.choice(TEMPLATES).format(
            d=rng.randrange(20),
            y=rng.randint(1990, 2024),
            s=rng.randint(30, 160) * 1e3,
            c=rng.randint(1, 500) * 1e3,
            city=rng.choice(cities),
        )
        for _ in range(N_QUERIES - len(INVALID) - 1)
    ]
    for offset, bad in enumerate(INVALID):
        queries.insert(37 + offset * 83, bad)
    queries.insert(N_QUERIES // 3, RUNAWAY)
    return queries


def timed(run) -> tuple[list, float]:
    start = time.perf_counter()
    results = run()
    return results, time.perf_counter() - start


def compare(db: Path, queries: list[str], timeout_s: float, workers: int) -> dict:
    """Wall time of the serial path and of the pool (its start-up included: the eval job pays it too)."""
    serial, serial_s = timed(lambda: execute_serial(db, queries, timeout_s))
    pooled, pooled_s = timed(lambda: execute_many(db, queries, timeout_s, workers=workers))
    assert pooled == serial, "the pool and the serial path disagree"
    return {
        "queries": len(queries),
        "errors": sum(r.error is not None for r in serial),
        "timeouts": sum(r.error == TIMEOUT for r in serial),
        "serial_s": round(serial_s, 3),
        "pool_s": round(pooled_s, 3),
        "serial_qps": round(len(queries) / serial_s, 1),
        "pool_qps": round(len(queries) / pooled_s, 1),
        "speedup": round(serial_s / pooled_s, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sql_exec", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    parser.add_argument("--workers", type=int, default=default_workers(), help="pool size (default: CPUs)")
    parser.add_argument("--timeout-s", type=float, default=2.0, help="per-query time limit")
    args = parser.parse_args(argv)
    queries = make_queries()
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "demo.sqlite"
        build_db(db)
        runaway = ReadOnlyDB(db)
        cut, runaway_s = timed(lambda: runaway.execute(RUNAWAY, args.timeout_s))
        runaway.close()
        figures = {
            "workers": args.workers,
            "timeout_s": args.timeout_s,
            "runaway_s": round(runaway_s, 3),
            "runaway_error": cut.error,
            "all": compare(db, queries, args.timeout_s, args.workers),
            # Without the runaway, whose time limit otherwise dominates both wall times.
            "no_runaway": compare(db, [q for q in queries if q != RUNAWAY], args.timeout_s, args.workers),
        }
    report(figures)
    if args.json:
        print(json.dumps(figures))
    return 0


def report(figures: dict) -> None:
    print(f"pool of {figures['workers']} workers, time limit {figures['timeout_s']} s per query")
    for name, title in (("all", "all queries"), ("no_runaway", "without the runaway")):
        f = figures[name]
        print(f"{title}: {f['queries']} queries, {f['errors']} errors ({f['timeouts']} timeout)")
        print(f"  serial: {f['serial_s']:6.2f} s {f['serial_qps']:8.1f} queries/s")
        print(f"  pool:   {f['pool_s']:6.2f} s {f['pool_qps']:8.1f} queries/s   speed-up {f['speedup']:.2f}x")
    print(f"runaway CTE alone: cut after {figures['runaway_s']:.2f} s, error: {figures['runaway_error']}")


if __name__ == "__main__":
    raise SystemExit(main())
