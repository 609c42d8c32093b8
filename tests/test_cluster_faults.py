"""Survive the cluster, for real: requeue, time limits, a cancelled parent, a killed job, a torn checkpoint.

Each test submits real jobs to the dev SLURM cluster and drives faults with SLURM's own commands.
Waiting is always for a condition (a file, a state), never a fixed sleep.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

from submitit.core.utils import JobPaths

import launch
from core.states import State
from slurm.watching.status import query_slurm
from tests.helpers import fault_experiment, slurm_id, submit, wait_until
from tests.train_helpers import (
    assert_every_step_logged_once,
    assert_same_adapter,
    assert_same_curve,
    logged_losses,
    tensorboard_losses,
)
from train.checkpoints import MARKER, latest_valid_checkpoint, step_of


def steps_per_epoch(repo_root: Path, batch_size: int = 8) -> int:
    rows = (repo_root / "data" / "demo" / "sql" / "train.jsonl").read_text().splitlines()
    return math.ceil(len(rows) / batch_size)


def test_scontrol_requeue_of_an_array_task_mid_run_resumes_to_the_same_adapter(
    repo_root, tmp_path, slurm_cluster, tiny, monkeypatch
):
    # Two points of one sweep, identical but for how often they checkpoint, run side by side as one job
    # array (same CPU count, so the same arithmetic); only one task is requeued mid-run: at its first
    # checkpoint (step 8) of 150, mid-epoch.
    monkeypatch.chdir(repo_root)
    extra = "sweep: {grid: {train.save_every_steps: [8, 16]}}"
    folder = fault_experiment(repo_root, tmp_path, "fault", epochs=5, save=8, extra=extra)
    assert submit(folder) == 0
    requeued, straight = "fault-save_every_steps8/train", "fault-save_every_steps16/train"
    run_dir = tmp_path / "runs" / requeued
    job_id = slurm_id(tmp_path, requeued)
    assert job_id.endswith("_0") and slurm_id(tmp_path, straight) == job_id[:-1] + "1"  # tasks of one array
    wait_until(lambda: latest_valid_checkpoint(run_dir / "checkpoints"), "a first checkpoint")
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    assert submit(folder, "--wait") == 0  # nothing new is submitted; it waits for the requeued task
    assert slurm_id(tmp_path, requeued) == job_id  # same task of the same array, second run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] is not None
    assert_every_step_logged_once(run_dir, summary["global_step"])
    # TensorBoard (on by default) shows the same curve: the steps the first run logged after its
    # checkpoint, logged again after the requeue, are purged, not drawn twice.
    assert_same_curve(tensorboard_losses(run_dir), logged_losses(run_dir))
    assert_same_adapter(tmp_path / "runs" / straight, run_dir)


def training_steps_per_second(tiny, run_dir: Path, steps: int = 100) -> float:
    """This machine's speed on the time-limit test's training, measured here as the job will run it (one CPU
    thread, same model, data, batch, logging and checkpointing), so its length can be set in seconds."""
    import torch

    from tests.train_helpers import make_job, sql_data
    from train.recipe import run_stage

    job = make_job(
        tiny, run_dir, data=sql_data("train"), max_steps=steps, save_every_steps=100, logging_steps=4
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert run_stage(job) == "completed"
    finally:
        torch.set_num_threads(threads)
    return steps / json.loads((run_dir / "summary.json").read_text())["train_runtime_s"]


def test_time_limit_is_survived_by_repeated_requeues(repo_root, tmp_path, slurm_cluster, tiny, monkeypatch):
    # A 1-minute limit and training that needs two minutes of compute on this machine. SLURM's USR2 comes 10 to
    # 40 s before the limit (it checks limits every 30 s and signals early rather than late); a requeued
    # allocation starts about 16 s after the tick that signalled the last one, so it is signalled 44 s
    # after its start, and the first one at most 50 s after its. Less their start-up (Python imports: 20 to
    # 30 s on a loaded 2-core machine, a few on an idle one), two allocations train for at most ~85 s
    # together: at least three allocations, two requeues, each resuming from the checkpoint the previous
    # one saved, until the job completes. Each allocation costs a minute of wall time whatever it trains,
    # so the compute is kept near that bound (x1.4: the job may run faster than it was measured).
    monkeypatch.chdir(repo_root)
    per_epoch = steps_per_epoch(repo_root)
    # The faster of two measurements (each 100 steps, ~10 s): one taken while something else loaded the
    # machine would make the job too short to need two requeues once that load is gone.
    speed = max(training_steps_per_second(tiny, tmp_path / f"calibration-{k}") for k in (1, 2))
    epochs = math.ceil(120 * speed / per_epoch)
    folder = fault_experiment(
        repo_root,
        tmp_path,
        "limited",
        epochs=epochs,
        save=100,
        time="00:01:00",
        signal_delay_s=10,
        requeues=30,
    )
    assert submit(folder, "--wait") == 0
    run_dir = tmp_path / "runs" / "limited" / "train"
    log = JobPaths(
        tmp_path / "logs" / "limited" / "train", slurm_id(tmp_path, "limited/train")
    ).stdout.read_text()
    assert log.count("received SIGUSR2: stopping at the next step end") >= 2, log[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == epochs * per_epoch
    assert summary["resumed_from"] is not None
    assert_every_step_logged_once(run_dir, summary["global_step"])
    print(
        f"{epochs} epochs ({epochs * per_epoch} steps) through {log.count('received SIGUSR2') + 1} allocations"
    )


def test_cancelled_stage_blocks_its_dependents_until_retried(
    repo_root, tmp_path, slurm_cluster, tiny, monkeypatch, capsys
):
    monkeypatch.chdir(repo_root)
    stages = "stages:\n  - name: one\n  - name: two\n"
    evaluation = "{metrics: [exact_match], limit: 4, max_new_tokens: 8}"
    folder = fault_experiment(
        repo_root, tmp_path, "curriculum", epochs=3, extra=stages, evaluation=evaluation
    )
    assert submit(folder) == 0
    one = slurm_id(tmp_path, "curriculum/one")
    children = [slurm_id(tmp_path, "curriculum/two"), slurm_id(tmp_path, "curriculum/eval")]
    subprocess.run(["scancel", one], check=True)
    wait_until(
        lambda: all(i.state is State.CANCELLED for i in query_slurm(children).values()), "children cancelled"
    )
    capsys.readouterr()
    assert launch.main(["--status", "--config-dir", str(folder)]) == 0
    status = capsys.readouterr().out
    assert "curriculum/two: BLOCKED, will not run: parent curriculum/one CANCELLED" in status
    assert "curriculum/eval: BLOCKED" in status
    assert not (tmp_path / "runs" / "curriculum" / "two" / "metrics.jsonl").exists()

    assert launch.main(["--retry-failed", "--config-dir", str(folder), "--backend", "slurm", "--wait"]) == 0
    for job in ("one", "two", "eval"):
        assert (tmp_path / "runs" / "curriculum" / job / "DONE").is_file()
    assert slurm_id(tmp_path, "curriculum/one") != one


def test_killed_job_with_a_torn_checkpoint_resumes_from_the_last_valid_one(
    repo_root, tmp_path, slurm_cluster, tiny, monkeypatch
):
    monkeypatch.chdir(repo_root)
    # Killed at its first checkpoint (step 8) of 150.
    folder = fault_experiment(repo_root, tmp_path, "killed", epochs=5, save=8)
    assert submit(folder) == 0
    run_dir = tmp_path / "runs" / "killed" / "train"
    job_id = slurm_id(tmp_path, "killed/train")
    wait_until(lambda: latest_valid_checkpoint(run_dir / "checkpoints"), "a first checkpoint")
    subprocess.run(["scancel", "--signal=KILL", "--full", job_id], check=True)
    wait_until(
        lambda: query_slurm([job_id]).get(job_id, None) and not query_slurm([job_id])[job_id].state.live,
        "the killed job to end",
    )
    good = latest_valid_checkpoint(run_dir / "checkpoints")
    # SIGKILL landing inside a save cannot be timed from outside; its aftermath is made by hand (a fake,
    # the only one here): a newer checkpoint folder without its commit marker and with a cut state file.
    torn = run_dir / "checkpoints" / f"checkpoint-{step_of(good) + 1}"
    subprocess.run(["cp", "-r", str(good), str(torn)], check=True)
    (torn / MARKER).unlink()
    (torn / "trainer_state.json").write_text('{"global_step": ')
    assert launch.main(["--retry-failed", "--config-dir", str(folder), "--backend", "slurm", "--wait"]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] == str(good)
    assert (run_dir / "DONE").is_file()
    # Killed without a last save, the first run had logged steps past its checkpoint; the second logged
    # them again. TensorBoard shows each step once, with the second run's values, as metrics.jsonl does.
    assert_every_step_logged_once(run_dir, summary["global_step"])
    assert_same_curve(tensorboard_losses(run_dir), logged_losses(run_dir))
