"""The bad-input corpus (tests/bad_inputs/): each mistake gives one clear message, exit code 2, no traceback,
and an existing run folder left byte for byte as it was, before any SLURM command runs (the scheduler's
commands are stand-ins that log a call: no cluster needed); and on the real dev cluster, nothing queued."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import launch
from tests.conftest import squeue_ids, write_cluster_yaml

CORPUS = Path(__file__).resolve().parent / "bad_inputs"
CASES = sorted(p.name for p in CORPUS.iterdir() if p.is_dir())
SCHEDULER = ("sbatch", "squeue", "sacct", "scontrol", "scancel", "sacctmgr", "sinfo", "srun")


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def case_folder(case: str, work: Path) -> Path:
    """work/configs: the case's files and a cluster.yaml keeping runs under work, where a finished run of an
    earlier launch (runs/a/train) lies."""
    configs = work / "configs"
    shutil.copytree(CORPUS / case, configs)
    write_cluster_yaml(configs, work)
    existing = work / "runs" / "a" / "train"
    existing.mkdir(parents=True)
    (existing / "DONE").write_text("0123456789abcdef\n")
    (existing / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    return configs


def launched(configs: Path, capsys, monkeypatch) -> tuple[int, str]:
    """`launch.py --all --backend slurm` in the case's folder (data paths in the corpus are relative to it):
    its exit code and what it wrote to stderr."""
    monkeypatch.chdir(configs)
    code = launch.main(["--all", "--config-dir", ".", "--backend", "slurm"])
    return code, capsys.readouterr().err


@pytest.fixture
def scheduler_calls(tmp_path, monkeypatch) -> Path:
    """SLURM's commands first on PATH as stand-ins that append their name to the returned log and fail."""
    folder = tmp_path / "bin"
    folder.mkdir()
    log = tmp_path / "scheduler-calls.log"
    for command in SCHEDULER:
        (folder / command).write_text(f'#!/bin/sh\necho {command} >> "{log}"\nexit 1\n')
        (folder / command).chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return log


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_refused_clearly_before_slurm_is_asked_anything(
    case, tmp_path, capsys, monkeypatch, scheduler_calls
):
    configs = case_folder(case, tmp_path / "work")
    before = snapshot(tmp_path / "work" / "runs")
    code, err = launched(configs, capsys, monkeypatch)
    assert code == 2
    assert "Traceback" not in err
    for fragment in (CORPUS / case / "expect.txt").read_text().splitlines():
        assert fragment in err, f"{fragment!r} missing from:\n{err}"
    # One clear message, not a cascade; a case of several mistakes (errors.txt) lists each, all at once.
    errors = CORPUS / case / "errors.txt"
    assert err.count("error:") == (int(errors.read_text()) if errors.is_file() else 1), err
    assert snapshot(tmp_path / "work" / "runs") == before
    assert not scheduler_calls.exists(), scheduler_calls.read_text()  # no squeue, no sbatch: nothing queued


def test_no_bad_input_queues_anything_on_the_dev_cluster(tmp_path, capsys, monkeypatch, slurm_cluster):
    """The fast test above shows no SLURM command runs; here the real queue confirms it, case by case."""
    for case in CASES:
        configs = case_folder(case, tmp_path / case)
        before = squeue_ids(tmp_path)
        code, err = launched(configs, capsys, monkeypatch)
        assert code == 2, f"{case}:\n{err}"
        assert squeue_ids(tmp_path) == before, case
