"""train/checkpoints.py: which checkpoint a resume trusts, and which ones rotation keeps (no torch needed);
train/callbacks.py: a stop that lands on an eval step checkpoints first (a real tiny training)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from train.checkpoints import (
    MARKER,
    commit,
    discard_incomplete,
    latest_valid_checkpoint,
    rotate,
    set_aside_unresumable,
)


def fake_checkpoint(
    folder: Path, step: int, committed: bool = True, world_size: int = 1, global_batch: int = 8
) -> Path:
    checkpoint = folder / f"checkpoint-{step}"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (checkpoint / "adapter_model.safetensors").write_bytes(b"weights")
    if committed:
        commit(checkpoint, world_size, global_batch)
    return checkpoint


def test_newest_committed_checkpoint_wins(tmp_path):
    for step in (5, 10, 15):
        fake_checkpoint(tmp_path, step)
    (tmp_path / "checkpoint-15.tmp").mkdir()  # not a checkpoint name
    assert latest_valid_checkpoint(tmp_path) == tmp_path / "checkpoint-15"
    assert latest_valid_checkpoint(tmp_path / "missing") is None


def test_an_elastic_job_continues_checkpoints_of_another_world_size_with_its_global_batch_only(tmp_path):
    """A fixed-size job sets aside checkpoints of another world size (their steps counted another global
    batch); an elastic one continues them when they took its global batch (2 ranks x 8 = 1 rank x 16)
    and sets aside only those that took another (a run of the same folder before nodes became a range)."""
    fixed, elastic, other = (
        tmp_path / "fixed" / "checkpoints",
        tmp_path / "elastic" / "checkpoints",
        tmp_path / "other" / "checkpoints",
    )
    for folder in (fixed, elastic):
        fake_checkpoint(folder, 4, world_size=2, global_batch=16)
    fake_checkpoint(other, 4, world_size=2, global_batch=8)
    assert set_aside_unresumable(fixed, world_size=1) == fixed.with_name("checkpoints.world-2")
    assert set_aside_unresumable(elastic, world_size=1, elastic_batch=16) is None
    assert latest_valid_checkpoint(elastic) == elastic / "checkpoint-4"
    assert set_aside_unresumable(other, world_size=1, elastic_batch=16) == other.with_name(
        "checkpoints.world-2"
    )
    assert set_aside_unresumable(elastic, world_size=2) is None  # its own world size: kept as before


def test_torn_newest_checkpoints_are_skipped_with_a_warning(tmp_path, caplog):
    good = fake_checkpoint(tmp_path, 10)
    fake_checkpoint(tmp_path, 20, committed=False)  # killed before the marker
    torn_state = fake_checkpoint(tmp_path, 30)
    (torn_state / "trainer_state.json").write_text('{"global_step": 3')  # marker, but state cut short
    with caplog.at_level(logging.WARNING, logger="train.checkpoints"):
        assert latest_valid_checkpoint(tmp_path) == good
    assert "checkpoint-20" in caplog.text and "checkpoint-30" in caplog.text
    assert {p.name for p in discard_incomplete(tmp_path)} == {"checkpoint-20", "checkpoint-30"}
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-10"]


def test_rotation_keeps_newest_and_best_and_never_an_uncommitted_newest_alone(tmp_path):
    for step in (5, 10, 15, 20):
        fake_checkpoint(tmp_path, step)
    rotate(tmp_path, keep={tmp_path / "checkpoint-10"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-20"]
    # A newer save still being written does not count: the committed newest stays.
    fake_checkpoint(tmp_path, 25, committed=False)
    rotate(tmp_path, keep=set())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-20", "checkpoint-25"]
    assert (tmp_path / "checkpoint-20" / MARKER).is_file()


@pytest.mark.slow
def test_a_stop_on_an_eval_step_saves_before_it_evaluates_and_resumes_as_if_never_stopped(tiny, tmp_path):
    """The stop signal leaves about 90 s before the kill and an eval may take longer: the checkpoint comes
    first, then the eval, which is recorded into that checkpoint's state (its best metric)."""
    from safetensors.torch import load_file

    from tests.train_helpers import StopAfter, make_job, read_jsonl, sql_data
    from train.recipe import run_stage

    def job(run_dir: Path):  # 85 examples / 8: 11 steps an epoch; an eval and a save every 6 steps
        data = sql_data("easy", eval_split="dev")
        # logging_steps 5: the Trainer alone would log steps 1, 5 and 10, never the last
        return make_job(tiny, run_dir, data=data, max_steps=12, eval_every_epochs=0.5, logging_steps=5)

    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert run_stage(job(straight)) == "completed"
    # A stop seen at step 6's end lands on the first eval.
    assert run_stage(job(stopped), StopAfter(5)) == "interrupted"
    checkpoint = latest_valid_checkpoint(stopped / "checkpoints")
    assert checkpoint == stopped / "checkpoints" / "checkpoint-6"
    (evaluated,) = [row for row in read_jsonl(stopped / "metrics.jsonl") if "eval_loss" in row]
    assert evaluated["step"] == 6
    # File times never run ahead of the clock: the commit marker is older than the end of the eval.
    assert (checkpoint / MARKER).stat().st_mtime < evaluated["time"]
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["best_metric"] == evaluated["eval_loss"]
    assert state["best_model_checkpoint"] == str(checkpoint)
    assert [e["eval_loss"] for e in state["log_history"] if "eval_loss" in e] == [evaluated["eval_loss"]]
    assert "train_runtime" not in state["log_history"][-1]  # the stopped run's summary row is not kept

    assert run_stage(job(stopped)) == "completed"
    adapters = [load_file(str(run / "adapter" / "adapter_model.safetensors")) for run in (straight, stopped)]
    assert adapters[0].keys() == adapters[1].keys()
    for name, weight in adapters[0].items():
        assert (weight - adapters[1][name]).abs().max().item() <= 1e-6, name
    evals = [(r["step"], r["eval_loss"]) for r in read_jsonl(stopped / "metrics.jsonl") if "eval_loss" in r]
    expected = [
        (r["step"], r["eval_loss"]) for r in read_jsonl(straight / "metrics.jsonl") if "eval_loss" in r
    ]
    assert [s for s, _ in evals] == [s for s, _ in expected] == [6, 12]
    assert [loss for _, loss in evals] == pytest.approx([loss for _, loss in expected], abs=1e-6)
    # summary.json says which checkpoint adapter/ is (the best eval's, not always the last step's) and
    # final_train_loss is the last logged step's (before: the run's mean under that name).
    summary = json.loads((straight / "summary.json").read_text())
    best_step = min(expected, key=lambda row: row[1])[0]
    assert summary["adapter_from"]["step"] == best_step and summary["adapter_from"]["of_steps"] == 12
    last = "the last step's too" if best_step == 12 else "not the last step's"  # never "not" when it is
    assert "best eval_loss" in summary["adapter_from"]["why"] and summary["adapter_from"]["why"].endswith(
        last
    )
    best = load_file(str(straight / "checkpoints" / f"checkpoint-{best_step}" / "adapter_model.safetensors"))
    assert all((weight - adapters[0][name]).abs().max().item() == 0 for name, weight in best.items())
    losses = [(r["step"], r["loss"]) for r in read_jsonl(straight / "metrics.jsonl") if "loss" in r]
    assert losses[-1][0] == 12  # the last step is logged whatever logging_steps (before: step 10's was last)
    assert summary["final_train_loss"] == pytest.approx(losses[-1][1], abs=1e-6)
    assert summary["mean_train_loss"] != summary["final_train_loss"]
