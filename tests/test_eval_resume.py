"""A requeued or killed eval keeps the predictions it wrote (eval/predictions.py) and ends with the files an
uninterrupted run writes: the same predictions.jsonl, the same scores."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from core.config import EvalJob
from core.rundir import RunDir
from eval.job import run_eval
from tests.train_helpers import StopAfter, make_job, model_spec, sql_data
from train.recipe import run_stage

ROOT = Path(__file__).resolve().parent.parent
FINAL = RunDir(Path(".")).predictions.name
PARTIAL = RunDir(Path(".")).partial_predictions.name
BATCH = 2  # 12 examples: 6 batches
# What differs between any two runs, interrupted or not.
RUN_BOUND = ("generation_s", "predictions_kept")


@pytest.fixture(scope="module")
def adapter(tiny, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("trained")
    assert run_stage(make_job(tiny, run_dir, max_steps=2)) == "completed"
    return run_dir / "adapter"


def eval_job(tiny, adapter: Path, out_dir: Path, **evaluation) -> EvalJob:
    return EvalJob(
        experiment="t",
        stage="s",
        model=model_spec(tiny),
        adapter={"rank": 8, "alpha": 16, "dropout": 0.0},
        data=sql_data("easy", eval_split="dev"),
        eval={"metrics": ["exact_match", "rouge"], "limit": 12, "batch_size": BATCH, "max_new_tokens": 6}
        | evaluation,
        adapter_dir=str(adapter),
        out_dir=str(out_dir),
    )


def partial_rows(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / PARTIAL).read_text().splitlines()[1:]]


@pytest.mark.slow
def test_a_killed_eval_keeps_its_predictions_and_ends_as_an_uninterrupted_one(tiny, adapter, tmp_path):
    straight_dir, killed_dir = tmp_path / "straight", tmp_path / "killed"
    straight = run_eval(eval_job(tiny, adapter, straight_dir))
    job = eval_job(tiny, adapter, killed_dir)
    config = tmp_path / "eval.json"
    config.write_text(job.model_dump_json())
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from tests.train_helpers import killed_after; killed_after({str(config)!r}, 3)",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    assert len(partial_rows(killed_dir)) == 3 * BATCH
    assert not (killed_dir / FINAL).exists() and not (killed_dir / "results.json").exists()
    # A kill in the middle of an append cannot be timed from a test; its aftermath is made by hand.
    with (killed_dir / PARTIAL).open("a") as fh:
        fh.write('{"id": 11, "input": "customers(id, na')

    resumed = run_eval(job)
    assert resumed["predictions_kept"] == 3 * BATCH
    assert (killed_dir / FINAL).read_text() == (straight_dir / FINAL).read_text()
    assert {k: v for k, v in resumed.items() if k not in RUN_BOUND} == {
        k: v for k, v in straight.items() if k not in RUN_BOUND
    }
    assert not (killed_dir / PARTIAL).exists()


def test_a_stopped_eval_generates_only_the_batches_it_had_not_made(tiny, adapter, tmp_path):
    job = eval_job(tiny, adapter, tmp_path)
    assert run_eval(job, StopAfter(2)) is None  # asked before the first batch and after each: 2 batches
    rows = partial_rows(tmp_path)
    assert len(rows) == 2 * BATCH
    # Mark one kept prediction: a resumed run that generated it again would overwrite the mark.
    marked = rows[0]["id"]
    lines = (tmp_path / PARTIAL).read_text().splitlines(keepends=True)
    lines[1] = json.dumps(rows[0] | {"prediction": "kept, not generated again"}) + "\n"
    (tmp_path / PARTIAL).write_text("".join(lines))

    results = run_eval(job)
    assert results["predictions_kept"] == 2 * BATCH
    predictions = [json.loads(line) for line in (tmp_path / FINAL).read_text().splitlines()]
    assert [row["id"] for row in predictions] == list(range(12))
    assert predictions[marked]["prediction"] == "kept, not generated again"


def test_predictions_of_other_settings_are_not_resumed(tiny, adapter, tmp_path):
    assert run_eval(eval_job(tiny, adapter, tmp_path), StopAfter(2)) is None
    assert len(partial_rows(tmp_path)) == 2 * BATCH
    # Longer outputs: the kept ones were cut at 6 tokens and would be wrong.
    assert run_eval(eval_job(tiny, adapter, tmp_path, max_new_tokens=7))["predictions_kept"] == 0


def test_a_generating_eval_says_how_far_it_is_every_30_s_not_minutes_of_silence():
    """Before: nothing in an eval job's log between loading the model and its results. A clock by hand:
    200 answers, 50 kept from an earlier attempt; the rate counts this run's answers only."""
    from eval.job import Progress

    ticks = iter([0.0, 10.0, 31.0, 40.0, 75.0])
    progress = Progress(total=200, kept=50, clock=lambda: next(ticks))
    assert progress.line(60) is None  # 10 s in: too soon
    assert progress.line(112) == "generated 112/200 answers (56%), 2.00/s, ~44 s left"  # 62 in 31 s
    assert progress.line(130) is None  # 9 s after the last line
    assert progress.line(200) == "generated 200/200 answers (100%), 2.00/s"  # the last batch always says
