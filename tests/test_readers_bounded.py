"""Issue 38, rule 4: nothing a reader opens can hang it or eat the memory, and a torn last line never
swallows the next record (rule 2). A FIFO at a rung file hung every run of the sweep at that rung; a FIFO
lock, `.rungs` as a file or a lock as a folder crashed the job with tracebacks; a FIFO job log hung
--status and --tail; a log linked to /dev/zero grew --tail to 7.3 GB. Real FIFOs, real links, real files.

"Does not hang" is detected by a thread joined with a generous timeout: the join is the failure detector,
never the synchronisation (the call under test returns long before it in every passing run)."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from pathlib import Path

import pytest

from core.config import PruneJob
from core.files import append_json_line, read_jsonl
from core.pruning import judged, rung_file
from core.speeds import EvalSpeedRecord, append, read_eval_book
from tests.helpers import bounded_child, experiment_folder

PRUNE = PruneJob(rungs=[1], keep=0.5, sweep="sw", measured_under="m")
HANG_S = 30


def returns(call, *args):
    """`call(*args)`'s result or exception, failing the test if it is still running after HANG_S."""
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = call(*args)
        except BaseException as exc:  # handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_S)
    assert not thread.is_alive(), f"{call.__name__} hung"
    return outcome


def pruner(run_root: Path):
    from train.callbacks import PruneAtRungs

    return PruneAtRungs(run_root / "sw-a" / "train", PRUNE, "sw-a", "h", {})


def test_fifo_at_rung_file_does_not_hang_sweep(tmp_path, caplog):
    run_root = tmp_path / "runs"
    rung_file(run_root, "sw", 1).parent.mkdir(parents=True)
    os.mkfifo(rung_file(run_root, "sw", 1))
    outcome = returns(judged, run_root, "sw", "a", "h", 1, 1.0, PRUNE)
    assert isinstance(outcome.get("error"), OSError) and "1.jsonl" in str(outcome["error"])
    # The trainer's side: the run goes on unjudged, the file named in its log, no traceback.
    with caplog.at_level(logging.WARNING, "train.callbacks"):
        assert returns(pruner(run_root).judge, 1, 1.0) == {"value": None}
    assert "1.jsonl" in caplog.text and "not a regular file" in caplog.text


@pytest.mark.parametrize("junk", ["fifo lock", "rungs as a file", "lock as a folder"])
def test_junk_where_rung_records_belong_is_named_not_a_traceback(tmp_path, caplog, junk):
    run_root = tmp_path / "runs"
    lock = rung_file(run_root, "sw", 1).with_suffix(".lock")
    if junk == "rungs as a file":
        run_root.mkdir()
        (run_root / ".rungs").write_text("x")
    else:
        lock.parent.mkdir(parents=True)
        os.mkfifo(lock) if junk == "fifo lock" else lock.mkdir()
    named = ".rungs" if junk == "rungs as a file" else "1.lock"
    outcome = returns(judged, run_root, "sw", "a", "h", 1, 1.0, PRUNE)
    assert isinstance(outcome.get("error"), OSError) and named in str(outcome["error"])
    with caplog.at_level(logging.WARNING, "train.callbacks"):
        assert returns(pruner(run_root).judge, 1, 1.0) == {"value": None}
    assert named in caplog.text


def test_fifo_job_log_does_not_hang_status_or_tail(tmp_path, capsys):
    from slurm.watching.render import last_lines
    from slurm.watching.tail import print_new
    from slurm.watching.usage import given_gpus

    log = tmp_path / "123_0_log.out"
    os.mkfifo(log)
    assert returns(last_lines, str(log), 5)["value"] == [
        "(log not read: not a regular file (a FIFO, a socket or a device))"
    ]
    assert returns(print_new, str(log), ("", 0))["value"] == ("", 0)
    assert returns(given_gpus, log)["value"] is None
    assert "123_0_log.out" in capsys.readouterr().err


def test_tail_of_log_linked_to_dev_zero_is_bounded(tmp_path, capsys):
    from slurm.watching.render import last_lines
    from slurm.watching.tail import CHUNK_BYTES, print_new

    log = tmp_path / "123_0_log.out"
    log.symlink_to("/dev/zero")
    assert returns(print_new, str(log), ("", 0))["value"] == ("", 0)
    assert returns(last_lines, str(log), 5)["value"][0].startswith("(log not read")
    # A regular log larger than one poll's bound is printed a bound at a time.
    big = tmp_path / "big.out"
    with big.open("wb") as fh:
        fh.truncate(3 * CHUNK_BYTES)
    capsys.readouterr()
    assert returns(print_new, str(big), ("", 0))["value"] == (str(big), CHUNK_BYTES)
    assert len(capsys.readouterr().out) == CHUNK_BYTES


def test_fifo_at_the_speed_book_does_not_hang_the_job_and_is_named(tmp_path, capsys):
    book = tmp_path / "speeds.jsonl"
    os.mkfifo(book)
    record = EvalSpeedRecord("m", "cpu", 1, 1, 8, 1, 1.0, 0.1, 0.1, 1.0)
    assert "error" not in returns(append, book, record)
    assert "speeds.jsonl" in capsys.readouterr().err


def test_torn_last_line_of_the_speed_book_does_not_swallow_the_next_row(tmp_path):
    book = tmp_path / "speeds.jsonl"
    record = EvalSpeedRecord("m", "cpu", 1, 1, 8, 1, 1.0, 0.1, 0.1, 1.0)
    append(book, record)
    with book.open("a") as fh:
        fh.write('{"model": "killed mid-app')
    append(book, record)
    assert read_eval_book(book) == [record, record]


def test_torn_last_line_of_metrics_does_not_swallow_the_next_row_and_nan_is_strict_json(tmp_path):
    # The trainer's metrics rows go through append_json_line (train/callbacks.py RunDirectoryLog).
    metrics = tmp_path / "runs" / "e" / "s" / "metrics.jsonl"
    append_json_line(metrics, {"step": 1, "loss": 1.0}, root=tmp_path / "runs")
    with metrics.open("a") as fh:
        fh.write('{"step": 2, "lo')
    append_json_line(metrics, {"step": 3, "loss": math.nan}, root=tmp_path / "runs")
    assert [row["step"] for row in read_jsonl(metrics)] == [1, 3]
    last = metrics.read_text().splitlines()[-1]
    assert json.loads(last, parse_constant=lambda name: pytest.fail(f"bare {name}")) == {
        "step": 3,
        "loss": None,
    }


@pytest.mark.parametrize("junk", ["fifo", "folder"])
def test_fifo_or_folder_at_the_launch_lock_is_named_not_waited_on(tmp_path, repo_root, capsys, junk):
    import launch
    from tests.helpers import configs

    folder = configs(tmp_path, repo_root)
    (folder / "one.yaml").write_text(
        f"name: one\ninherits: _tiny-sql.yaml\nmodel: {{name_or_path: {repo_root / 'models' / 'tiny-llama'}}}\n"
    )
    (tmp_path / "runs").mkdir(exist_ok=True)
    lock = tmp_path / "runs" / ".launch.lock"
    os.mkfifo(lock) if junk == "fifo" else lock.mkdir()
    args = ["--all", "--config-dir", str(folder), "--backend", "local", "--no-preflight"]
    outcome = returns(launch.main, args)
    assert outcome.get("value") == 1, outcome
    assert ".launch.lock" in capsys.readouterr().err


MILLION = 1_000_000


@pytest.mark.slow
def test_report_over_a_million_line_metrics_file_runs_in_a_bounded_child(tmp_path):
    """M3: a 302 MB metrics.jsonl drove --report to 6.9 GB and MemoryError; it is streamed now, each curve
    thinned to a few thousand points (eval/report_rows.py read_metrics). Under RLIMIT_AS 1 GiB."""
    configs = experiment_folder(tmp_path)
    stage = tmp_path / "runs" / "a" / "train"
    stage.mkdir(parents=True)
    row = (  # a row as the Trainer logs it (~190 bytes): parsed whole, a million of them took gigabytes
        '{{"step": {0}, "loss": {1:.6f}, "grad_norm": 0.412345, "learning_rate": 0.000199, "epoch": 0.5123, '
        '"num_tokens": 123456789, "mean_token_accuracy": 0.734567, "gpu_util_percent": 87.5}}\n'
    )
    with (stage / "metrics.jsonl").open("w") as fh:
        fh.writelines(row.format(step, 1 + 1 / step) for step in range(1, MILLION + 1))
    done = bounded_child(["launch.py", "--report", "--config-dir", str(configs)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "runs" / "a" / "loss.png").is_file()


@pytest.mark.slow
def test_dry_run_over_a_million_pairs_runs_in_a_bounded_child(tmp_path):
    """M3: a 172 MB pairs file (4 M pairs) took 2.0 GB at --dry-run; each line is checked and let go now."""
    pairs = tmp_path / "pairs.jsonl"
    schema = "customers(id, name, city, age) | orders(id, customer_id, product_id, quantity, year) | " * 4
    with pairs.open("w") as fh:  # a text-to-SQL pair with its schema (~500 bytes)
        fh.writelines(
            f'{{"prompt": "{schema}how many orders in {n}? SQL: ", "chosen": "SELECT COUNT(*) FROM orders '
            f'WHERE year = {n}", "rejected": "SELECT COUNT(*) FROM customers WHERE age = {n}"}}\n'
            for n in range(MILLION)
        )
    configs = experiment_folder(tmp_path)
    text = (configs / "a.yaml").read_text()
    (configs / "a.yaml").write_text(
        text[: text.index("data: {")]
        + f"data: {{train: {pairs}, eval: {pairs}, format: preference}}\n"
        + "train: {method: dpo, epochs: 1, eval_every_epochs: 1}\neval: {metrics: [exact_match]}\n"
        + text[text.index("resources:") :]
    )
    done = bounded_child(["launch.py", "--all", "--config-dir", str(configs), "--dry-run"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "a/train" in done.stdout
