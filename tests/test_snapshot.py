"""Queued jobs run the code of their launch, not whatever the working tree holds when they start.

A copy of the project (a git checkout of its own) launches real jobs; its train/ code is then broken
before they start; they must still complete, from the launch's snapshot, in the user's directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm.queueing.snapshot import PACKAGES
from tests.conftest import write_cluster_yaml
from tests.helpers import holding_sbatch, record, tiny_sql_base

# The data path is relative: read in the project copy the test launches from.
EXPERIMENT = """\
name: {name}
inherits: _tiny-sql.yaml
data: {{train: data/demo/sql/easy.jsonl}}
train: {{max_steps: 2}}
{extra}
"""
BREAK = "raise RuntimeError(\"the working tree's code ran, not the launch's snapshot\")\n"


def project_copy(repo_root: Path, tmp: Path) -> Path:
    """The packages, launch.py and the demo data, committed in a git repository of their own."""
    copy = tmp / "project"
    for package in PACKAGES:
        shutil.copytree(repo_root / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(repo_root / "launch.py", copy / "launch.py")
    shutil.copytree(repo_root / "data" / "demo" / "sql", copy / "data" / "demo" / "sql")
    git = ["git", "-C", str(copy), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "launch"], check=True)
    return copy


def experiments(tmp: Path, names_after: dict[str, str]) -> Path:
    folder = tmp / "configs"
    folder.mkdir()
    write_cluster_yaml(folder, tmp)
    tiny_sql_base(folder)
    for name, after in names_after.items():
        extra = f"after: [{after}]" if after else ""
        (folder / f"{name}.yaml").write_text(EXPERIMENT.format(name=name, extra=extra))
    return folder


def launch_in(copy: Path, *argv: str, env=None, wait: bool = True):
    """`python launch.py ARGV` as a user runs it in their checkout (its code, its working directory)."""
    command = [sys.executable, "launch.py", *argv]
    if not wait:
        return subprocess.Popen(command, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, check=False)


def assert_ran_from_snapshot(tmp: Path, job: str, commit: str) -> None:
    run_dir = tmp / "runs" / job
    assert (run_dir / "DONE").is_file()
    code = record(tmp, job)["code"]
    assert code["commit"] == commit and code["dirty"] is False
    assert BREAK not in (Path(code["snapshot"]) / "train" / "recipe.py").read_text()
    header = (run_dir / "config.yaml").read_text()
    assert f"# code.commit: {commit}\n# code.dirty: False\n" in header


def head_of(copy: Path) -> str:
    return subprocess.run(
        ["git", "-C", str(copy), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_a_queued_slurm_job_runs_the_code_it_was_launched_with(repo_root, tmp_path, slurm_cluster, tiny):
    copy = project_copy(repo_root, tmp_path)
    folder = experiments(tmp_path, {"snap": ""})
    held = {**os.environ, **holding_sbatch(tmp_path / "hold")}
    # No preflight: what it checks (lengths, memory) is not what this test is about, and the job it would
    # check is two steps on the tiny model; the snapshot is taken at submission all the same.
    slurm = ["--all", "--config-dir", str(folder), "--backend", "slurm", "--no-preflight"]
    launched = launch_in(copy, *slurm, env=held)
    assert launched.returncode == 0, launched.stdout + launched.stderr

    # Queued and held: now the user edits the code (here: breaks it), then the job starts.
    recipe = copy / "train" / "recipe.py"
    recipe.write_text(recipe.read_text() + BREAK)
    subprocess.run(["scontrol", "release", record(tmp_path, "snap/train")["job_id"]], check=True)
    waited = launch_in(copy, *slurm, "--wait")
    assert waited.returncode == 0, waited.stdout + waited.stderr
    assert_ran_from_snapshot(tmp_path, "snap/train", head_of(copy))


@pytest.mark.slow
def test_a_waiting_local_job_runs_the_code_it_was_launched_with(repo_root, tmp_path, tiny):
    copy = project_copy(repo_root, tmp_path)
    folder = experiments(tmp_path, {"first": "", "second": "first"})
    run = launch_in(copy, "--all", "--config-dir", str(folder), "--backend", "local", wait=False)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "runs" / "first" / "train" / "job.json").exists():  # first is running
            assert time.monotonic() < deadline and run.poll() is None, "the first local job never started"
            time.sleep(0.1)
        recipe = copy / "train" / "recipe.py"  # second/train starts only once first/train ended
        recipe.write_text(recipe.read_text() + BREAK)
        assert run.wait(timeout=300) == 0, run.stdout.read().decode()
    finally:
        run.kill()
    for job in ("first/train", "second/train"):
        assert_ran_from_snapshot(tmp_path, job, head_of(copy))


def test_code_provenance_is_not_part_of_the_spec_a_relaunch_compares(tmp_path):
    from core.rundir import read_spec, write_spec

    spec = {"experiment": "x", "train": {"epochs": 2}}
    write_spec(tmp_path, spec, {"commit": "0123abc", "dirty": True, "snapshot": "/logs/.code/ff"})
    assert read_spec(tmp_path) == spec  # a new commit alone never reads as a changed config
    assert (tmp_path / "config.yaml").read_text().startswith("# code.commit: 0123abc\n# code.dirty: True\n")
