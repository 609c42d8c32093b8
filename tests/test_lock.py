"""Two launches at once queue every job once: the second waits for the first's launch lock, then finds
its jobs queued. Two real `launch.py` processes against the dev cluster and one run root."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import launch
from tests.conftest import squeue_ids
from tests.helpers import DEMO_JOBS, demo_configs, wait_until


def gated_sbatch(folder: Path) -> tuple[Path, Path]:
    """An sbatch that logs each call, waits until the test opens the gate, then queues the job held (so
    nothing runs). The first launch is thus caught between its decisions and its first submission."""
    folder.mkdir()
    calls, gate = folder / "calls", folder / "open"
    script = folder / "sbatch"
    script.write_text(
        f'#!/bin/sh\necho call >> "{calls}"\n'
        f'while [ ! -e "{gate}" ]; do sleep 0.1; done\n'
        f'exec "{shutil.which("sbatch")}" --hold "$@"\n'
    )
    script.chmod(0o755)
    return calls, gate


def count(calls: Path) -> int:
    return len(calls.read_text().split()) if calls.exists() else 0


def test_two_concurrent_launches_queue_each_job_once(repo_root, tmp_path, slurm_cluster, monkeypatch, capsys):
    monkeypatch.chdir(repo_root)
    config_dir = demo_configs(repo_root, tmp_path)
    calls, gate = gated_sbatch(tmp_path / "bin")
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    argv = [sys.executable, "launch.py", "--all", "--config-dir", str(config_dir), "--backend", "slurm"]

    def start(name: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)

    first = start("first")
    wait_until(lambda: count(calls) == 1, "the first launch to reach its first sbatch")
    second = start("second")
    second_log = tmp_path / "second.log"
    # Either the second launch waits for the lock, or (the bug) it decides too and reaches sbatch.
    wait_until(
        lambda: "waiting for the launch lock" in second_log.read_text() or count(calls) > 1,
        "the second launch to wait or to submit",
    )
    gate.touch()
    assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()
    assert second.wait(timeout=300) == 0, second_log.read_text()

    # One submission per job of the plan (the demo's and its base-model evals'), not two.
    jobs = {*DEMO_JOBS, *(f"{p.parent.name}/eval" for p in (tmp_path / "runs").glob("_base-*/eval"))}
    assert len(jobs) == len(DEMO_JOBS) + 5 and count(calls) == len(jobs)
    records = [json.loads((tmp_path / "runs" / p / "job.json").read_text())["jobs"] for p in jobs]
    assert all(len(r) == 1 for r in records)
    queued = {r[0]["job_id"] for r in records}
    assert len(queued) == len(jobs) and queued <= squeue_ids()
    said = second_log.read_text()
    assert f"held by pid {first.pid} on " in said and "Nothing to submit" in said

    capsys.readouterr()
    assert launch.main(["--cancel", "--config-dir", str(config_dir)]) == 0
    assert f"Cancelled {len(jobs)} job(s)" in capsys.readouterr().out
    wait_until(lambda: not queued & squeue_ids(), "the held jobs to leave the queue", 60)
