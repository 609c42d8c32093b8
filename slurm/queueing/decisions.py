"""What a launch does with each job of a plan, decided before anything is queued: skip what is done,
never start twice what is queued or still running (on SLURM or on this machine), refuse what finished
with another config (unless --force, which archives it), adopt what a killed launch queued unrecorded.

Every decision is made before the first sbatch (slurm/queueing/submit.py then carries them out), so a refusal
leaves nothing half-submitted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from core import writer_lock
from core.files import warn_unreadable
from core.job_records import JobRecord, Submission, current_job, forget_intent, pending_submission, record_job
from core.layout import archive_folder
from core.problems import ConfigError, Problem
from core.pruning import archive_run_records
from core.rundir import UNREADABLE, RunDir, RunRoot, done_hash, foreign_done, results_lost
from slurm.planning.plan import Plan, PlannedJob
from slurm.watching.status import config_changes, named_changes, query_slurm

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
    slurm_ids = [r.job_id for r in records.values() if r and r.on_slurm]
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
                decisions.append(Decision(job, live_as, record.job_id))
            else:
                refusals.append(refusal(job, f"{LIVE_AS[live_as]} {record.job_id}", "--cancel it first"))
                decisions.append(Decision(job, "refused", record.job_id))
        elif (other := writer_lock.holder(run_dir)) is not None:  # a trainer no record knows of (H2)
            refusals.append(held_refusal(job, other))
            decisions.append(Decision(job, "refused"))
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


def live_action(log_root: str, job: PlannedJob, record: JobRecord | None, live_slurm) -> Action | None:
    """ "queued" when the record's SLURM job is live, "running" when its local job still runs; else None.
    A stage has at most one live trainer, whatever the backend that started it."""
    if not record:
        return None
    if record.on_slurm:
        return "queued" if record.job_id in live_slurm else None
    from slurm.cluster.scheduler import (  # submitit: only once a local job was recorded
        local_alive,
        scheduler_job,
    )

    return "running" if local_alive(scheduler_job(log_root, job.id, record, Path(job.run_dir))) else None


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
            str(RunDir.of(parent.job.run_dir).job),
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
    from slurm.cluster.scheduler import queued_by_token

    queued = queued_by_token()
    if queued is None and forget_missing:
        raise ConfigError(
            [Problem(str(RunDir.of(job.run_dir).job), "", unknown_if_queued(job)) for job, _ in intents]
        )
    found = []
    for job, intent in intents:
        job_id = intent.job_id(queued[intent.token]) if intent.token in (queued or {}) else None
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
            raise ConfigError([Problem(str(RunDir.of(job.run_dir).job), "", message)]) from None
    return found


def adopt(job: PlannedJob, job_id: str, intent: Submission) -> None:
    record_job(Path(job.run_dir), job_id, "slurm", intent.code, pack=intent.pack, shared=intent.shared)


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


def held_refusal(job: PlannedJob, other: writer_lock.Holder) -> Problem:
    """A run folder whose writer lock is held by a job no record names (its job.json lost or edited): a
    second trainer there would write beside the first, and archiving it would move the running job's
    folder from under it."""
    return Problem(
        str(RunDir(Path(job.run_dir)).writer),
        "",
        f"{job.id}: its run folder is held by a job this launch has no record of ({other}), which still "
        "runs: a second one would write the same files, and the folder cannot be archived under it; wait "
        "for it to end, or stop it, then relaunch",
    )


def refusal(job: PlannedJob, what: str, hint: str) -> Problem:
    run_dir, parents = Path(job.run_dir), any(d.kind == "afterok" for d in job.depends_on)
    keys = config_changes(job)  # None: config.yaml missing or unreadable (named in a warning)
    changed = keys is None or bool(keys)
    foreign = foreign_done(run_dir, job.resources.tasks, parents, changed) if done_hash(run_dir) else None
    if foreign:  # a damaged or foreign DONE is no changed config: say so, and how to get past it
        why = f"{job.id}: {foreign}, so it is not known to have finished with this config"
        return Problem(str(RunDir(run_dir).done), "", f"{why}: remove that file to run the stage, or {hint}")
    if keys is None:
        unknown = f"{job.id} {what}, but its config.yaml is missing or unreadable: what changed is unknown"
        return Problem(str(RunDir(run_dir).config), "", f"{unknown}; {hint}")
    keys = named_changes(job, keys)
    return Problem(
        str(RunDir.of(job.run_dir).config),
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
    if (other := writer_lock.holder(run_dir)) is not None:  # weigh refused it; held since, never moved
        raise ConfigError([held_refusal(job, other)])

    when = time.strftime("%Y%m%d-%H%M%S")
    stamp, n = when, 1
    while (target := run_dir.with_name(archive_folder(run_dir.name, stamp))).exists() or target.is_symlink():
        n += 1  # --force twice in a second, or a name already taken
        stamp = f"{when}-{n}"
    run_dir.rename(target)
    archive_rung_records(job, stamp)
    return target


def archive_rung_records(job: PlannedJob, stamp: str) -> None:
    """A pruned point's rows in its sweep's rung records go with its archived folder
    (RUN_ROOT/.rungs/SWEEP/EXP.old-STAMP/): the rerun is judged, and judges, as a new run."""
    prune = getattr(job.spec, "prune", None)
    if job.kind != "train" or prune is None:
        return
    run_root = RunDir(Path(job.run_dir)).run_root
    try:
        archive_run_records(run_root, prune.sweep, job.experiment, archive_folder(job.experiment, stamp))
    except OSError as exc:
        warn_unreadable(
            RunRoot.of(run_root).rungs(prune.sweep), f"cannot be archived ({exc})", "left as it is"
        )
