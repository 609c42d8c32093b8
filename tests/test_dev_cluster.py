"""The project's own test cluster (slurm/dev-cluster/up.sh), restarted after its daemons died."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from tests.conftest import ROOT, squeue_ids
from tests.helpers import alive, wait_until
from tests.helpers import job_pids as pids_of_job


def sbatch(tmp_path: Path, command: str) -> str:
    """A job on all four GPUs; its script lies in tmp_path, so the test's teardown cancels it if left."""
    script = tmp_path / f"{command.split()[0]}.sh"
    script.write_text(f"#!/bin/sh\n{command}\n")
    done = subprocess.run(
        ["sbatch", "--parsable", "-t", "10", "--gres=gpu:4", "-o", str(tmp_path / "%j.out"), str(script)],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def state(job_id: str) -> str:
    done = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-o", "State", "-j", job_id], capture_output=True, text=True
    )
    return done.stdout.strip()


def of_this_cluster(pids: list[int], state: Path) -> list[int]:
    """The processes among `pids` that this test cluster's slurmd started: their environment names its
    slurm.conf (a slurmstepd is reparented to PID 1, so its parent says nothing). Another cluster's, or
    a real one's on the same machine, are not this test's to kill."""
    conf = f"SLURM_CONF={state / 'etc' / 'slurm.conf'}".encode()
    found = []
    for pid in pids:
        try:
            if conf in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(pid)
        except OSError:
            continue
    return found


def live_pids(name: str) -> list[int]:
    """Pids of processes called `name` that are not zombies (PID 1 here does not reap)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.read_text().split(" (", 1)
        except OSError:
            continue
        comm, _, fields = rest.rpartition(") ")
        if comm == name and not fields.startswith("Z"):
            found.append(int(pid))
    return found


def test_a_restart_after_the_daemons_died_frees_the_node_of_the_jobs_of_their_previous_life(
    slurm_cluster, tmp_path
):
    # As when the machine stops or a session is killed: daemons and job processes die at once, while
    # slurmctld's saved state still lists the jobs. Restarted, it believed them running until their time
    # limit and held the GPUs (on CI, 18 minutes of the first tests' jobs waiting in the queue).
    running = sbatch(tmp_path, "sleep 300")
    waiting = sbatch(tmp_path, "sleep 300")
    wait_until(lambda: state(running) == "RUNNING", "the first job to run")
    job_pids = [int(row[0]) for row in pids_of_job(running)]
    # slurmctld saves its state every few seconds; stopped with TERM it saves it now, so that both jobs are
    # in it whatever the timing. Everything on the node dies at once.
    slurmctld = (slurm_cluster / "run" / "slurmctld.pid").read_text().strip()
    os.kill(int(slurmctld), signal.SIGTERM)
    # This cluster's own: another cluster's slurmctld on the machine (a second state dir) is left alone.
    wait_until(lambda: not alive(slurmctld), "slurmctld to save its state and stop")
    # slurmd.pid, or slurmd-n1.pid and slurmd-n2.pid in the two-node layout (SLURM_DEV_NODES=2).
    slurmds = [int(pidfile.read_text()) for pidfile in (slurm_cluster / "run").glob("slurmd*.pid")]
    for pid in [*slurmds, *of_this_cluster(live_pids("slurmstepd"), slurm_cluster), *job_pids]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    ours = lambda name: of_this_cluster(live_pids(name), slurm_cluster)  # noqa: E731
    wait_until(lambda: not any(ours(name) for name in ("slurmd", "slurmstepd")), "the node to die")

    up = subprocess.run(
        ["bash", str(ROOT / "slurm" / "dev-cluster" / "up.sh"), str(slurm_cluster)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert up.returncode == 0, up.stdout + up.stderr
    assert "cancelling 2 job(s) left from the cluster's previous run" in up.stdout + up.stderr
    assert squeue_ids() == set()
    wait_until(  # accounting reaches slurmdbd a moment later
        lambda: all(state(job).startswith("CANCELLED") for job in (running, waiting)),
        "both recorded cancelled",
    )
    # The node is whole again: a job asking for all of its GPUs runs at once.
    fresh = sbatch(tmp_path, "true")
    wait_until(lambda: state(fresh) == "COMPLETED", "a job on all four GPUs to run and end")
