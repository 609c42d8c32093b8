"""One trainer per run folder (issue 38, rule 1): a job holds its folder for its life (core/writer_lock.py),
a second one refuses naming the first, a killed local controller takes its task with it, and a task
left training without its controller is seen by --status, --cancel and a relaunch. Real processes,
real locks, real submitit controllers killed with a real SIGKILL."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import launch
from core.job_records import record_job
from core.problems import ConfigError
from core.rundir import log_folder, write_spec
from core.states import State
from core.writer_lock import FolderHeld, hold_folder, holder, recorded_holder
from slurm.cluster.scheduler import descendants, gone, local_failure
from slurm.queueing.decisions import decide
from slurm.watching.status import plan_status
from tests.helpers import (
    ROOT,
    BlockingStage,
    PreviousCodeStage,
    experiment_folder,
    plan_for,
    start_local_job,
    wait_until,
)

HOLD = (
    "import sys\nfrom pathlib import Path\nfrom core.writer_lock import hold_folder\n"
    "with hold_folder(Path(sys.argv[1]), sys.argv[2]):\n"
    "    print('held', flush=True)\n    sys.stdin.read()\n"
)


def held(job, run_dir: Path):
    """The holder the job's task recorded once it holds `run_dir` (its log if the job ended first)."""
    found = wait_until(lambda: recorded_holder(run_dir) or job.done(), "the task to hold its folder", 60)
    assert found is not True, Path(job.paths.stdout).read_text()
    return found


@contextlib.contextmanager
def held_by_another_process(folder: Path, job_id: str):
    """A real process of job `job_id` holding `folder` until the block ends."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder), job_id],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout.readline() == "held\n"
        yield child
    finally:
        child.kill()
        child.wait()


@pytest.mark.slow
def test_second_trainer_in_same_folder_refused_naming_holder(tmp_path):
    folder = tmp_path / "runs" / "exp" / "train"
    with held_by_another_process(folder, "111") as first:
        with pytest.raises(FolderHeld) as refused, hold_folder(folder, "222"):
            pytest.fail("a second writer got the folder")
        said = str(refused.value)
        assert f"job 111, pid {first.pid} on {socket.gethostname()}" in said and "--cancel" in said
        # A second job's other ranks refuse too (none waits for a rank 0 that never comes)...
        with pytest.raises(FolderHeld), hold_folder(folder, "222", rank=1):
            pass
        # ...while the holder's own ranks are not refused by it.
        with hold_folder(folder, "111", rank=1):
            assert holder(folder).pid == first.pid


def test_another_rank_waits_for_rank_0s_record_instead_of_refusing_its_own_jobs_folder(tmp_path, monkeypatch):
    """Rank 0 locks, then records itself; rank 1 probing in between saw "a process that has not said who it
    is yet", took it for another job and failed the run (rank 1 of a requeued two-node job). It waits for
    the record now; a holder that never records itself is still refused, after the grace."""
    import core.writer_lock as writer_lock

    folder = tmp_path / "runs" / "exp" / "train"
    with held_by_another_process(folder, "111"):
        record = writer_lock.holder_path(folder).read_text()
        writer_lock.holder_path(folder).unlink()  # locked, not yet recorded
        assert holder(folder).pid == 0

        def rank_0_records(seconds):  # the first wait: rank 0 writes its record meanwhile
            writer_lock.holder_path(folder).write_text(record)

        monkeypatch.setattr(writer_lock.time, "sleep", rank_0_records)
        with hold_folder(folder, "111", rank=1):
            assert holder(folder).job_id == "111"
        writer_lock.holder_path(folder).unlink()
        monkeypatch.setattr(writer_lock.time, "sleep", lambda seconds: None)
        monkeypatch.setattr(writer_lock, "RECORD_GRACE_S", 0.05)
        with (
            pytest.raises(FolderHeld, match="has not said who it is yet"),
            hold_folder(folder, "111", rank=1),
        ):
            pytest.fail("a holder that never said who it is was taken for this job's rank 0")


def test_lock_released_when_holder_killed(tmp_path):
    folder = tmp_path / "runs" / "exp" / "train"
    with held_by_another_process(folder, "111") as first:
        first.send_signal(signal.SIGKILL)
        first.wait()
        assert recorded_holder(folder).pid == first.pid  # its record stays; the lock says it is gone
        assert holder(folder) is None
        with hold_folder(folder, "222"):  # at once: no stale lock to wait out or clean up
            assert recorded_holder(folder).job_id == "222"
    assert recorded_holder(folder) is None  # a holder that ends removes its record


def test_kill9_of_local_job_pid_leaves_no_orphan_trainer(tmp_path):
    run_dir = tmp_path / "runs" / "exp" / "train"
    job = start_local_job(tmp_path / "logs", BlockingStage(), run_dir)
    controller, task = int(job.job_id), None  # the pid --status shows for a local job
    try:
        task = held(job, run_dir).pid
        assert task in descendants(controller)
        os.kill(controller, signal.SIGKILL)
        job._process.wait()
        wait_until(lambda: gone(task), "the task to die with its controller", 30)
        assert holder(run_dir) is None  # and the folder is free for the relaunch
    finally:  # a failed test leaves nothing running (the task too, should it have outlived its parent)
        for pid in [controller, *descendants(controller), *([task] if task else [])]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_status_retry_and_cancel_see_a_live_trainer_whose_controller_was_killed(tmp_path, capsys):
    # The orphan is a job as older code (or a system without PR_SET_PDEATHSIG) leaves it: a real task
    # under a real controller killed with SIGKILL, holding its folder, with nothing to end it.
    configs = experiment_folder(tmp_path)
    plan = plan_for(folder=configs)
    train = next(j for j in plan.jobs if j.kind == "train")
    run_dir, logs = Path(train.run_dir), log_folder(plan.log_root, train.id)
    write_spec(run_dir, train.spec.model_dump())
    orphaned = start_local_job(logs, PreviousCodeStage(), run_dir)
    controller = orphaned.job_id
    record_job(run_dir, controller, "local")
    task = held(orphaned, run_dir).pid
    try:
        os.kill(int(controller), signal.SIGKILL)
        orphaned._process.wait()
        assert not gone(task)  # the orphan trains on: what the rest of this test must see

        row = next(r for r in plan_status(plan, plan.log_root) if r.job.id == train.id)
        assert row.state is State.RUNNING and f"pid {task}" in row.reason  # not FAILED
        decision = next(d for d in decide(plan) if d.job.id == train.id)
        assert (decision.action, decision.scheduler_id) == ("running", controller)  # not resubmitted

        # What --retry-failed started before: a second job in the folder. It fails, naming the first.
        second = start_local_job(logs, BlockingStage(), run_dir)
        wait_until(second.done, "the second job to refuse", 60)
        assert f"is held by another job (job {controller}, pid {task}" in local_failure(second)

        assert launch.main(["--cancel", "--all", "--config-dir", str(configs)]) == 0
        assert f"Cancelled 1 job(s): {train.id}" in capsys.readouterr().out
        assert gone(task) and holder(run_dir) is None
        row = next(r for r in plan_status(plan, plan.log_root) if r.job.id == train.id)
        assert row.state is State.CANCELLED
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(task, signal.SIGKILL)


@pytest.mark.slow
def test_a_trainer_started_by_hand_in_a_held_folder_refuses_naming_the_holder(tmp_path, tiny, capsys):
    import yaml

    from tests.train_helpers import make_job
    from train.__main__ import main

    run_dir = tmp_path / "runs" / "t" / "s"
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(make_job(tiny, run_dir).model_dump(mode="json")))
    with held_by_another_process(run_dir, "111") as first:
        assert main([str(spec)]) == 1
    said = capsys.readouterr().err
    assert f"error: {run_dir} is held by another job (job 111, pid {first.pid}" in said
    assert "Traceback" not in said and not (run_dir / "metrics.jsonl").exists()


def test_a_folder_held_by_a_job_no_record_knows_is_refused_never_archived_under_it(tmp_path, capsys):
    """H2: the running job's job.json lost, the config changed: the relaunch renamed the running job's
    folder to train.old-DATE and a second trainer wrote beside the first (steps 600, 1, 620, 20, ...)."""
    from slurm.queueing.decisions import archive_stale

    configs = experiment_folder(tmp_path)
    (job,) = [j for j in plan_for(folder=configs).jobs if j.kind == "train"]
    run_dir = Path(job.run_dir)
    old = job.spec.model_dump()
    old["train"]["learning_rate"] = 9e-4  # what the running job was started with
    write_spec(run_dir, old)
    with held_by_another_process(run_dir, "13") as running:
        code = launch.main(["--all", "--config-dir", str(configs), "--dry-run"])
        err = capsys.readouterr().err
        assert (
            code == 0
            and f"a/train: its run folder is held by a job this launch has no record of (job 13, pid {running.pid}"
            in err
        ), err
        with pytest.raises(ConfigError, match="held by a job this launch has no record of"):
            decide(plan_for(folder=configs))  # what a launch decides before it submits or archives
        with pytest.raises(ConfigError, match="held by a job"):
            archive_stale(job)  # and by construction: never renamed while held
        assert run_dir.is_dir() and not list(run_dir.parent.glob("train.old-*"))
        assert holder(run_dir).pid == running.pid


def test_a_dead_jobs_writer_record_never_refuses_its_successors_ranks(tmp_path, monkeypatch):
    """M2: kill -9 of a local 2-rank job's controller left its .writer.json; rank 1 of --retry-failed read
    it while the new rank 0 held the lock but had not yet recorded itself, and refused its own job's folder
    (rank 0 then waited out the 120 s join timeout). Rank 1 waits until the record is its own job's."""
    import core.writer_lock as writer_lock

    folder = tmp_path / "runs" / "exp" / "train"
    dead = subprocess.Popen(["true"])
    dead.wait()
    with held_by_another_process(folder, "222"):  # the retry's rank 0: locked...
        record = writer_lock.holder_path(folder).read_text()
        stale = {
            "host": socket.gethostname(),
            "pid": dead.pid,
            "job_id": "27320",
            "since": "2026-12-06 10:00:00",
        }
        writer_lock.holder_path(folder).write_text(
            json.dumps(stale)
        )  # ...the killed job's record still there
        assert holder(folder).job_id == "27320"

        def rank_0_records(seconds):  # the first wait: rank 0 writes its record meanwhile
            writer_lock.holder_path(folder).write_text(record)

        monkeypatch.setattr(writer_lock.time, "sleep", rank_0_records)
        with hold_folder(folder, "222", rank=1):
            assert holder(folder).job_id == "222"
