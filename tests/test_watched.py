"""Issue 31, rule 2: only what is really gone is "removed" (slurm/watching/watched.py), on real config files and real
origin records; tests/test_sweep_run.py checks the same on the dev cluster with queued jobs."""

from __future__ import annotations

from pathlib import Path

from core.rundir import record_origin
from slurm.planning.experiments import load_watchable_experiments
from slurm.watching.watched import removed_from, watched_experiments
from tests.helpers import experiment_folder


def launched(tmp_path: Path, rates: str = "1.0e-4, 2.0e-4") -> tuple[Path, Path, list[str]]:
    """(config folder, run root, point names): a sweep whose points the run root holds, as a launch leaves
    them (each with its origin record)."""
    folder = experiment_folder(tmp_path, more=f"sweep:\n  grid: {{train.learning_rate: [{rates}]}}\n")
    runs = tmp_path / "runs"
    found, problems, _, broken = load_watchable_experiments(folder)
    assert not problems and not broken
    names = [e.name for e in found]
    for name in names:
        (runs / name).mkdir(parents=True)
        record_origin(runs / name, folder / "a.yaml", folder)
    return folder, runs, names


def folder_names(folder: Path, runs: Path) -> tuple[set[str], set[Path]]:
    """What a load of the folder hands removed_from: every experiment name it gives, the files that broke."""
    held = frozenset(p.name for p in runs.iterdir())
    found, _, written, broken = load_watchable_experiments(folder, None, held)
    return {e.name for e in found} | written, broken


def test_a_point_removed_from_the_sweep_is_gone(tmp_path):
    folder, runs, names = launched(tmp_path)
    (folder / "a.yaml").write_text((folder / "a.yaml").read_text().replace("1.0e-4, 2.0e-4", "1.0e-4"))
    gone = watched_experiments(runs, folder, False).gone
    assert len(gone) == 1 and gone[0] in names
    assert removed_from(runs, folder, *folder_names(folder, runs)) == gone


def test_a_sweep_file_that_does_not_load_makes_none_of_its_points_gone(tmp_path):
    folder, runs, names = launched(tmp_path)
    path = folder / "a.yaml"
    for broken in (
        path.read_text().replace("train.learning_rate", "train.learnig_rate"),  # a point fails validation
        path.read_text().replace("grid: {", "grid: {{"),  # not YAML any more
    ):
        path.write_text(broken)
        watched = watched_experiments(runs, folder, False)
        assert watched.gone == [] and watched.warnings  # warned about, its points kept
        assert removed_from(runs, folder, *folder_names(folder, runs)) == []


def test_an_experiment_the_folder_looked_at_has_is_never_gone_after_the_folder_moved(tmp_path):
    folder, runs, _ = launched(tmp_path)
    moved = folder.rename(tmp_path / "moved")
    assert watched_experiments(runs, moved, False).gone == []
