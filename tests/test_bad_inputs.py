"""The bad-input corpus (tests/bad_inputs/): each mistake gives one clear message, exit code 2, no traceback,
nothing queued on the real dev cluster, and an existing run folder left byte for byte as it was."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import launch
from tests.conftest import squeue_ids, write_cluster_yaml

CORPUS = Path(__file__).resolve().parent / "bad_inputs"
CASES = sorted(p.name for p in CORPUS.iterdir() if p.is_dir())


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_refused_clearly(case, tmp_path, capsys, monkeypatch, slurm_cluster):
    work = tmp_path / "work"
    shutil.copytree(CORPUS / case, work / "configs")
    write_cluster_yaml(work / "configs", work)
    existing = work / "runs" / "a" / "train"  # a finished run of an earlier launch
    existing.mkdir(parents=True)
    (existing / "DONE").write_text("0123456789abcdef\n")
    (existing / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    before_runs, before_queue = snapshot(work / "runs"), squeue_ids(tmp_path)
    monkeypatch.chdir(work / "configs")  # data paths in the corpus are relative to its folder

    code = launch.main(["--all", "--config-dir", ".", "--backend", "slurm"])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    for fragment in (CORPUS / case / "expect.txt").read_text().splitlines():
        assert fragment in err, f"{fragment!r} missing from:\n{err}"
    assert err.count("error:") == 1, err  # one clear message, not a cascade
    assert squeue_ids(tmp_path) == before_queue
    assert snapshot(work / "runs") == before_runs
