"""Crash-safe checkpoints: a checkpoint counts only once its commit marker was written, last and synced.

A job killed mid-save (kill -9, node failure) leaves a folder without the marker; resume skips it with a
warning and takes the previous one, instead of crashing on a half-written optimizer state.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

log = logging.getLogger("train.checkpoints")
MARKER = "COMMITTED"
PATTERN = re.compile(r"^checkpoint-(\d+)$")


def commit(checkpoint: Path) -> None:
    """Flush the checkpoint's files to disk, then write the marker: after this it is safe to resume from."""
    for path in checkpoint.rglob("*"):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    tmp = checkpoint / f".{MARKER}.tmp"
    with open(tmp, "w") as fh:
        fh.write("ok\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, checkpoint / MARKER)


def is_valid(checkpoint: Path) -> bool:
    if not (checkpoint / MARKER).is_file():
        return False
    try:
        json.loads((checkpoint / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return False
    return any(checkpoint.glob("adapter_model.safetensors")) or any(checkpoint.glob("*.safetensors"))


def checkpoints(folder: Path) -> list[Path]:
    """Checkpoint folders, newest (highest step) first."""
    found = [p for p in folder.glob("checkpoint-*") if p.is_dir() and PATTERN.match(p.name)]
    return sorted(found, key=lambda p: int(PATTERN.match(p.name).group(1)), reverse=True)


def latest_valid_checkpoint(folder: Path) -> Path | None:
    for checkpoint in checkpoints(folder):
        if is_valid(checkpoint):
            return checkpoint
        log.warning("skipping %s: incomplete or corrupt (no commit marker or unreadable state)", checkpoint)
    return None


def step_of(checkpoint: Path) -> int:
    return int(PATTERN.match(checkpoint.name).group(1))
