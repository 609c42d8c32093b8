"""From a plan to queued jobs, idempotently: what is done is skipped, what is queued or still running (on
SLURM or on this machine) is not started twice.

Every decision is made before the first sbatch, so a refusal leaves nothing half-submitted; an sbatch that
the scheduler refuses midway cancels what this launch had queued. Each submission is announced in its
job.json before sbatch (an intent with a token the job's comment carries): a launch killed while sbatch
runs, or a job.json that cannot be written once it returned, leaves a job the next launch finds in the
queue and records, never one queued twice. A run folder that cannot be written, or Ctrl-C, stops a launch
with what is queued kept and recorded, and says so: a relaunch finishes it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from slurm.pack import unit_of
from slurm.plan import Plan, PlannedJob
from slurm.states import State
from slurm.status import config_changes, named_changes, query_slurm
from spec.config import Resources
from spec.files import warn_unreadable
from spec.layout import archive_folder
from spec.problems import ConfigError, Problem
from spec.rundir import (
    UNREADABLE,
    RunDir,
    current_job,
    done_hash,
    foreign_done,
    forget_intent,
    mark_cancelled,
    pending_submission,
    record_intent,
    record_job,
    results_lost,
    write_spec,
)

# queued: a live SLURM job; running: a local job an earlier launch started, still running (its launcher
# may be gone: killed, a dropped SSH session); both are never started again.
# refused: a launch would stop on it (weigh); decide raises before any such decision leaves it.
Action = Literal["submit", "done", "queued", "running", "held", "refused"]
LIVE_AS = {"queued": "is queued as SLURM job", "running": "is still running on this machine as pid"}


@dataclass(frozen=True)
class Decision:
    job: PlannedJob
    action: Action
    scheduler_id: str = ""  # the live job's id: a SLURM job id when "queued", a pid when "running"


class LaunchError(Exception):
    """A launch stopped midway; the message says what it left queued or running. Exit code 1."""

    exit_code = 1


class Interrupted(LaunchError):
    """Ctrl-C during a launch; the message says what it left queued and what it stopped."""

    exit_code = 130


def decide(plan: Plan, force: bool = False) -> list[Decision]:
    """Raise ConfigError if a finished stage's config changed (unless force); else say what to do per job."""
    decisions, refusals = weigh(plan, force)
    if refusals:
        raise ConfigError(refusals)
    return decisions


def weigh(plan: Plan, force: bool = False) -> tuple[list[Decision], list[Problem]]:
    """What a launch would do with each job, and why it would refuse some (their action: "refused"):
    decide's reasoning, for a dry run too. One squeue call when some job was queued on SLURM."""
    records = {job.id: current_job(Path(job.run_dir)) for job in plan.jobs}
    slurm_ids = [r["job_id"] for r in records.values() if r and r.get("backend") == "slurm"]
    live = {k: v for k, v in query_slurm(slurm_ids).items() if v.state.live}
    decisions, refusals = [], []
    for job in plan.jobs:
        run_dir, record = Path(job.run_dir), records[job.id]
        finished = done_hash(run_dir)
        if results_lost(run_dir, job.config_hash, job.kind):
            warn_unreadable(
                RunDir(run_dir).results, "missing or unreadable after its DONE", "the eval runs again"
            )
            finished = None
        live_as = live_action(plan.log_root, job, record, live) if finished != job.config_hash else None
        if finished == job.config_hash:
            decisions.append(Decision(job, "done"))
        elif live_as:
            if config_changes(job) == []:  # the live job runs this very config
                decisions.append(Decision(job, live_as, record["job_id"]))
            else:
                refusals.append(refusal(job, f"{LIVE_AS[live_as]} {record['job_id']}", "--cancel it first"))
                decisions.append(Decision(job, "refused", record["job_id"]))
        elif finished and not force and job.kind != "export":  # an export redoes itself in place (below)
            refusals.append(
                refusal(
                    job,
                    "already finished",
                    "rerun with --force to keep the old run as an archive and run it again",
                )
            )
            decisions.append(Decision(job, "refused"))
        else:
            decisions.append(Decision(job, "submit"))
    return decisions, refusals


def live_action(log_root: str, job: PlannedJob, record: dict | None, live_slurm) -> Action | None:
    """ "queued" when the record's SLURM job is live, "running" when its local job still runs; else None.
    A stage has at most one live trainer, whatever the backend that started it."""
    if not record:
        return None
    if record.get("backend", "slurm") != "local":
        return "queued" if record["job_id"] in live_slurm else None
    from slurm.scheduler import local_alive, scheduler_job  # submitit: only once a local job was recorded

    return "running" if local_alive(scheduler_job(log_root, job.id, record)) else None


def refuse_crossing_backends(decisions: list[Decision], backend: str) -> None:
    """A job to start waits only on parents its own backend can wait for: a SLURM job cannot wait on a
    process of this machine, nor a local job on a SLURM job (it would start before its parent ended)."""
    live = {d.job.id: d for d in decisions if d.action in ("queued", "running")}
    foreign = "running" if backend == "slurm" else "queued"
    hint = {
        "running": "a SLURM job cannot wait for it: relaunch once it ended (--status), or --cancel it",
        "queued": "a local job cannot wait for it: relaunch with --backend slurm, or once it ended",
    }[foreign]
    problems = [
        Problem(
            f"{parent.job.run_dir}/job.json",
            "",
            f"{d.job.id} needs {parent.job.id}, which {LIVE_AS[foreign]} {parent.scheduler_id}; {hint}",
        )
        for d in decisions
        if d.action == "submit"
        for dep in d.job.depends_on
        if (parent := live.get(dep.job_id)) and parent.action == foreign
    ]
    if problems:
        raise ConfigError(problems)


def adopt_unrecorded(plan: Plan, forget_missing: bool) -> list[str]:
    """Submissions cut short after their intent was written (the launcher killed while sbatch ran, or
    job.json unwritable once it returned): their jobs are looked up in the queue by the token of their
    comment (one squeue call) and recorded, so that --status and --cancel see them and no launch queues
    them again. `forget_missing` (a launch, under the launch lock): an intent whose job is not queued is
    dropped (nothing was queued, or it already ended). Returns one line per job found."""
    intents = [(job, i) for job in plan.jobs if (i := pending_submission(Path(job.run_dir)))]
    if not intents:
        return []
    from slurm.scheduler import queued_by_token

    queued = queued_by_token()
    if queued is None and forget_missing:
        raise ConfigError(
            [Problem(f"{job.run_dir}/job.json", "", unknown_if_queued(job)) for job, _ in intents]
        )
    found = []
    for job, intent in intents:
        job_id = (queued or {}).get(intent["token"])
        try:
            if job_id:
                adopt(job, job_id, intent)
                found.append(
                    f"{job.id}: recorded SLURM job {job_id}, queued by a launch that stopped before recording it"
                )
            elif forget_missing:
                forget_intent(Path(job.run_dir))
        except OSError as exc:
            message = f"{job.id}'s job.json cannot be written ({exc}) to record SLURM job {job_id or '?'}: fix the folder, or scancel it"
            raise ConfigError([Problem(f"{job.run_dir}/job.json", "", message)]) from None
    return found


def adopt(job: PlannedJob, job_id: str, intent: dict) -> None:
    record_job(Path(job.run_dir), job_id, "slurm", intent.get("code"), pack=bool(intent.get("pack")))


def unknown_if_queued(job: PlannedJob) -> str:
    return (
        f"{job.id} was being submitted when its launch stopped, and squeue does not answer to say whether "
        "it was queued; relaunch when it does"
    )


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
    run_dir, parents = Path(job.run_dir), any(d.kind == "afterok" for d in job.depends_on)
    keys = config_changes(job)  # None: config.yaml missing or unreadable (named in a warning)
    changed = keys is None or bool(keys)
    foreign = foreign_done(run_dir, job.resources.tasks, parents, changed) if done_hash(run_dir) else None
    if foreign:  # a damaged or foreign DONE is no changed config: say so, and how to get past it
        why = f"{job.id}: {foreign}, so it is not known to have finished with this config"
        return Problem(f"{run_dir}/DONE", "", f"{why}: remove that file to run the stage, or {hint}")
    if keys is None:
        unknown = f"{job.id} {what}, but its config.yaml is missing or unreadable: what changed is unknown"
        return Problem(f"{run_dir}/config.yaml", "", f"{unknown}; {hint}")
    keys = named_changes(job, keys)
    return Problem(
        f"{job.run_dir}/config.yaml",
        "",
        f"{job.id} {what} with another config (changed: {', '.join(keys)}); {hint}",
    )


def archive_stale(job: PlannedJob) -> Path | None:
    """A run folder from another config (a finished one with --force, or stale checkpoints that would
    crash or mislead on resume) is moved aside, never deleted. Another config is another spec, or a DONE
    of another identity with the same spec: an eval or a later stage whose own keys are unchanged but whose
    parent was rerun (its results and predictions were overwritten in place; now archived beside it)."""
    run_dir = Path(job.run_dir)
    if not run_dir.exists():
        return None
    changed, done = (
        bool(config_changes(job)),
        done_hash(run_dir),
    )  # an unreadable config.yaml: no change known
    if not changed and done in (None, UNREADABLE, job.config_hash):
        return None
    if job.kind == "export":  # rebuilt from its adapter in place, atomically (eval/export.py): a new
        return None  # format or table is no loss, and a multi-GB copy per change would be

    stamp = time.strftime("%Y%m%d-%H%M%S")
    target, n = run_dir.with_name(archive_folder(run_dir.name, stamp)), 1
    while target.exists() or target.is_symlink():  # --force twice in a second, or a name already taken
        n += 1
        target = run_dir.with_name(archive_folder(run_dir.name, f"{stamp}-{n}"))
    run_dir.rename(target)
    return target


def parents_of(job: PlannedJob, ids: dict[str, str]) -> list[tuple[str, str]]:
    """(scheduler id, kind) of the parents still to end; a parent that is done needs no dependency."""
    return [(ids[d.job_id], d.kind) for d in job.depends_on if d.job_id in ids]


def submit_to_slurm(decisions: list[Decision], backend) -> dict[str, str]:
    """Queue every job that needs it, parents first; returns plan id → SLURM id for queued jobs.

    The scheduler refusing one cancels what this launch had queued. A run folder that cannot be written,
    or Ctrl-C, stops the launch with what it queued kept and recorded, and says what that is."""
    ids = {d.job.id: d.scheduler_id for d in decisions if d.action == "queued"}
    todo = [d.job for d in decisions if d.action == "submit"]
    submitted: list[str] = []
    for job in todo:
        try:
            ids[job.id] = submit_one(job, parents_of(job, ids), backend)
        except SchedulerRefused as exc:
            backend.cancel([ids[j] for j in submitted])
            raise LaunchError(
                f"submitting {job.id} failed, so the {len(submitted)} job(s) queued by this launch were "
                f"cancelled: {exc}"
            ) from None
        except OSError as exc:
            raise LaunchError(partly_submitted(submitted, todo, ids, f"{job.id}: {exc}")) from None
        except KeyboardInterrupt:
            what = f"interrupted while submitting {job.id} (if sbatch queued it, a relaunch finds and records it)"
            raise Interrupted(partly_submitted(submitted, todo, ids, what)) from None
        submitted.append(job.id)
    return ids


class SchedulerRefused(Exception):
    """sbatch (through submitit) refused a job: nothing was queued for it."""


def submit_one(job: PlannedJob, parents: list[tuple[str, str]], backend) -> str:
    """Write the spec and the intent, sbatch, record. OSError before sbatch leaves nothing queued for the
    job; a job.json that cannot be written after it cancels the job (else the next launch records it)."""
    run_dir, code = Path(job.run_dir), backend.code.provenance()
    archive_stale(job)
    write_spec(run_dir, job.spec.model_dump(), code)
    token = record_intent(run_dir, code)
    try:
        job_id = backend.submit(job, parents, token)
    except OSError:
        raise
    except Exception as exc:
        with contextlib.suppress(OSError):
            forget_intent(run_dir)
        raise SchedulerRefused(str(exc).strip()) from None
    try:
        record_job(run_dir, job_id, "slurm", code)
    except OSError as exc:
        backend.cancel([job_id])
        raise OSError(
            f"queued as SLURM job {job_id}, then cancelled: its job.json cannot be written ({exc})"
        ) from None
    return job_id


def partly_submitted(submitted: list[str], todo: list[PlannedJob], ids: dict[str, str], what: str) -> str:
    """ "2 of 5 job(s) submitted (a/train as 101, b/train as 102); WHAT; relaunch to finish"."""
    listed = f" ({', '.join(f'{j} as {ids[j]}' for j in submitted)})" if submitted else ""
    return (
        f"{len(submitted)} of {len(todo)} job(s) submitted{listed}; {what}; relaunch to finish (what is "
        "queued stays queued and is not queued again)"
    )


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
    token = announce_pack(todo, backend.code.provenance())
    units = [
        unit_of(
            job,
            backend.profile.log_dir,
            [(plan_jobs[d.job_id], d.kind) for d in job.depends_on if d.job_id not in inside],
        )
        for job in todo
    ]
    try:
        pack_id = backend.submit_pack(units, resources, held_by, token)
    except KeyboardInterrupt:
        raise Interrupted(
            f"interrupted while submitting the pack of {len(todo)} job(s) (if sbatch queued it, a relaunch "
            "finds and records it)"
        ) from None
    except Exception as exc:
        for job in todo:
            with contextlib.suppress(OSError):
                forget_intent(Path(job.run_dir))
        raise LaunchError(f"submitting the pack of {len(todo)} job(s) failed: {str(exc).strip()}") from None
    record_pack(todo, pack_id, backend)
    for job in todo:
        ids[job.id] = pack_id
    return ids


def announce_pack(todo: list[PlannedJob], code: dict) -> str:
    """Every unit's spec and intent, with one token (the pack's comment carries it), before the sbatch."""
    token = None
    try:
        for job in todo:
            archive_stale(job)
            write_spec(Path(job.run_dir), job.spec.model_dump(), code)
            token = record_intent(Path(job.run_dir), code, pack=True, token=token)
    except OSError as exc:
        raise LaunchError(f"nothing was queued: {job.id}: {exc}; relaunch once it can be written") from None
    return token


def record_pack(todo: list[PlannedJob], pack_id: str, backend) -> None:
    code = backend.code.provenance()
    try:
        for job in todo:
            record_job(Path(job.run_dir), pack_id, "slurm", code, pack=True)
    except OSError as exc:
        backend.cancel([pack_id])
        raise LaunchError(
            f"the pack was queued as SLURM job {pack_id}, then cancelled: {job.id}'s job.json cannot be "
            f"written ({exc}); relaunch once it can be"
        ) from None


def run_locally(decisions: list[Decision], backend, report) -> dict[str, State]:
    """Run the jobs that need it on this machine, in dependency order; blocks until all ended. A job still
    running from an earlier launch (its launcher killed) is waited for, never started again. Ctrl-C stops
    the running jobs (Interrupted); so does a run folder that cannot be written (LaunchError)."""
    todo = [d.job for d in decisions if d.action == "submit"]
    adopted = [d for d in decisions if d.action == "running"]
    pending_ids = {job.id: job.id for job in [*todo, *(d.job for d in adopted)]}
    pids = {d.job.id: d.scheduler_id for d in adopted}  # the running jobs' controllers, once started
    code = backend.code.provenance()
    ended: dict[str, State] = {}

    def on_start(job: PlannedJob, pid: str, gpus: tuple[str, ...]) -> None:
        pids[job.id] = pid
        write_spec(Path(job.run_dir), job.spec.model_dump(), code)
        record_job(Path(job.run_dir), pid, "local", code, gpus=gpus)
        report(job, "RUNNING", f"pid {pid}")

    def on_end(job: PlannedJob, state: State, reason: str) -> None:
        ended[job.id] = state
        if state is State.CANCELLED and job.id in pids:  # stopped here: --status says CANCELLED, not FAILED
            mark_cancelled(Path(job.run_dir), pids[job.id])
        report(job, state.value, reason)

    try:
        for job in todo:
            archive_stale(job)
        handles = adopted_handles(adopted, backend.profile.log_dir, report)
        return backend.run(todo, lambda job: parents_of(job, pending_ids), on_start, on_end, handles)
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted: {stopped_here(ended, pids, todo)}") from None
    except OSError as exc:
        raise LaunchError(f"{exc}: {stopped_here(ended, pids, todo)}") from None


def adopted_handles(adopted: list[Decision], log_root: str, report) -> list[tuple]:
    """(job, handle, its GPUs) of the local jobs an earlier launch started and that still run."""
    from slurm.scheduler import scheduler_job

    handles = []
    for d in adopted:
        record = current_job(Path(d.job.run_dir)) or {}
        handles.append((d.job, scheduler_job(log_root, d.job.id, record), tuple(record.get("gpus") or ())))
        report(d.job, "RUNNING", f"pid {d.scheduler_id}, started by an earlier launch: waiting for it")
    return handles


def stopped_here(ended: dict[str, State], pids: dict[str, str], todo: list[PlannedJob]) -> str:
    stopped = [job_id for job_id, state in ended.items() if state is State.CANCELLED and job_id in pids]
    waiting = [job.id for job in todo if job.id not in pids]
    listed = f" ({', '.join(stopped)})" if stopped else ""
    return (
        f"stopped {len(stopped)} running job(s){listed}, {len(waiting)} not started; relaunch to run them "
        "(what completed is not run again)"
    )
