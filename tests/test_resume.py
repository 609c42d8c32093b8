"""Stopping and resuming loses nothing: the final adapter equals an uninterrupted run's, metrics continue.

The stop signal here is the trainer's own stop flag (what the job wrapper sets on SLURM's USR2); the real
signal path through SLURM is exercised in test_cluster_faults.py.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from train.checkpoints import MARKER, latest_valid_checkpoint, step_of
from train.config import TrainJob
from train.recipe import run_stage


class StopAfter:
    """Asks the trainer to stop once `steps` steps have ended (duck-types threading.Event.is_set)."""

    def __init__(self, steps: int):
        self.steps, self.calls = steps, 0

    def is_set(self) -> bool:
        self.calls += 1
        return self.calls > self.steps


def job(repo_root: Path, run_dir: Path, method: str = "lora", **train) -> TrainJob:
    return TrainJob(
        experiment="resume",
        stage="s",
        model={"name_or_path": str(repo_root / "models" / "tiny-llama"), "kind": "causal"},
        adapter={"method": method, "rank": 8, "alpha": 16, "dropout": 0.0, "max_trainable_percent": 30},
        data={
            "train": str(repo_root / "data/demo/sql/train.jsonl"),
            "eval": str(repo_root / "data/demo/sql/dev.jsonl"),
            "input_field": "question",
            "target_field": "sql",
            "prompt_template": "{schema} | {question} | SQL: ",
        },
        train={"epochs": 2, "learning_rate": 3e-3, "batch_size": 8, "save_every_steps": 5, "logging_steps": 2}
        | train,
        run_dir=str(run_dir),
    )


def adapter_weights(run_dir: Path) -> dict:
    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def logged_steps(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "loss" in r]


# Stopping in the second epoch covers the shuffle of a resumed epoch (16 steps make one epoch here).
@pytest.mark.parametrize(("method", "stop_after"), [("lora", 18), ("qlora", 7)])
def test_interrupted_run_resumes_to_the_same_adapter(repo_root, tmp_path, tiny_models, method, stop_after):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    assert run_stage(job(repo_root, straight, method)) == "completed"
    assert run_stage(job(repo_root, interrupted, method), StopAfter(stop_after)) == "interrupted"
    assert not (interrupted / "adapter").exists()
    assert latest_valid_checkpoint(interrupted / "checkpoints").name == f"checkpoint-{stop_after + 1}"
    assert run_stage(job(repo_root, interrupted, method)) == "completed"

    expected, actual = adapter_weights(straight), adapter_weights(interrupted)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert (expected[name] - actual[name]).abs().max().item() <= 1e-6, name
    steps = logged_steps(interrupted)
    assert steps == sorted(set(steps)) and steps == logged_steps(straight)  # no step repeated or skipped
    assert json.loads((interrupted / "summary.json").read_text())["resumed_from"].endswith(
        f"checkpoint-{stop_after + 1}"
    )


def test_a_torn_newest_checkpoint_falls_back_to_the_previous_one(repo_root, tmp_path, tiny_models, caplog):
    # A kill -9 in the middle of a save cannot be timed reliably from a test, so its aftermath is made by
    # hand: the newest checkpoint has no commit marker and a truncated state file.
    run_dir = tmp_path / "run"
    assert run_stage(job(repo_root, run_dir), StopAfter(12)) == "interrupted"
    checkpoints = run_dir / "checkpoints"
    good = latest_valid_checkpoint(checkpoints)
    torn = checkpoints / f"checkpoint-{step_of(good) + 1}"  # newer than the good one; never saved at by HF
    shutil.copytree(good, torn)
    (torn / MARKER).unlink()
    (torn / "trainer_state.json").write_text('{"global_step": 9')
    with caplog.at_level(logging.WARNING, logger="train.checkpoints"):
        assert latest_valid_checkpoint(checkpoints) == good
    assert torn.name in caplog.text and "incomplete" in caplog.text
    assert run_stage(job(repo_root, run_dir)) == "completed"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] == str(good)
