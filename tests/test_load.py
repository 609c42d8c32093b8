"""Load: 200 tiny stage jobs in one `--all` on the dev cluster. All are validated, submitted and tracked, and
`--status` asks the scheduler once (one squeue, at most one sacct) however many jobs there are, queued or
ended. The jobs are submitted held (an sbatch wrapper adds `--hold`); RELEASED of them are let run to the end and the
rest are cancelled: running all 200 would show nothing more and cost the suite ten minutes of job start-ups.

The scheduler commands are counted by wrappers put first on PATH that log their call and hand it to the real
squeue and sacct: the answers are the cluster's own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import launch
from tests.conftest import squeue_ids, write_cluster_yaml
from tests.helpers import holding_sbatch, tiny_sql_base

N_JOBS = 200
RELEASED = 8


def counting_wrappers(folder: Path, log: Path) -> None:
    folder.mkdir()
    for command in ("squeue", "sacct"):
        real = shutil.which(command)
        script = folder / command
        script.write_text(f'#!/bin/sh\necho {command} >> "{log}"\nexec "{real}" "$@"\n')
        script.chmod(0o755)


def scheduler_calls(log: Path) -> list[str]:
    calls = log.read_text().split() if log.is_file() else []
    log.unlink(missing_ok=True)
    return calls


def status(configs: Path) -> float:
    started = time.perf_counter()
    assert launch.main(["--status", "--config-dir", str(configs)]) == 0
    return time.perf_counter() - started


def test_two_hundred_stage_jobs_in_one_launch(repo_root, tmp_path, slurm_cluster, tiny, monkeypatch, capsys):
    monkeypatch.chdir(repo_root)
    configs = tmp_path / "configs"
    configs.mkdir()
    write_cluster_yaml(configs, tmp_path)
    tiny_sql_base(configs)
    names = [f"load-{i:03d}" for i in range(N_JOBS)]
    for name in names:
        (configs / f"{name}.yaml").write_text(
            f"name: {name}\ninherits: _tiny-sql.yaml\ntrain: {{max_steps: 1}}\n"
        )
    calls = tmp_path / "scheduler-calls.log"
    counting_wrappers(tmp_path / "bin", calls)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")

    holding_sbatch(tmp_path / "hold")  # queued, not started: the status below sees 200 live jobs
    plain_path = os.environ["PATH"]
    monkeypatch.setenv("PATH", f"{tmp_path / 'hold'}{os.pathsep}{plain_path}")
    started = time.perf_counter()
    assert launch.main(["--all", "--config-dir", str(configs), "--backend", "slurm"]) == 0
    submitted_s = time.perf_counter() - started
    monkeypatch.setenv("PATH", plain_path)
    records = [json.loads((tmp_path / "runs" / n / "train" / "job.json").read_text()) for n in names]
    slurm_ids = [r["jobs"][-1]["job_id"] for r in records]
    assert len(set(slurm_ids)) == N_JOBS and set(slurm_ids) <= squeue_ids()

    scheduler_calls(calls)
    capsys.readouterr()
    live_status_s = status(configs)
    assert scheduler_calls(calls).count("squeue") == 1
    table = capsys.readouterr().out
    assert all(name in table for name in names) and table.count("PENDING") == N_JOBS

    released, cancelled = names[:RELEASED], names[RELEASED:]
    subprocess.run(["scontrol", "release", ",".join(slurm_ids[:RELEASED])], check=True)
    assert launch.main(["--cancel", "--exp", *cancelled, "--config-dir", str(configs)]) == 0
    # The released jobs are queued already: nothing is submitted again, --wait follows them to the end.
    assert (
        launch.main(["--exp", *released, "--config-dir", str(configs), "--backend", "slurm", "--wait"]) == 0
    )
    finished_s = time.perf_counter() - started
    assert all((tmp_path / "runs" / n / "train" / "DONE").is_file() for n in released)
    assert not any((tmp_path / "runs" / n / "train" / "DONE").exists() for n in cancelled)
    assert all(
        json.loads((tmp_path / "runs" / n / "train" / "summary.json").read_text())["global_step"] == 1
        for n in released
    )

    scheduler_calls(calls)
    capsys.readouterr()
    ended_status_s = status(configs)
    done_calls = scheduler_calls(calls)
    assert done_calls.count("squeue") == 1 and done_calls.count("sacct") <= 1
    table = capsys.readouterr().out
    assert table.count("COMPLETED") >= RELEASED and table.count("CANCELLED") >= N_JOBS - RELEASED
    with capsys.disabled():
        print(
            f"\n{N_JOBS} jobs: submitted in {submitted_s:.1f} s, {RELEASED} run and the rest cancelled after "
            f"{finished_s:.0f} s; "
            f"--status {live_status_s:.2f} s while queued, {ended_status_s:.2f} s when ended"
        )
