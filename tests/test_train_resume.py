"""Stop and resume lose nothing: the final adapter equals an uninterrupted run's, metrics continue without
duplicates, and a torn newest checkpoint falls back to the previous one.

The stop here is the trainer's own flag (what the job wrapper sets on SLURM's signal); the real signal path
through SLURM is exercised in test_cluster_faults.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.train_helpers import StopAfter, assert_same_adapter, make_job, read_jsonl, sql_data
from train.checkpoints import MARKER, latest_valid_checkpoint, step_of
from train.recipe import run_stage

pytestmark = pytest.mark.slow  # trains or launches for seconds: make test-fast leaves it out


def resumable_job(tiny, run_dir: Path, method: str = "lora"):
    # 85 examples / 8 = 11 steps an epoch; eval every epoch; saves every 4 steps and at each eval.
    return make_job(
        tiny,
        run_dir,
        adapter={"method": method},
        data=sql_data("easy", eval_split="dev"),
        max_steps=None,
        epochs=2,
        eval_every_epochs=1,
        save_every_steps=4,
        logging_steps=2,
    )


# Stopping in the second epoch covers the reshuffle of a resumed epoch; QLoRA covers the 4-bit path.
@pytest.mark.parametrize(("method", "stop_after"), [("lora", 14), ("qlora", 6)])
def test_interrupted_run_resumes_to_the_same_adapter(tiny, tmp_path, method, stop_after):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    assert run_stage(resumable_job(tiny, straight, method)) == "completed"
    assert run_stage(resumable_job(tiny, interrupted, method), StopAfter(stop_after)) == "interrupted"
    assert not (interrupted / "adapter").exists() and not (interrupted / "summary.json").exists()
    assert step_of(latest_valid_checkpoint(interrupted / "checkpoints")) == stop_after + 1
    assert run_stage(resumable_job(tiny, interrupted, method)) == "completed"

    assert_same_adapter(straight, interrupted)
    rows, expected = read_jsonl(interrupted / "metrics.jsonl"), read_jsonl(straight / "metrics.jsonl")
    for kind in ("loss", "eval_loss"):
        steps = [r["step"] for r in rows if kind in r]
        assert steps == sorted(set(steps)) == [r["step"] for r in expected if kind in r], kind
    summary = json.loads((interrupted / "summary.json").read_text())
    assert summary["resumed_from"].endswith(f"checkpoint-{stop_after + 1}")
    assert summary["global_step"] == json.loads((straight / "summary.json").read_text())["global_step"]


def test_torn_newest_checkpoint_falls_back_to_the_previous_one(tiny, tmp_path):
    # A kill -9 in the middle of a save cannot be timed from a test; its aftermath is made by hand: a newer
    # checkpoint without the commit marker and with a truncated state file.
    straight, run_dir = tmp_path / "straight", tmp_path / "run"
    assert run_stage(resumable_job(tiny, straight)) == "completed"
    assert run_stage(resumable_job(tiny, run_dir), StopAfter(7)) == "interrupted"
    checkpoints = run_dir / "checkpoints"
    good = latest_valid_checkpoint(checkpoints)
    torn = checkpoints / f"checkpoint-{step_of(good) + 3}"
    shutil.copytree(good, torn)
    (torn / MARKER).unlink()
    (torn / "trainer_state.json").write_text('{"global_step": 1')
    with (run_dir / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 11, "loss": 1.0')  # a row cut by the same kill

    assert run_stage(resumable_job(tiny, run_dir)) == "completed"
    assert json.loads((run_dir / "summary.json").read_text())["resumed_from"] == str(good)
    assert_same_adapter(straight, run_dir)
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    assert steps == sorted(set(steps))
