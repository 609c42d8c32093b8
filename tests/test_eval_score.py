"""`python -m eval score` as a user runs it: real files, a real process, exit codes and messages."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys

import pytest

from eval.score import score
from tests.helpers import dry_run, experiment_folder


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def run_score(repo_root, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "eval", "score", *args],
        cwd=repo_root,
        capture_output=True,
        text=True,
        check=False,
    )


def pair_files(tmp_path, preds: dict, refs: dict) -> list[str]:
    p = write_jsonl(tmp_path / "pred.jsonl", [{"id": k, "prediction": v} for k, v in preds.items()])
    r = write_jsonl(tmp_path / "ref.jsonl", [{"id": k, "reference": v} for k, v in refs.items()])
    return ["--predictions", p, "--references", r]


def test_text_metrics_written_to_json(repo_root, tmp_path):
    # Predictions in another order than references: rows pair up by id, not by line.
    preds = {"b": "the cat sat on the mat", "a": "  Hello   World "}
    refs = {"a": "hello world", "b": "the cat is on mat"}
    out = tmp_path / "out" / "results.json"
    done = run_score(
        repo_root,
        *pair_files(tmp_path, preds, refs),
        "--metrics",
        "exact_match,rouge_l,bleu",
        "--out",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())
    assert set(results) == {"n", "exact_match", "rouge_l", "bleu"}
    assert results["n"] == 2
    assert results["exact_match"] == pytest.approx(1 / 2)
    assert results["rouge_l"] == pytest.approx((1 + 8 / 11) / 2)  # LCS 4 of 6 and 5 tokens: F 8/11
    assert 0.0 < results["bleu"] < 1.0
    assert "rouge_l" in done.stdout and "0.8636" in done.stdout  # the table shows it too


SHOP = """
CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT, price INTEGER);
INSERT INTO items VALUES (1, 'apple', 3), (2, 'pear', 5), (3, 'fig', 5), (4, 'kiwi', 2);
"""


def make_db(path, script: str = SHOP):
    conn = sqlite3.connect(path)
    conn.executescript(script)
    conn.close()
    return path


def test_sql_exec_through_the_cli(repo_root, tmp_path):
    db = make_db(tmp_path / "shop.sqlite")
    preds = {
        1: "SELECT name FROM items WHERE price = 5",
        2: "SELECT name FROM items WHERE price <= 3",
        3: "SELEC",
    }
    refs = {
        1: "SELECT name FROM items WHERE price = 5",
        2: "SELECT name FROM items WHERE price >= 3",  # overlap 1 of 2 and 3 rows: F1 2/5
        3: "SELECT name FROM items",
    }
    out = tmp_path / "results.json"
    args = ["--metrics", "sql_exec", "--db", str(db), "--sql-timeout-s", "1", "--out", str(out)]
    done = run_score(repo_root, *pair_files(tmp_path, preds, refs), *args)
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())
    assert results.pop("sql_gold_errors") == {"count": 0, "ids": []}
    assert results == pytest.approx(
        {"n": 3, "sql_exec_accuracy": 1 / 3, "sql_record_f1": (1 + 2 / 5) / 3, "sql_error_rate": 1 / 3}
    )


def assert_user_error(done: subprocess.CompletedProcess, *fragments: str) -> None:
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: ")
    assert "Traceback" not in done.stderr
    for fragment in fragments:
        assert fragment in done.stderr


def test_missing_and_extra_ids_are_named(repo_root, tmp_path):
    out = tmp_path / "results.json"
    files = pair_files(tmp_path, {1: "a", 2: "b", 99: "z"}, {1: "a", 2: "b", 3: "c"})
    done = run_score(repo_root, *files, "--out", str(out))
    assert_user_error(done, "have no prediction: 3", "not in", ": 99")
    assert not out.exists()


def test_many_missing_ids_show_the_first_few_and_a_count(repo_root, tmp_path):
    refs = {i: "x" for i in range(1, 11)}
    done = run_score(repo_root, *pair_files(tmp_path, {1: "x"}, refs))
    assert_user_error(done, "9 id(s)", "2, 3, 4, 5, 6 and 4 more")


def test_malformed_json_line_names_file_and_line(repo_root, tmp_path):
    args = pair_files(tmp_path, {1: "a", 2: "b"}, {1: "a", 2: "b"})
    pred = tmp_path / "pred.jsonl"
    lines = pred.read_text().splitlines()
    pred.write_text(f'{lines[0]}\n{{"id": 2, "prediction": \n')
    assert_user_error(run_score(repo_root, *args), f"{pred}:2:", "not valid JSON")


@pytest.mark.slow
def test_row_without_the_field_and_duplicate_ids(repo_root, tmp_path):
    args = pair_files(tmp_path, {1: "a"}, {1: "a"})
    ref = tmp_path / "ref.jsonl"
    ref.write_text('{"id": 1, "reference": "a"}\n\n{"id": 1, "reference": "b"}\n')
    assert_user_error(run_score(repo_root, *args), f"{ref}:3:", "appears twice", "first on line 1")
    ref.write_text('{"id": 1, "text": "a"}\n')
    assert_user_error(run_score(repo_root, *args), f"{ref}:1:", '"reference"')


@pytest.mark.slow
def test_metric_mistakes(repo_root, tmp_path):
    args = pair_files(tmp_path, {1: "a"}, {1: "a"})
    assert_user_error(run_score(repo_root, *args, "--metrics", "sql_exec"), "--metrics", "needs --db")
    assert_user_error(run_score(repo_root, *args, "--metrics", "blue"), "'blue'", "did you mean 'bleu'")
    absent = tmp_path / "nope.jsonl"
    assert_user_error(
        run_score(repo_root, "--predictions", str(absent), *args[2:]), f"{absent}: no such file"
    )


@pytest.mark.slow
def test_database_mistakes(repo_root, tmp_path):
    args = [*pair_files(tmp_path, {1: "SELECT 1"}, {1: "SELECT 1"}), "--metrics", "sql_exec", "--db"]
    missing = tmp_path / "absent.sqlite"
    assert_user_error(run_score(repo_root, *args, str(missing)), f"{missing}: no such file")
    notes = tmp_path / "notes.txt"
    notes.write_text("not a database, but long enough to have a header " * 10)
    assert_user_error(run_score(repo_root, *args, str(notes)), f"{notes}: not a readable SQLite database")


def test_failing_reference_query_is_named_and_left_out(repo_root, tmp_path):
    # Today: exit 2 and no scores at all. Now the other examples are scored and the broken id is named.
    db = tmp_path / "other.sqlite"
    make_db(db, "CREATE TABLE other (x)")
    args = pair_files(
        tmp_path,
        {"q1": "SELECT 1", "q2": "SELECT 1", "q3": "SELECT 3"},
        {"q1": "SELECT 1", "q2": "SELECT * FROM nope", "q3": "SELECT 2"},
    )
    out = tmp_path / "results.json"
    done = run_score(repo_root, *args, "--metrics", "sql_exec", "--db", str(db), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith("warning: 1 of 3 gold queries fail on") and "Traceback" not in done.stderr
    assert 'id "q2": no such table: nope' in done.stderr and "data bug" in done.stderr
    results = json.loads(out.read_text())
    assert results["sql_gold_errors"] == {"count": 1, "ids": ["q2"]}
    # Scored over q1 (right) and q3 (wrong) only: the denominator is 2, not 3.
    assert results["sql_exec_accuracy"] == 0.5 and results["n"] == 3
    assert not list(tmp_path.glob(".results.json.*"))  # written atomically: no temporary file left over


def test_a_database_without_tables_is_refused_by_name(repo_root, tmp_path):
    # Before: a 0-byte file was taken for a database, every gold query failed, and exec accuracy 0.0 with
    # exit 0 read as a real score.
    args = [*pair_files(tmp_path, {1: "SELECT 1"}, {1: "SELECT 1"}), "--metrics", "sql_exec", "--db"]
    empty = tmp_path / "shop.db"
    empty.touch()
    out = tmp_path / "results.json"
    done = run_score(repo_root, *args, str(empty), "--out", str(out))
    assert_user_error(done, f"{empty}: no tables in it (the file is empty, 0 bytes)", "check --db")
    assert not out.exists()


def test_no_scorable_example_gives_no_sql_score_and_fails(repo_root, tmp_path):
    # A database with tables, but not the one the queries were written for: every gold query fails.
    db = make_db(tmp_path / "other.sqlite", "CREATE TABLE other (x)")
    preds = {"q1": "SELECT name FROM items", "q2": "SELECT 1"}
    refs = {"q1": "SELECT name FROM items", "q2": "SELECT count(*) FROM items"}
    out = tmp_path / "results.json"
    metrics = ["--metrics", "sql_exec,exact_match", "--db", str(db), "--out", str(out)]
    done = run_score(repo_root, *pair_files(tmp_path, preds, refs), *metrics)
    reason = f'no example could be scored: all 2 gold queries fail on {db} (id "q1": no such table: items)'
    assert_user_error(done, f"error: sql_exec: {reason}; is that the database")
    results = json.loads(out.read_text())  # written all the same: it says what is missing and why
    assert results == {
        "n": 2,
        "exact_match": 0.5,
        "sql_gold_errors": {"count": 2, "ids": ["q1", "q2"]},
        "sql_unscored_reason": reason,
    }


HOSTILE = "SELECT " + ", ".join(["zeroblob(9e6)"] * 300)  # one row of 2.7 GB
CAP_BYTES = 2**30  # the address space of the scoring process here: what a node or a container would give


def test_a_hostile_prediction_is_one_wrong_example_and_the_others_score(repo_root, tmp_path):
    # Before: MemoryError, a traceback and no scores at all (or, uncapped, gigabytes of the node's memory).
    db = make_db(tmp_path / "shop.sqlite")
    preds = {1: "SELECT name FROM items WHERE price = 5", 2: HOSTILE, 3: "SELECT name FROM items"}
    refs = {
        1: "SELECT name FROM items WHERE price = 5",
        2: "SELECT name FROM items",
        3: "SELECT name FROM items",
    }
    out = tmp_path / "results.json"
    argv = [*pair_files(tmp_path, preds, refs), "--metrics", "sql_exec", "--db", str(db), "--out", str(out)]
    capped = (
        f"import resource, sys; resource.setrlimit(resource.RLIMIT_AS, ({CAP_BYTES}, {CAP_BYTES})); "
        f"from eval.__main__ import main; sys.exit(main(['score', *{argv!r}]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", capped], cwd=repo_root, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())
    assert results["sql_exec_accuracy"] == pytest.approx(2 / 3)
    assert results["sql_error_rate"] == pytest.approx(1 / 3)


def test_an_empty_eval_db_is_refused_before_anything_is_queued(tmp_path, capsys):
    empty = tmp_path / "shop.db"
    empty.touch()
    code, err = dry_run(experiment_folder(tmp_path, db=empty), capsys)
    assert code == 2 and "Traceback" not in err
    assert f"a.yaml:6: eval.db: {empty}: no tables in it (the file is empty, 0 bytes)" in err, err
    assert "1 problem(s)" in err, err  # that one alone: the rest of the experiment is valid
    assert not (tmp_path / "runs").exists()


def test_score_function():
    assert score(["A  b"], ["a b"], ["exact_match"]) == {"n": 1, "exact_match": 1.0}
    with pytest.raises(ValueError, match="sql_exec needs db"):
        score(["SELECT 1"], ["SELECT 1"], ["sql_exec"])
    with pytest.raises(ValueError, match="unknown metric"):
        score(["a"], ["a"], ["accuracy"])


def test_scoring_modules_do_not_import_torch(repo_root):
    code = (
        "import sys, eval.__main__, eval.score, eval.sql, eval.metrics, eval.bertscore; "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "False"


def test_an_eval_job_that_scores_nothing_fails_and_a_rerun_only_scores(tiny, tmp_path, repo_root):
    from core.config import EvalJob
    from eval.job import run_eval
    from eval.score import UnscoredError
    from tests.train_helpers import make_job, model_spec, sql_data
    from train.recipe import run_stage

    assert run_stage(make_job(tiny, tmp_path, max_steps=1)) == "completed"
    wrong = make_db(tmp_path / "other.sqlite", "CREATE TABLE other (x)")
    job = EvalJob(
        experiment="t",
        stage="s",
        model=model_spec(tiny),
        adapter={"rank": 8, "alpha": 16, "dropout": 0.0},
        data=sql_data("easy", eval_split="dev"),
        eval={"metrics": ["sql_exec"], "db": str(wrong), "limit": 4, "max_new_tokens": 4},
        adapter_dir=str(tmp_path / "adapter"),
        out_dir=str(tmp_path / "eval"),
    )
    reason = f"no example could be scored: all 4 gold queries fail on {wrong}"
    with pytest.raises(UnscoredError, match=re.escape(reason)):
        run_eval(job)
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert "sql_exec_accuracy" not in results and "no such table" in results["sql_unscored_reason"]
    # The predictions are kept: with the right database the same job scores them without generating again.
    right = job.model_copy(
        update={"eval": job.eval.model_copy(update={"db": str(repo_root / "data/demo/shop.db")})}
    )
    results = run_eval(right)
    assert results["predictions_kept"] == 4 and results["sql_gold_errors"]["count"] == 0
    assert 0.0 <= results["sql_exec_accuracy"] <= 1.0


def test_eval_score_gives_a_query_as_long_as_an_eval_job_does():
    # Before: 2.0 s in `python -m eval score` (and eval/sql.py's defaults), 5.0 s in an eval job
    # (eval.sql_timeout_s): a query taking 3 s was right in one and wrong in the other.
    import argparse
    import inspect

    from core.config import EvalSpec
    from eval import score as score_module
    from eval.sql import execute_many, sql_metrics

    parser = argparse.ArgumentParser()
    score_module.add_parser(parser.add_subparsers())
    cli = parser.parse_args(["score", "--predictions", "p.jsonl", "--references", "r.jsonl"])
    job = EvalSpec().sql_timeout_s
    assert cli.sql_timeout_s == job
    assert inspect.signature(score).parameters["sql_timeout_s"].default == job
    for function in (sql_metrics, execute_many):
        assert inspect.signature(function).parameters["timeout_s"].default == job, function.__name__
