"""Crash-safe checkpoints: a checkpoint counts only once its commit marker was written, last and synced.

A job killed mid-save (kill -9, node failure) leaves a folder without the marker; resume skips it with a
warning and takes the previous one, instead of crashing on a half-written optimizer state. Old checkpoints
are deleted only after a newer one is committed (Hugging Face's own rotation runs before our commit, so a
kill between the two could leave nothing to resume from; the recipe turns it off and calls `rotate`).

Every save, commit and deletion first checks that nothing from below the run root down to the folder is a
symbolic link (core/below.py), at that moment: a `checkpoints/` replaced by a link while the job trains
would otherwise receive the checkpoints, and rotation would delete the `checkpoint-*` folders it points at.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

from core.below import check as check_no_link
from core.files import fsync_path, write_atomic
from core.rundir import RunDir

log = logging.getLogger("train.checkpoints")
MARKER = "COMMITTED"
PATTERN = re.compile(r"^checkpoint-(\d+)$")


def check_below_run_root(path: Path) -> None:
    """LinkBelowRoot (an OSError naming the link) if a link stands between the run root and `path`, a
    stage's checkpoints folder or something in it (RUN_ROOT/EXP/STAGE/checkpoints/...)."""
    path = Path(path)
    folder = next((p for p in (path, *path.parents) if p.name == "checkpoints"), path)
    check_no_link(RunDir(folder.parent).run_root, path)


class CheckedSaves:
    """Trainer mixin: the Trainer's checkpoint save is checked immediately before it writes."""

    def _save_checkpoint(self, model, trial):
        folder = Path(self.args.output_dir)
        check_below_run_root(folder / f"checkpoint-{self.state.global_step}")
        return super()._save_checkpoint(model, trial)


def commit(checkpoint: Path, world_size: int, global_batch: int) -> None:
    """Flush the checkpoint's files to disk, then write the marker: after this it is safe to resume from.
    The marker records how many ranks wrote it and the examples each optimizer step took (see
    `set_aside_unresumable`)."""
    check_below_run_root(checkpoint)
    for path in checkpoint.rglob("*"):
        if path.is_file():
            fsync_path(path)
    record = {"world_size": world_size, "global_batch": global_batch}
    write_atomic(checkpoint / MARKER, json.dumps(record) + "\n")


def marked(checkpoint: Path, key: str) -> int | None:
    """What a committed checkpoint's marker records under `key` (world_size, global_batch); None for a
    marker older than that record ("ok")."""
    try:
        record = json.loads((checkpoint / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record.get(key) if isinstance(record, dict) else None


def set_aside_unresumable(folder: Path, world_size: int, elastic_batch: int | None = None) -> Path | None:
    """Move checkpoints this run cannot continue to `checkpoints.world-N` (kept, not deleted).

    A fixed-size job continues only checkpoints of its own number of ranks: the optimizer steps already
    taken counted another global batch, the schedule another number of steps, and each rank's RNG state
    belongs to a rank that may not exist now. The plan gives such a stage a new identity
    (slurm/planning/plan.py), so it starts over; this makes the trainer agree.
    An elastic job (`nodes: min-max`, `elastic_batch` its global batch) keeps that batch at every world size
    (core/split.py elastic_accumulation) and indexes its sampler by it, so it continues any checkpoint that
    took the same global batch, on as many ranks as it got; only the RNG state of ranks that are gone is
    lost (LoRA dropout: equal in distribution; with dropout 0, the same adapter)."""

    def unresumable(checkpoint: Path) -> bool:
        if elastic_batch is not None and (taken := marked(checkpoint, "global_batch")) is not None:
            return taken != elastic_batch
        return marked(checkpoint, "world_size") not in (None, world_size)

    found = [c for c in checkpoints(Path(folder)) if is_valid(c) and unresumable(c)]
    if not found:
        return None
    sizes = sorted({marked(c, "world_size") for c in found} - {None})
    aside = Path(folder).with_name(f"{Path(folder).name}.world-{max(sizes, default=0)}")
    while aside.exists():
        aside = aside.with_name(aside.name + "+")
    log.warning(
        "checkpoints in %s were written by %s rank(s)%s, this run has %d: starting over; they are kept in %s",
        folder,
        "/".join(map(str, sizes)),
        "" if elastic_batch is None else f" with another global batch than this job's {elastic_batch}",
        world_size,
        aside,
    )
    Path(folder).rename(aside)
    return aside


def is_valid(checkpoint: Path) -> bool:
    if not (checkpoint / MARKER).is_file():
        return False
    try:
        json.loads((checkpoint / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return False
    return any(checkpoint.glob("*.safetensors"))


def step_of(checkpoint: Path) -> int:
    return int(PATTERN.match(checkpoint.name).group(1))


def checkpoints(folder: Path) -> list[Path]:
    """Checkpoint folders, newest (highest step) first."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and PATTERN.match(p.name)]
    return sorted(found, key=step_of, reverse=True)


def latest_valid_checkpoint(folder: Path) -> Path | None:
    """The newest committed, readable checkpoint; newer torn ones are skipped with a warning."""
    for checkpoint in checkpoints(Path(folder)):
        if is_valid(checkpoint):
            return checkpoint
        log.warning("skipping %s: incomplete or corrupt (no commit marker or unreadable state)", checkpoint)
    return None


def discard_incomplete(folder: Path) -> list[Path]:
    """Delete torn checkpoints before resuming: HF would later save into a folder of the same name and
    mix fresh files with stale ones, and its rotation would count them as real."""
    check_below_run_root(Path(folder))
    torn = [c for c in checkpoints(Path(folder)) if not is_valid(c)]
    for checkpoint in torn:
        log.warning("deleting incomplete checkpoint %s", checkpoint)
        shutil.rmtree(checkpoint, ignore_errors=True)
    return torn


def rotate(folder: Path, keep: set[Path]) -> None:
    """Keep the newest committed checkpoint and `keep` (the best one); delete the other committed ones."""
    check_below_run_root(Path(folder))
    committed = [c for c in checkpoints(Path(folder)) if is_valid(c)]
    protected = {c.resolve() for c in committed[:1]} | {Path(k).resolve() for k in keep}
    for checkpoint in committed[1:]:
        if checkpoint.resolve() not in protected:
            shutil.rmtree(checkpoint, ignore_errors=True)
