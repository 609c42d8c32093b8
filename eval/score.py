"""Scoring: `score()` for the eval job, and the `python -m eval score` subcommand over two JSONL files.

Prediction rows are {"id": ..., "prediction": "..."}, reference rows {"id": ..., "reference": "..."}; rows
pair up by id. A user mistake (missing file, bad line, unmatched ids, unknown metric, a database without
tables) is one line on stderr, `error: <file>: <what> (hint)`, and exit code 2, never a traceback. So is a
metric that could score no example (every gold query fails: the wrong database); the results written
then leave that metric out and say why.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from core.databases import NotADatabaseError, check_database
from core.files import write_atomic
from core.names import DEFAULT_METRICS, METRICS, SCORE_KEYS, SQL_TIMEOUT_S, TEXT_METRICS, missing_inputs
from eval.bertscore import BertScoreError
from eval.metrics import text_metrics
from eval.sql import sql_metrics

# The order results are written and shown in (eval/report_rows.py lists its columns in the same order).
RESULT_KEYS = ("n", *SCORE_KEYS, "sql_gold_errors", "sql_unscored_reason")
ID_TYPES = (str, int)


class ScoreError(Exception):
    def __init__(self, file: str | os.PathLike, what: str, hint: str = ""):
        super().__init__(f"{file}: {what}" + (f" ({hint})" if hint else ""))


class UnscoredError(RuntimeError):
    """A metric asked for scored no example: results without it are not an eval's results."""


def fail_if_unscored(results: dict) -> None:
    """Raises UnscoredError when results leave a requested metric out (sql_exec whose every gold query
    failed): a job or command that ends here must fail, not pass for a score of 0."""
    reason = results.get("sql_unscored_reason")
    if reason:
        raise UnscoredError(f"sql_exec: {reason}; is that the database these queries were written for?")


def score(
    preds: list[str],
    refs: list[str],
    metrics: list[str],
    db: str | None = None,
    sql_timeout_s: float = SQL_TIMEOUT_S,
    ids: list | None = None,
    bertscore_model: str | None = None,
    bertscore_rescale: bool = False,
) -> dict:
    """Every requested metric (fractions in [0, 1]) and n. sql_exec runs both query lists against db; an
    example whose reference query fails is left out of the sql metrics and listed (by `ids`, default its
    position) in sql_gold_errors, with a logged warning: one data bug does not void a whole eval. When
    every one fails the sql scores are absent and sql_unscored_reason says why (fail_if_unscored).
    bertscore scores with bertscore_model (eval/bertscore.py)."""
    unknown = [name for name in metrics if name not in METRICS]
    if unknown:
        raise ValueError(f"unknown metric(s) {', '.join(unknown)}; valid: {', '.join(METRICS)}")
    for metric, name, what in missing_inputs(metrics, {"db": db, "bertscore_model": bertscore_model}):
        raise ValueError(f"metric {metric} needs {name}, {what}")
    results: dict[str, float | int] = {"n": len(refs)}
    text = [name for name in metrics if name in TEXT_METRICS]
    if text:
        results.update(text_metrics(preds, refs, text))
    if "sql_exec" in metrics:
        results.update(sql_metrics(preds, refs, db, sql_timeout_s, ids=ids))
    if "bertscore" in metrics:
        from eval.bertscore import bertscore_f1  # torch: only when asked for

        results["bertscore_f1"] = bertscore_f1(preds, refs, bertscore_model, rescale=bertscore_rescale)
    return {key: results[key] for key in RESULT_KEYS if key in results}


def parse_metrics(text: str, db: str | None, bertscore_model: str | None = None) -> list[str]:
    metrics = [name.strip() for name in text.split(",") if name.strip()]
    if not metrics:
        raise ScoreError("--metrics", "no metric named", f"choose from {', '.join(METRICS)}")
    for name in metrics:
        if name not in METRICS:
            close = difflib.get_close_matches(name, METRICS, n=1)
            guess = f"; did you mean '{close[0]}'?" if close else ""
            raise ScoreError("--metrics", f"unknown metric '{name}'", f"valid: {', '.join(METRICS)}{guess}")
    for metric, name, what in missing_inputs(metrics, {"db": db, "bertscore_model": bertscore_model}):
        raise ScoreError("--metrics", f"{metric} needs --{name.replace('_', '-')}", what)
    if db:
        check_db(db)
    return metrics


def check_db(db: str) -> None:
    try:
        check_database(db)
    except FileNotFoundError:
        raise ScoreError(db, "no such file", "--db takes the SQLite file the queries run against") from None
    except NotADatabaseError as exc:
        raise ScoreError(db, exc.reason, "check --db") from None


def parse_row(line: str, field: str) -> tuple[str | int, str]:
    """(id, text) of one JSONL line; ValueError says what is wrong with it."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc.msg} at column {exc.colno}") from None
    shape = f'each row is {{"id": ..., "{field}": "..."}}'
    if not isinstance(row, dict) or "id" not in row or field not in row:
        raise ValueError(f'not a row with "id" and "{field}" ({shape})')
    if not isinstance(row["id"], ID_TYPES) or isinstance(row["id"], bool):
        raise ValueError(f"id {json.dumps(row['id'])} is not a string or an integer")
    if not isinstance(row[field], str):
        raise ValueError(f'"{field}" is {json.dumps(row[field])[:40]}, not a string')
    return row["id"], row[field]


def read_jsonl(path: Path, field: str) -> dict[str | int, str]:
    """id -> text, in file order; blank lines are skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ScoreError(path, "no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ScoreError(path, f"cannot read it: {exc}") from None
    rows: dict[str | int, str] = {}
    first_seen: dict[str | int, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row_id, text = parse_row(line, field)
        except ValueError as exc:
            raise ScoreError(f"{path}:{number}", str(exc), "one JSON object per line") from None
        if row_id in rows:
            what = f"id {json.dumps(row_id)} appears twice"
            raise ScoreError(f"{path}:{number}", what, f"first on line {first_seen[row_id]}")
        rows[row_id], first_seen[row_id] = text, number
    return rows


def few(ids: list, shown: int = 5) -> str:
    names = ", ".join(json.dumps(i) for i in ids[:shown])
    return names + (f" and {len(ids) - shown} more" if len(ids) > shown else "")


def pair_by_id(
    preds: dict, refs: dict, pred_file: Path, ref_file: Path
) -> tuple[list[str | int], list[str], list[str]]:
    """(ids, predictions, references) in the references' order; every id must be in both files."""
    missing = [i for i in refs if i not in preds]
    extra = [i for i in preds if i not in refs]
    problems = []
    if missing:
        problems.append(f"{len(missing)} id(s) of {ref_file} have no prediction: {few(missing)}")
    if extra:
        problems.append(f"{len(extra)} id(s) are not in {ref_file}: {few(extra)}")
    if problems:
        raise ScoreError(pred_file, "; ".join(problems), "both files must hold the same ids")
    ids = list(refs)
    return ids, [preds[i] for i in ids], [refs[i] for i in ids]


def score_files(args: argparse.Namespace) -> dict[str, float | int]:
    metrics = parse_metrics(args.metrics, args.db, args.bertscore_model)
    ids, preds, refs = pair_by_id(
        read_jsonl(args.predictions, "prediction"),
        read_jsonl(args.references, "reference"),
        args.predictions,
        args.references,
    )
    try:
        results = score(
            preds,
            refs,
            metrics,
            args.db,
            args.sql_timeout_s,
            ids=ids,
            bertscore_model=args.bertscore_model,
            bertscore_rescale=args.bertscore_rescale,
        )
    except BertScoreError as exc:
        raise ScoreError("--bertscore-model", str(exc)) from None
    if args.out:
        write_json(args.out, results)
    return results


def write_json(path: Path, results: dict) -> None:
    try:
        write_atomic(path, json.dumps(results, indent=2) + "\n")
    except OSError as exc:
        raise ScoreError(path, f"cannot write it: {exc.strerror}") from None


def results_table(results: dict[str, float | int]) -> Table:
    table = Table(title=f"scores over {results['n']} examples")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in results.items():
        if isinstance(value, float):
            table.add_row(key, f"{value:.4f}")
    return table


def positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def add_parser(subparsers) -> None:
    """Registers `score` on the CLI's subcommands."""
    parser = subparsers.add_parser("score", help="score predictions against references (JSONL, by id)")
    parser.add_argument("--predictions", type=Path, required=True, help='JSONL of {"id", "prediction"}')
    parser.add_argument("--references", type=Path, required=True, help='JSONL of {"id", "reference"}')
    parser.add_argument(
        "--metrics", default=",".join(DEFAULT_METRICS), help=f"comma-separated, among {', '.join(METRICS)}"
    )
    parser.add_argument("--db", help="SQLite file for sql_exec (opened read-only)")
    parser.add_argument("--bertscore-model", help="for bertscore: a local model folder or a hub id")
    parser.add_argument(
        "--bertscore-rescale",
        action="store_true",
        help="rescale bertscore with bert-score's baseline (hub ids it has one for, e.g. roberta-large)",
    )
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    parser.add_argument(
        "--sql-timeout-s",
        type=positive_seconds,
        default=SQL_TIMEOUT_S,
        help=f"per query (default {SQL_TIMEOUT_S:g}, as an eval job)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # A failing reference query is a warning here as in the eval job (eval/sql.py logs it): the other
    # examples are still scored, and the ids to fix are named.
    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s")
    try:
        results = score_files(args)
    except ScoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    Console(width=max(100, Console(markup=False).width), markup=False).print(results_table(results))
    try:
        fail_if_unscored(results)  # after --out is written: it says which metric is missing and why
    except UnscoredError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
