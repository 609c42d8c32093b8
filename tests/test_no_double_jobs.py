"""Nothing doubled, nothing lost, nothing left running (issue 23, defects 1, 2, 6 and Ctrl-C): a stage has at
most one live trainer whatever the backend, a queued job is always recorded or found again, and a cancel or
a Ctrl-C stops what it names for sure. Real launchers (`launch.py` subprocesses) killed with real signals,
real local jobs (submitit's LocalExecutor) and real sbatch on the dev cluster; nothing is simulated."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import launch
from core.job_records import job_records, pending_submission, record_intent, record_job
from slurm.cluster.scheduler import RecordedLocalJob, descendants, local_alive, parse_comments, stop_local
from tests.conftest import squeue_ids
from tests.helpers import alive, configs, holding_sbatch, record, start_launcher, wait_until


def processes_of(folder: Path) -> dict[int, str]:
    """pid → command line of the live processes whose command names `folder` (a job's log folder)."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue
        if entry.name.isdigit() and str(folder) in command and state != "Z":
            found[int(entry.name)] = command
    return found


def trainers(tmp: Path, job: str) -> int:
    """Task processes (submitit.core._submit) of the job's log folder: one per live trainer."""
    return sum("submitit.core._submit" in c for c in processes_of(tmp / "logs" / job).values())


def kill_everything_under(tmp: Path) -> None:
    """A failed test leaves no training behind: every process whose command names the test's folder."""
    for pid in processes_of(tmp):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def logged_steps(tmp: Path, job: str) -> list[int]:
    rows = (tmp / "runs" / job / "metrics.jsonl").read_text().splitlines()
    return [row["step"] for row in map(json.loads, rows) if "loss" in row]


@pytest.mark.slow
def test_relaunch_after_the_launcher_was_killed_waits_for_its_local_job_instead_of_starting_a_second_trainer(
    repo_root, tmp_path, tiny, monkeypatch, capsys
):
    monkeypatch.chdir(repo_root)
    folder = configs(tmp_path, repo_root, long={"epochs": 500})
    first = start_launcher(folder, tmp_path / "first.log", "--backend", "local")
    second = None
    try:
        wait_until((tmp_path / "runs" / "long" / "train" / "progress.json").exists, "the job to train")
        pid = record(tmp_path, "long/train")["job_id"]
        first.kill()  # SIGKILL, as the OOM killer or a dropped session: its job goes on, the lock is free
        first.wait(timeout=30)
        assert alive(pid)

        second = start_launcher(folder, tmp_path / "second.log", "--backend", "local")
        said = tmp_path / "second.log"
        wait_until(lambda: "long/train: RUNNING" in said.read_text(), "the relaunch to decide")
        assert trainers(tmp_path, "long/train") == 1
        assert len(job_records(tmp_path / "runs" / "long" / "train")) == 1
        assert f"long/train: RUNNING (pid {pid}, started by an earlier launch" in said.read_text()

        # --cancel reaches the first launcher's job, and the relaunch that waits for it sees it cancelled.
        assert launch.main(["--cancel", "--all", "--config-dir", str(folder)]) == 0
        assert "Cancelled 1 job(s): long/train" in capsys.readouterr().out
        assert not alive(pid) and trainers(tmp_path, "long/train") == 0
        assert second.wait(timeout=60) == 1
    finally:
        for launcher in (first, second):
            if launcher:
                launcher.kill()
        kill_everything_under(tmp_path)
    assert "long/train: CANCELLED" in (tmp_path / "second.log").read_text()
    steps = logged_steps(tmp_path, "long/train")
    assert steps and len(steps) == len(set(steps))  # one trainer wrote metrics.jsonl: no step twice


@pytest.mark.slow
def test_cancel_stops_a_background_launchers_job_that_ignores_sigint_and_the_next_experiment_never_starts(
    repo_root, tmp_path, tiny, monkeypatch, capsys
):
    monkeypatch.chdir(repo_root)
    folder = configs(tmp_path, repo_root, long={"epochs": 500}, next={})  # one at a time: next waits
    # A script's `cmd &` starts it with SIGINT ignored; the launcher's jobs inherit that.
    ignore_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731
    launcher = start_launcher(
        folder, tmp_path / "launcher.log", "--backend", "local", preexec_fn=ignore_sigint
    )
    try:
        wait_until((tmp_path / "runs" / "long" / "train" / "progress.json").exists, "the job to train")
        pid = int(record(tmp_path, "long/train")["job_id"])
        tree = [pid, *descendants(pid)]
        assert len(tree) >= 2  # its controller and the trainer under it

        assert launch.main(["--cancel", "--all", "--config-dir", str(folder)]) == 0
        assert "Cancelled 1 job(s): long/train" in capsys.readouterr().out
        # --cancel returns once the processes are gone, not when a signal was sent.
        assert not [p for p in tree if alive(str(p))]
        assert launcher.wait(timeout=60) == 1
    finally:
        launcher.kill()
        kill_everything_under(tmp_path)
    said = (tmp_path / "launcher.log").read_text()
    assert "long/train: CANCELLED" in said and "next/train: CANCELLED (not started" in said
    assert not (tmp_path / "runs" / "next" / "train" / "job.json").exists()
    assert not (tmp_path / "logs" / "next").exists()


@pytest.mark.slow
def test_ctrl_c_of_a_local_launcher_stops_its_job_with_a_sentence_and_status_says_cancelled(
    repo_root, tmp_path, tiny, monkeypatch, capsys
):
    monkeypatch.chdir(repo_root)
    folder = configs(tmp_path, repo_root, long={"epochs": 500}, next={})
    # Its own session: a terminal's Ctrl-C is a SIGINT to the whole foreground process group. SIGINT set to
    # its default as a terminal's foreground process has it: a suite started in the background (`make test
    # &`, nohup) has it ignored, inherited by every child, and the launcher would never see the Ctrl-C.
    launcher = start_launcher(
        folder,
        tmp_path / "launcher.log",
        "--backend",
        "local",
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        wait_until((tmp_path / "runs" / "long" / "train" / "progress.json").exists, "the job to train")
        pid = record(tmp_path, "long/train")["job_id"]
        os.killpg(launcher.pid, signal.SIGINT)
        assert launcher.wait(timeout=60) == 130
        assert not alive(pid) and trainers(tmp_path, "long/train") == 0
    finally:
        launcher.kill()
        kill_everything_under(tmp_path)
    said = (tmp_path / "launcher.log").read_text()
    assert "Traceback" not in said and "KeyboardInterrupt" not in said, said
    assert "interrupted: stopped 1 running job(s) (long/train), 1 not started; relaunch" in said
    assert launch.main(["--status", "--config-dir", str(folder)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "long/train" in line]
    assert "CANCELLED" in rows[0] and "FAILED" not in rows[0]


def test_stop_local_kills_a_process_tree_that_ignores_sigint_and_sigterm(tmp_path):
    # A "controller" and a child under it, both deaf to SIGINT and SIGTERM (SIG_IGN): only SIGKILL works.
    deaf = (
        "import signal, subprocess, sys, time\n"
        "for s in (signal.SIGINT, signal.SIGTERM): signal.signal(s, signal.SIG_IGN)\n"
        "if len(sys.argv) > 1: subprocess.Popen([sys.executable, '-c', sys.argv[1]])\n"
        "print('up', flush=True)\n"
        "time.sleep(600)\n"
    )
    controller = subprocess.Popen([sys.executable, "-c", deaf, deaf], stdout=subprocess.PIPE, text=True)
    try:
        assert controller.stdout.readline() == "up\n"
        wait_until(lambda: descendants(controller.pid), "the child to start")
        tree = [controller.pid, *descendants(controller.pid)]
        started = time.monotonic()
        assert stop_local(RecordedLocalJob(tmp_path, str(controller.pid)))
        assert not [p for p in tree if alive(str(p))]
        # Ignored signals are not waited on (the kernel says they are ignored): straight to SIGKILL.
        assert time.monotonic() - started < 5
    finally:
        for pid in [controller.pid, *descendants(controller.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        controller.wait()


def test_a_reused_pid_is_not_taken_for_the_recorded_local_job(tmp_path):
    folder = tmp_path / "logs" / "exp" / "train"
    # The command line of a controller of this folder, started after the job was recorded.
    imposter = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)", "submitit.local._local", str(folder)]
    )
    try:
        wait_until(lambda: str(folder) in Path(f"/proc/{imposter.pid}/cmdline").read_text(), "it to start")
        an_hour_ago = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 3600))
        now = time.strftime("%Y-%m-%dT%H:%M:%S")
        assert not local_alive(RecordedLocalJob(folder, str(imposter.pid), an_hour_ago))
        assert local_alive(RecordedLocalJob(folder, str(imposter.pid), now))
        assert not local_alive(RecordedLocalJob(tmp_path / "other", str(imposter.pid), now))
    finally:
        imposter.kill()
        imposter.wait()


def test_a_submission_intent_survives_until_its_job_is_recorded(tmp_path):
    run_dir = tmp_path / "runs" / "exp" / "train"
    record_job(run_dir, "7", "slurm")
    token = record_intent(run_dir, {"commit": "abc"})
    assert pending_submission(run_dir).token == token
    assert [r.job_id for r in job_records(run_dir)] == ["7"]  # readers of the records see no change
    record_job(run_dir, "9", "slurm")
    record_job(run_dir, "9", "slurm")  # found by --cancel while its launch recorded it: once
    assert pending_submission(run_dir) is None
    assert [r.job_id for r in job_records(run_dir)] == ["7", "9"]


def test_squeue_comments_give_the_token_of_each_submission():
    text = (
        "301|slurm-lora 0f1e2d3c runs /home/a b/runs/exp/train\n"
        "302|(null)\n"
        "303|someone else's comment\n"
        "304|slurm-lora 99aa packs 3 job(s)\n"
    )
    assert parse_comments(text) == {"0f1e2d3c": "301", "99aa": "304"}


def queued_as(name: str, under: Path) -> list[str]:
    """Ids of the test's queued jobs named `name` (the job name is the plan id)."""
    done = subprocess.run(["squeue", "-h", "-o", "%i|%j"], capture_output=True, text=True, check=True)
    mine = squeue_ids(under=under)
    return sorted(
        i for i, n in (line.split("|", 1) for line in done.stdout.splitlines()) if n == name and i in mine
    )


def launch_killed_right_after_sbatch(folder: Path, tmp: Path) -> list[str]:
    """A launch of `one` SIGKILLed by its sbatch once the job is queued (held): what it queued."""
    killed = start_launcher(
        folder, tmp / "first.log", "--backend", "slurm", env=holding_sbatch(tmp / "kill", True)
    )
    assert killed.wait(timeout=300) == -signal.SIGKILL
    return queued_as("one/train", tmp)


def test_a_launch_killed_right_after_sbatch_leaves_a_job_the_relaunch_records_instead_of_queueing_it_again(
    repo_root, tmp_path, tiny, slurm_cluster, monkeypatch, capsys
):
    monkeypatch.chdir(repo_root)
    folder = configs(tmp_path, repo_root, one={})
    queued = launch_killed_right_after_sbatch(folder, tmp_path)
    assert len(queued) == 1  # sbatch queued it; its launcher died before writing it down

    relaunch = start_launcher(
        folder, tmp_path / "second.log", "--backend", "slurm", env=holding_sbatch(tmp_path / "hold")
    )
    assert relaunch.wait(timeout=300) == 0, (tmp_path / "second.log").read_text()
    said = (tmp_path / "second.log").read_text()
    assert f"one/train: recorded SLURM job {queued[0]}, queued by a launch that stopped" in said
    assert queued_as("one/train", tmp_path) == queued  # the same job, not a second one
    assert [r.job_id for r in job_records(tmp_path / "runs" / "one" / "train")] == queued
    assert launch.main(["--cancel", "--all", "--config-dir", str(folder)]) == 0
    assert "Cancelled 1 job(s): one/train" in capsys.readouterr().out


def test_status_and_cancel_find_a_job_whose_launch_was_killed_right_after_sbatch(
    repo_root, tmp_path, tiny, slurm_cluster, monkeypatch, capsys
):
    monkeypatch.chdir(repo_root)
    folder = configs(tmp_path, repo_root, one={})
    queued = launch_killed_right_after_sbatch(folder, tmp_path)
    assert launch.main(["--status", "--config-dir", str(folder)]) == 0
    assert queued[0] in capsys.readouterr().out
    assert launch.main(["--cancel", "--all", "--config-dir", str(folder)]) == 0
    assert "Cancelled 1 job(s): one/train" in capsys.readouterr().out
    wait_until(lambda: not queued_as("one/train", tmp_path), "the job to leave the queue", 60)


def test_a_run_folder_that_cannot_be_written_stops_the_launch_saying_what_was_queued_and_a_relaunch_finishes(
    repo_root, tmp_path, tiny, slurm_cluster, monkeypatch, capsys
):
    monkeypatch.chdir(repo_root)
    folder = configs(tmp_path, repo_root, a={}, b={}, c={})
    # A folder where c's job.json belongs: no write there succeeds, not even root's (a full disk for c).
    (tmp_path / "runs" / "c" / "train" / "job.json").mkdir(parents=True)
    env = holding_sbatch(tmp_path / "hold")
    first = start_launcher(folder, tmp_path / "first.log", "--backend", "slurm", env=env)
    assert first.wait(timeout=300) == 1
    said = (tmp_path / "first.log").read_text()
    assert "Traceback" not in said, said
    a, b = (record(tmp_path, f"{x}/train")["job_id"] for x in "ab")
    assert f"2 of 3 job(s) submitted (a/train as {a}, b/train as {b}); c/train: " in said
    assert "relaunch to finish" in said
    assert squeue_ids(under=tmp_path) == {a, b}  # nothing queued for c, nothing unrecorded

    (tmp_path / "runs" / "c" / "train" / "job.json").rmdir()
    second = start_launcher(folder, tmp_path / "second.log", "--backend", "slurm", env=env)
    assert second.wait(timeout=300) == 0, (tmp_path / "second.log").read_text()
    for name in ("a/train", "b/train", "c/train"):
        assert queued_as(name, tmp_path) == [record(tmp_path, name)["job_id"]]
