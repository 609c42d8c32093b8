"""train/checkpoints.py: which checkpoint a resume trusts, and which ones rotation keeps (no torch needed)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from train.checkpoints import MARKER, commit, discard_incomplete, latest_valid_checkpoint, rotate


def fake_checkpoint(folder: Path, step: int, committed: bool = True) -> Path:
    checkpoint = folder / f"checkpoint-{step}"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (checkpoint / "adapter_model.safetensors").write_bytes(b"weights")
    if committed:
        commit(checkpoint, world_size=1)
    return checkpoint


def test_newest_committed_checkpoint_wins(tmp_path):
    for step in (5, 10, 15):
        fake_checkpoint(tmp_path, step)
    (tmp_path / "checkpoint-15.tmp").mkdir()  # not a checkpoint name
    assert latest_valid_checkpoint(tmp_path) == tmp_path / "checkpoint-15"
    assert latest_valid_checkpoint(tmp_path / "missing") is None


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
