"""Data parallelism on the dev cluster across two real nodes (slurmd n1 and n2, tests/conftest.py
two_node_cluster): one SLURM task per (fake) GPU on each node, one DDP run over gloo on CPUs.

The trainer's side (each example once across the ranks, the loss of one process with the same global
batch, a stop seen by one rank) is tested with two local processes in tests/test_train_ddp.py; here the
same run goes through sbatch, submitit's task environment, the rendezvous at the first node's address
and SLURM's own requeue and signals, and an elastic job (`nodes: 1-2`) that SLURM sends back to one node
goes on with twice the accumulation. The one-node shape (1 node x 2 GPUs) is the reference it is held to.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from submitit.core.utils import JobPaths

import launch
from slurm.cluster.profile import load_profile
from slurm.cluster.rendezvous import rendezvous_port
from slurm.watching.status import plan_status
from tests.helpers import (
    fault_experiment,
    job_pids,
    plan_for,
    progress_step,
    slurm_id,
    submit,
    wait_until,
)
from tests.train_helpers import assert_every_step_logged_once, assert_same_adapter
from train.checkpoints import latest_valid_checkpoint, step_of


def task_log(tmp_path, job: str, rank: int) -> str:
    return JobPaths(tmp_path / "logs" / job, slurm_id(tmp_path, job), task_id=rank).stdout.read_text()


def command_line(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:  # ended meanwhile
        return ""


def task_pids(job_id: str) -> dict[int, int]:
    """{global task id: pid} of a running job, from SLURM itself (`scontrol listpids`)."""
    pids = {}
    for pid, _, step, _, task in job_pids(job_id):
        # The srun step's task processes (not the batch script, nor a task's own children).
        if step.isdigit() and task.isdigit() and "submitit" in command_line(pid):
            pids[int(task)] = int(pid)
    return pids


def test_an_elastic_job_trains_the_adapter_of_one_node_with_two_gpus_through_usr2_a_requeue_and_a_lost_node(
    repo_root, tmp_path, two_node_cluster, tiny, monkeypatch, capsys
):
    monkeypatch.chdir(repo_root)
    # `nodes: 1-2` x 1 GPU (stopped mid-run, requeued twice, the second time onto one node) against 1 node x
    # 2 GPUs (straight): the same global batch throughout, so the same examples in each step and the same
    # adapter (LoRA dropout 0, fp32).
    folder = fault_experiment(repo_root, tmp_path, "requeued", epochs=8, save=1000, gpus=1, nodes="1-2")
    fault_experiment(repo_root, tmp_path, "straight", epochs=8, save=1000, gpus=2)
    assert launch.main(["--all", "--config-dir", str(folder), "--dry-run", "--json"]) == 0
    planned = {job["id"]: job for job in json.loads(capsys.readouterr().out)["jobs"]}
    assert (planned["requeued/train"]["tasks"], planned["requeued/train"]["effective_batch"]) == (2, 16)
    assert planned["requeued/train"]["placement"] == "1-2 nodes x 1 GPU"
    assert submit(folder) == 0
    run_dir = tmp_path / "runs" / "requeued" / "train"
    job_id = slurm_id(tmp_path, "requeued/train")
    wait_until(lambda: progress_step(run_dir) >= 4, "training under way")
    pids = wait_until(lambda: (found := task_pids(job_id)).keys() >= {0, 1} and found, "both task pids")
    # SLURM signals every task of the step; a signal that reaches one task only (a rank slow to install
    # its handler, a user's `kill`) must not leave the other rank, on the other node, waiting in its next
    # all-reduce: both stop at one checkpoint and the job requeues.
    os.kill(pids[1], signal.SIGUSR2)  # rank 1 only, on n2
    stopped = step_of(
        wait_until(lambda: latest_valid_checkpoint(run_dir / "checkpoints"), "the stop's checkpoint")
    )
    # Resumed on both nodes (new task processes, past the checkpoint), it then loses n2 (drained, as an
    # admin takes a failing node out) and is requeued by hand mid-run: the third run gets n1 alone, goes on
    # from the last checkpoint with each step's examples accumulated on one rank, and no optimizer step is
    # lost or taken twice across the three.
    wait_until(
        lambda: (
            (found := task_pids(job_id)).keys() >= {0, 1}
            and set(found.values()).isdisjoint(pids.values())
            and progress_step(run_dir) >= stopped + 2
        ),
        "the resumed run training on both nodes",
    )
    subprocess.run(["scontrol", "update", "NodeName=n2", "State=DRAIN", "Reason=elastic-test"], check=True)
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    assert submit(folder, "--wait") == 0  # the requeued job resumes on one node and completes: no hang
    assert slurm_id(tmp_path, "requeued/train") == job_id  # same SLURM job, its third run
    statuses = {s.job.id: s for s in plan_status(plan_for(folder=folder), load_profile(folder)[0].log_dir)}
    assert statuses["requeued/train"].nodes == "n1"  # what the last run got, as --status shows it

    for name, ranks in (("requeued", 1), ("straight", 2)):
        summary = json.loads((tmp_path / "runs" / name / "train" / "summary.json").read_text())
        assert (summary["world_size"], summary["rank_devices"]) == (ranks, ["cpu"] * ranks)
        assert summary["global_step"] == 8 * 15  # 240 examples / (8 x 2) a step, 8 epochs
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["split"]["micro_batch"], summary["split"]["grad_accum"]) == (
        8,
        2,
    )  # twice the accumulation
    resumed = step_of(Path(summary["resumed_from"]))
    assert 4 <= stopped <= resumed < 8 * 15  # the checkpoint both ranks stopped at, or one saved after it
    assert_every_step_logged_once(run_dir, summary["global_step"])
    assert_same_adapter(tmp_path / "runs" / "straight" / "train", run_dir, relative=1e-4)
    assert "elastic: 1 of 2 ranks, so each rank accumulates 1 x 2 / 1 = 2 steps" in task_log(
        tmp_path, "requeued/train", 0
    )

    # One log per task, each on its own node; rank 0's node and address are said in every task's log.
    port = rendezvous_port(job_id)
    for rank, node in ((0, "n1"), (1, "n2")):
        log = task_log(tmp_path, "requeued/train", rank)
        assert f"rank {rank} of 2 on cpu (gloo)" in log
        assert (
            f"rank 0 of 2 is on n1 (127.0.0.1:{port}); this task is rank {rank} on {node}, node {rank} of 2"
            in log
        )
        # n1's NodeAddr (scontrol show node n1) is loopback here, so gloo stays on lo.
        assert f"joining 2 ranks at 127.0.0.1:{port} (gloo on lo)" in log
    capsys.readouterr()
    tail = ["--config-dir", str(folder), "--tail", "requeued/train"]
    assert launch.main([*tail, "--rank", "1"]) == 0
    shown = capsys.readouterr().out
    assert "rank1 INFO" in shown and "rank0 INFO" not in shown
    assert launch.main([*tail, "--rank", "2"]) == 2
    assert "runs 2 task(s): --rank is one of 0-1" in capsys.readouterr().err


def sacct_state(job_id: str) -> str:
    done = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-o", "State", "-j", job_id], capture_output=True, text=True
    )
    return done.stdout.strip()


def test_kill_9_of_the_rank_on_node_two_fails_the_job_at_once_naming_rank_and_node_and_a_retry_resumes(
    repo_root, tmp_path, two_node_cluster, tiny, monkeypatch
):
    # A rank that dies (OOM killer, a node's fault) must not leave rank 0 waiting in its next all-reduce
    # for the group's 30-minute timeout: srun --kill-on-bad-exit ends the step, the job FAILS; and
    # --retry-failed resumes it from its last checkpoint on both nodes, losing no step and repeating none.

    monkeypatch.chdir(repo_root)
    folder = fault_experiment(repo_root, tmp_path, "killed", epochs=4, save=4, gpus=1, nodes=2)
    assert submit(folder) == 0
    run_dir = tmp_path / "runs" / "killed" / "train"
    job_id = slurm_id(tmp_path, "killed/train")
    wait_until(lambda: latest_valid_checkpoint(run_dir / "checkpoints"), "a first checkpoint")
    pids = wait_until(lambda: (found := task_pids(job_id)).keys() >= {0, 1} and found, "both task pids")
    killed_at = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)  # rank 1, on n2
    wait_until(lambda: sacct_state(job_id) == "FAILED", "the job to fail", timeout_s=120)
    assert time.monotonic() - killed_at < 60  # seconds, not a collective's timeout
    statuses = {s.job.id: s for s in plan_status(plan_for(folder=folder), load_profile(folder)[0].log_dir)}
    assert statuses["killed/train"].state.value == "FAILED"
    assert "rank 1 on n2: Killed" in statuses["killed/train"].reason
    assert statuses["killed/train"].nodes == "n[1-2]"  # sacct's NodeList, as --status shows it
    checkpoint = step_of(latest_valid_checkpoint(run_dir / "checkpoints"))
    assert launch.main(["--retry-failed", "--config-dir", str(folder), "--backend", "slurm", "--wait"]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["world_size"], summary["global_step"]) == (2, 4 * 15)
    assert step_of(Path(summary["resumed_from"])) >= checkpoint
    assert_every_step_logged_once(run_dir, summary["global_step"])


def test_a_sweep_of_two_node_points_is_one_array_whose_tasks_each_span_both_nodes_on_a_port_of_their_own(
    repo_root, tmp_path, two_node_cluster, tiny, monkeypatch, capsys
):
    """A multi-node point is an array task like any other: its own allocation of both nodes, its DDP
    rendezvous at rank 0's node on a port derived from its own `123_4` id (as submitit's job id reads for an
    array task), so two tasks, or a task and another job, never share one. Before: tested with one node."""
    from submitit.core.utils import JobPaths as Paths

    monkeypatch.chdir(repo_root)
    folder = fault_experiment(
        repo_root, tmp_path, "wide", epochs=1, save=1000, gpus=1, nodes=2, extra="sweep: {seeds: [1, 2]}"
    )
    assert submit(folder, "--wait") == 0
    assert "1 job array(s)" in capsys.readouterr().out
    tasks = {seed: slurm_id(tmp_path, f"wide-s{seed}/train") for seed in (1, 2)}
    (array,) = {task.split("_")[0] for task in tasks.values()}
    assert sorted(tasks.values()) == [f"{array}_0", f"{array}_1"]
    ports = {rendezvous_port(task) for task in tasks.values()}
    assert len(ports) == 2
    for seed, task in tasks.items():
        summary = json.loads((tmp_path / "runs" / f"wide-s{seed}" / "train" / "summary.json").read_text())
        assert (summary["world_size"], summary["global_step"]) == (2, 15)  # 240 examples / (8 x 2)
        port = rendezvous_port(task)
        for rank, node in ((0, "n1"), (1, "n2")):
            log = Paths(tmp_path / "logs" / "arrays", task, task_id=rank).stdout.read_text()
            assert f"rank {rank} of 2 on cpu (gloo)" in log
            assert f"rank 0 of 2 is on n1 (127.0.0.1:{port}); this task is rank {rank} on {node}" in log
