"""Issue 38, rule 3: no write follows a link planted after the start check. The launch and the job refuse
links once, at their start; a link planted later (`runs/.rungs`, a stage's `checkpoints/`) was followed:
rung records and checkpoints written outside the run root, and checkpoint rotation deleted the
`checkpoint-*` folders it pointed at. Every write is now checked when it happens (core/below.py). Real
files, real links, the real trainer."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from core.below import LinkBelowRoot, check, open_file
from core.config import PruneJob
from core.files import append_json_line
from core.pruning import judged
from tests.train_helpers import make_job

PRUNE = PruneJob(rungs=[1], keep=0.5, sweep="sw", measured_under="m")


def fingerprint(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(folder.rglob("*"))
    }


def victim(tmp_path: Path) -> Path:
    """Another user's folder, which the planted link points at."""
    folder = tmp_path / "victim"
    for step in (1, 2):
        (folder / f"checkpoint-{step}").mkdir(parents=True)
        (folder / f"checkpoint-{step}" / "COMMITTED").write_text('{"world_size": 1}\n')
        (folder / f"checkpoint-{step}" / "trainer_state.json").write_text("{}\n")
        (folder / f"checkpoint-{step}" / "adapter_model.safetensors").write_text("precious\n")
    return folder


def test_link_planted_at_rungs_after_start_is_not_followed(tmp_path):
    run_root, target = tmp_path / "runs", victim(tmp_path)
    judged(run_root, "sw", "a", "h", 1, 1.0, PRUNE)  # the sweep is under way
    before = fingerprint(target)
    (run_root / ".rungs").rename(tmp_path / "aside")
    (run_root / ".rungs").symlink_to(target)
    with pytest.raises(LinkBelowRoot, match=r"\.rungs"):
        judged(run_root, "sw", "b", "h", 1, 2.0, PRUNE)
    (run_root / ".rungs").unlink()
    (run_root / ".rungs").mkdir()
    (run_root / ".rungs" / "sw").symlink_to(target)  # one level down: the sweep's own folder
    with pytest.raises(LinkBelowRoot, match="sw"):
        judged(run_root, "sw", "b", "h", 1, 2.0, PRUNE)
    assert fingerprint(target) == before


def test_link_planted_at_a_stage_folder_after_start_gets_no_metrics_row(tmp_path):
    run_root, target = tmp_path / "runs", victim(tmp_path)
    (run_root / "exp").mkdir(parents=True)
    (run_root / "exp" / "stage").symlink_to(target)
    with pytest.raises(LinkBelowRoot, match="stage"):
        append_json_line(run_root / "exp" / "stage" / "metrics.jsonl", {"step": 1}, root=run_root)
    assert not (target / "metrics.jsonl").exists()


def test_checkpoint_rotation_through_a_link_planted_at_checkpoints_deletes_nothing(tmp_path):
    from train.checkpoints import discard_incomplete, rotate

    target = victim(tmp_path)
    stage = tmp_path / "runs" / "exp" / "stage"
    stage.mkdir(parents=True)
    (stage / "checkpoints").symlink_to(target)
    before = fingerprint(target)
    with pytest.raises(LinkBelowRoot, match="checkpoints"):
        rotate(stage / "checkpoints", keep=set())
    with pytest.raises(LinkBelowRoot, match="checkpoints"):
        discard_incomplete(stage / "checkpoints")
    assert fingerprint(target) == before


@pytest.mark.slow
def test_link_planted_at_checkpoints_after_start_is_not_followed(tiny, tmp_path):
    # The job started (its links were checked, the trainer set up); then `checkpoints/` became a link.
    # The Trainer's first save is checked immediately before it writes, and fails naming it.
    from train.recipe import StageRecipe

    target = victim(tmp_path)
    stage = tmp_path / "runs" / "t" / "s"
    recipe = StageRecipe(make_job(tiny, stage, save_every_steps=1), threading.Event())
    recipe.setup()
    before = fingerprint(target)
    if (stage / "checkpoints").exists():
        (stage / "checkpoints").rename(tmp_path / "aside")
    (stage / "checkpoints").symlink_to(target)
    with pytest.raises(LinkBelowRoot, match="checkpoints"):
        recipe.train()
    assert fingerprint(target) == before


def test_safe_path_below_a_root_allows_a_root_that_is_itself_a_link(tmp_path):
    # Where the run root lives is the user's choice: only what is below it is checked.
    (tmp_path / "real").mkdir()
    (tmp_path / "runs").symlink_to(tmp_path / "real")
    os.close(open_file(tmp_path / "runs", tmp_path / "runs" / "a" / "b.txt", os.O_WRONLY | os.O_CREAT))
    check(tmp_path / "runs", tmp_path / "runs" / "a" / "b.txt")
    assert (tmp_path / "real" / "a" / "b.txt").is_file()
