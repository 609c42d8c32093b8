"""Where every job of a plan stands: one `squeue` call and at most one `sacct` call, whatever their number."""

from __future__ import annotations

import getpass
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from slurm.plan import Plan, PlannedJob
from slurm.rundir import current_job, done_hash, read_json
from slurm.states import State, from_slurm


@dataclass(frozen=True)
class SchedulerInfo:
    state: State
    reason: str = ""
    elapsed: str = ""
    exit_code: str = ""


@dataclass(frozen=True)
class JobStatus:
    job: PlannedJob
    state: State
    scheduler_id: str = ""
    reason: str = ""
    elapsed: str = ""
    step: int | None = None
    total_steps: int | None = None
    last_loss: float | None = None
    eta_s: float | None = None
    log_path: str = ""
    stuck: bool = False  # queued in SLURM but waiting on a dependency that can never be satisfied


def query_slurm(job_ids: list[str]) -> dict[str, SchedulerInfo]:
    """States of the given SLURM job ids: live ones from squeue, ended ones from sacct (if it answers)."""
    if not job_ids:
        return {}
    info = _squeue()
    missing = [j for j in job_ids if j not in info]
    if missing:
        info.update(_sacct(missing))
    return {j: info[j] for j in job_ids if j in info}


def _run(command: list[str]) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _squeue() -> dict[str, SchedulerInfo]:
    out = _run(["squeue", "-h", "-u", getpass.getuser(), "-o", "%i|%T|%r|%M"]) or ""
    info = {}
    for line in out.splitlines():
        job_id, state, reason, elapsed = (line.split("|") + ["", "", ""])[:4]
        reason = "" if reason in ("None", "(null)") else reason
        info[job_id.strip()] = SchedulerInfo(from_slurm(state), reason, elapsed)
    return info


def _sacct(job_ids: list[str]) -> dict[str, SchedulerInfo]:
    out = _run(
        ["sacct", "-n", "-P", "-X", "-j", ",".join(job_ids), "-o", "JobID,State,Elapsed,ExitCode,Reason"]
    )
    info = {}
    for line in (out or "").splitlines():
        parts = (line.split("|") + [""] * 5)[:5]
        job_id, state, elapsed, exit_code, reason = parts
        reason = "" if reason in ("None", "(null)") else reason
        # A requeued job appears once per attempt; the last line is the current one.
        info[job_id.strip()] = SchedulerInfo(from_slurm(state), reason, elapsed, exit_code)
    return info


def plan_status(plan: Plan, log_root: str) -> list[JobStatus]:
    records = {job.id: current_job(Path(job.run_dir)) for job in plan.jobs}
    slurm_ids = [r["job_id"] for r in records.values() if r and r.get("backend") == "slurm"]
    scheduler = query_slurm(slurm_ids)
    statuses: dict[str, JobStatus] = {}
    for job in plan.jobs:
        statuses[job.id] = job_status(job, records[job.id], scheduler, statuses, log_root)
    return list(statuses.values())


def job_status(job, record, scheduler, earlier: dict[str, JobStatus], log_root: str) -> JobStatus:
    run_dir = Path(job.run_dir)
    progress = read_json(run_dir / "progress.json", {}) or {}
    fields = {
        "step": progress.get("step"),
        "total_steps": progress.get("total_steps"),
        "last_loss": progress.get("last_loss"),
        "eta_s": progress.get("eta_s"),
    }
    scheduler_id = record["job_id"] if record else ""
    log_path = str(Path(log_root) / job.id / f"{scheduler_id}_0_log.out") if record else ""
    common = {"scheduler_id": scheduler_id, "log_path": log_path, **fields}
    if done_hash(run_dir) == job.config_hash:
        return JobStatus(
            job,
            State.COMPLETED,
            **common,
            elapsed=scheduler.get(scheduler_id, SchedulerInfo(State.COMPLETED)).elapsed,
        )
    failed_parent = next(
        (d.job_id for d in job.depends_on if d.kind == "afterok" and earlier[d.job_id].state.failed), None
    )
    if record is None:
        if failed_parent:
            return JobStatus(
                job, State.BLOCKED, reason=f"parent {failed_parent} {earlier[failed_parent].state.value}"
            )
        return JobStatus(job, State.PLANNED, **fields)
    if record.get("backend") == "local":
        info = SchedulerInfo(State.RUNNING if _pid_alive(scheduler_id) else State.FAILED)
    else:
        info = scheduler.get(scheduler_id, SchedulerInfo(State.UNKNOWN, "not known to squeue or sacct"))
    state, reason = info.state, info.reason
    stuck = state.live and "DependencyNeverSatisfied" in reason
    if stuck or (failed_parent and state in (State.CANCELLED, State.UNKNOWN)):
        parent = failed_parent or "a parent"
        state = State.BLOCKED
        reason = f"parent {parent} {earlier[parent].state.value}" if failed_parent else "a parent failed"
    return JobStatus(job, state, reason=reason, elapsed=info.elapsed, stuck=stuck, **common)


def _pid_alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, OSError):
        return False
    return True


def format_eta(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return time.strftime("%H:%M:%S", time.gmtime(max(0, seconds)))
