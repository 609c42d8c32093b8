"""From a plan to queued jobs, idempotently: what is done is skipped, what is queued is not queued twice.

Every decision is made before the first sbatch, so a refusal leaves nothing half-submitted; an sbatch that
fails midway cancels what this launch had queued.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from slurm.pack import unit_of
from slurm.plan import Plan, PlannedJob
from slurm.problems import ConfigError, Problem
from slurm.rundir import changed_keys, current_job, done_hash, read_spec, record_job, write_spec
from slurm.states import State
from slurm.status import query_slurm
from train.config import Resources

Action = Literal["submit", "done", "queued", "held"]


@dataclass(frozen=True)
class Decision:
    job: PlannedJob
    action: Action
    scheduler_id: str = ""  # the live job's id when action == "queued"


class LaunchError(Exception):
    """The scheduler refused a submission; what this launch had queued was cancelled."""


def decide(plan: Plan, force: bool = False) -> list[Decision]:
    """Raise ConfigError if a finished stage's config changed (unless force); else say what to do per job."""
    records = {job.id: current_job(Path(job.run_dir)) for job in plan.jobs}
    slurm_ids = [r["job_id"] for r in records.values() if r and r.get("backend") == "slurm"]
    live = {k: v for k, v in query_slurm(slurm_ids).items() if v.state.live}
    decisions, refusals = [], []
    for job in plan.jobs:
        run_dir, record = Path(job.run_dir), records[job.id]
        finished = done_hash(run_dir)
        if finished == job.config_hash:
            decisions.append(Decision(job, "done"))
        elif record and record["job_id"] in live:
            if (read_spec(run_dir) or {}) == job.spec.model_dump():
                decisions.append(Decision(job, "queued", record["job_id"]))
            else:
                refusals.append(
                    refusal(job, f"is queued as SLURM job {record['job_id']}", "--cancel it first")
                )
        elif finished and not force:
            refusals.append(
                refusal(
                    job,
                    "already finished",
                    "rerun with --force to keep the old run as an archive and run it again",
                )
            )
        else:
            decisions.append(Decision(job, "submit"))
    if refusals:
        raise ConfigError(refusals)
    return decisions


def with_dependents(plan: Plan, job_ids: set[str]) -> set[str]:
    """The given jobs and everything downstream of them (plan order puts parents first)."""
    chosen = set(job_ids)
    for job in plan.jobs:
        if any(d.job_id in chosen for d in job.depends_on):
            chosen.add(job.id)
    return chosen


def hold_all_but(decisions: list[Decision], job_ids: set[str]) -> list[Decision]:
    """Keep submitting only `job_ids`; others that would have been submitted are held back."""
    return [
        Decision(d.job, "held") if d.action == "submit" and d.job.id not in job_ids else d for d in decisions
    ]


def refusal(job: PlannedJob, what: str, hint: str) -> Problem:
    old = read_spec(Path(job.run_dir)) or {}
    keys = changed_keys(old, job.spec.model_dump()) or ["(a stage it starts from)"]
    return Problem(
        f"{job.run_dir}/config.yaml",
        "",
        f"{job.id} {what} with another config (changed: {', '.join(keys)}); {hint}",
    )


def archive_stale(job: PlannedJob) -> Path | None:
    """A run folder from another config (a finished one with --force, or stale checkpoints that would
    crash or mislead on resume) is moved aside, never deleted."""
    run_dir = Path(job.run_dir)
    old = read_spec(run_dir)
    if not run_dir.exists() or old is None or old == job.spec.model_dump():
        return None
    target = run_dir.with_name(f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.rename(target)
    return target


def parents_of(job: PlannedJob, ids: dict[str, str]) -> list[tuple[str, str]]:
    """(scheduler id, kind) of the parents still to end; a parent that is done needs no dependency."""
    return [(ids[d.job_id], d.kind) for d in job.depends_on if d.job_id in ids]


def submit_to_slurm(decisions: list[Decision], backend) -> dict[str, str]:
    """Queue every job that needs it, parents first; returns plan id → SLURM id for queued jobs."""
    ids = {d.job.id: d.scheduler_id for d in decisions if d.action == "queued"}
    submitted: list[str] = []
    for decision in decisions:
        if decision.action != "submit":
            continue
        job = decision.job
        archive_stale(job)
        try:
            ids[job.id] = backend.submit(job, parents_of(job, ids))
        except Exception as exc:
            backend.cancel(submitted)
            raise LaunchError(
                f"submitting {job.id} failed, so the {len(submitted)} job(s) queued by this launch were "
                f"cancelled: {str(exc).strip()}"
            ) from None
        submitted.append(ids[job.id])
        code = backend.code.provenance()
        write_spec(Path(job.run_dir), job.spec.model_dump(), code)
        record_job(Path(job.run_dir), ids[job.id], "slurm", code)
    return ids


def submit_pack(decisions: list[Decision], backend, resources: Resources) -> dict[str, str]:
    """Queue every job that needs it as a unit of one packed allocation (one sbatch: it is queued whole or
    not at all); returns plan id → SLURM id, the allocation's for every unit."""
    ids = {d.job.id: d.scheduler_id for d in decisions if d.action == "queued"}
    todo = [d.job for d in decisions if d.action == "submit"]
    # Inside the allocation units wait for units. Parents queued as jobs of their own hold the whole
    # allocation until they end (afterany: one failing must not cancel the pack's unrelated units); a unit
    # that needs such a parent's adapter checks its DONE when its turn comes (slurm/lanes.py).
    held_by = sorted({(slurm_id, "afterany") for job in todo for slurm_id, _ in parents_of(job, ids)})
    plan_jobs = {d.job.id: d.job for d in decisions}
    inside = {job.id for job in todo}
    for job in todo:
        archive_stale(job)
    units = [
        unit_of(
            job,
            backend.profile.log_dir,
            [(plan_jobs[d.job_id], d.kind) for d in job.depends_on if d.job_id not in inside],
        )
        for job in todo
    ]
    try:
        pack_id = backend.submit_pack(units, resources, held_by)
    except Exception as exc:
        raise LaunchError(f"submitting the pack of {len(todo)} job(s) failed: {str(exc).strip()}") from None
    code = backend.code.provenance()
    for job in todo:
        write_spec(Path(job.run_dir), job.spec.model_dump(), code)
        record_job(Path(job.run_dir), pack_id, "slurm", code, pack=True)
        ids[job.id] = pack_id
    return ids


def run_locally(decisions: list[Decision], backend, report) -> dict[str, State]:
    """Run the jobs that need it on this machine, in dependency order; blocks until all ended."""
    todo = [d.job for d in decisions if d.action == "submit"]
    pending_ids = {job.id: job.id for job in todo}

    code = backend.code.provenance()

    def on_start(job: PlannedJob, pid: str, gpus: tuple[str, ...]) -> None:
        write_spec(Path(job.run_dir), job.spec.model_dump(), code)
        record_job(Path(job.run_dir), pid, "local", code, gpus=gpus)
        report(job, "RUNNING", f"pid {pid}")

    def on_end(job: PlannedJob, state: State, reason: str) -> None:
        report(job, state.value, reason)

    for job in todo:
        archive_stale(job)
    return backend.run(todo, lambda job: parents_of(job, pending_ids), on_start, on_end)
