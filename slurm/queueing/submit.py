"""From a launch's decisions (slurm/queueing/decisions.py) to queued jobs, then, with --wait or locally, to their
end: the one module that asks the backends (slurm/queueing/backends.py) to run anything.

Each submission is announced in its job.json before sbatch (an intent with a token the job's comment
carries): a launch killed while sbatch runs, or a job.json that cannot be written once it returned, leaves
a job the next launch finds in the queue and records, never one queued twice. An sbatch the scheduler
refuses midway cancels what this launch had queued. A run folder that cannot be written, or Ctrl-C, stops
a launch with what is queued kept and recorded, and says so: a relaunch finishes it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from rich.live import Live

from core.config import Resources
from core.job_records import current_job, forget_intent, mark_cancelled, record_intent, record_job
from core.problems import ConfigError, Interrupted, LaunchError
from core.rundir import RunRoot, record_origin, write_spec
from core.states import NEVER_STARTS_MARK, State
from slurm.planning.arrays import JobArray, jobs_of, slurm_submissions
from slurm.planning.pack import pack_plan, pack_resources, unit_of
from slurm.planning.plan import Plan, PlannedJob
from slurm.planning.shared_evals import SharedEval
from slurm.queueing.decisions import (
    Decision,
    adopt_unrecorded,
    archive_stale,
    decide,
    hold_all_but,
    refuse_crossing_backends,
    with_dependents,
)
from slurm.watching.render import err, out, packing_text, problem_lines, status_table, warning
from slurm.watching.status import plan_status

SKIPPED = {
    "done": "COMPLETED (done)",
    "queued": "already queued",
    "running": "still running (an earlier launch)",
    "held": "not retried",
}


POLL_S = float(os.environ.get("LAUNCH_POLL_S", "5"))


@dataclass(frozen=True)
class Submitted:
    """What a launch did, for its command to show: each job's state for the plan table (`shown`: the
    skipped ones' words, `submitted ID`, `packed in ID`; empty after a local run, which showed its own
    progress) and the lines under it; `code`: a local run's outcome (1: a job did not finish)."""

    shown: dict[str, str]
    said: tuple[str, ...] = ()
    code: int = 0


def submit(
    plan: Plan,
    profile,
    *,
    backend: str,
    config_dir: Path,
    force: bool = False,
    retry_failed: bool = False,
    pack: tuple[int, str, str] | None = None,
    files: dict[str, str] | None = None,
) -> Submitted:
    """Decide and submit under the run root's launch lock (a second launch waits, then finds the jobs
    queued); a local run keeps it until its jobs end. What was queued is the command's to show, and --wait
    follows SLURM jobs (`wait`) after the lock is let go. `backend`: slurm or local; `force`: rerun what
    finished with another config;
    `retry_failed`: only the failed jobs and what follows them; `pack`: (GPUs, budget, basis) of one
    allocation; `files`: each experiment's YAML, recorded with `config_dir` as its origin (watching finds it
    there)."""
    from slurm.queueing.lock import launch_lock
    from slurm.queueing.snapshot import take_snapshot

    def waiting(holder: str) -> None:
        err.print(waiting_text(profile.run_dir, holder), highlight=False, soft_wrap=True)

    with launch_lock(Path(profile.run_dir), waiting):
        decisions = launch_decisions(plan, profile, backend, force, retry_failed)
        todo = [d for d in decisions if d.action == "submit"]
        skipped = {d.job.id: SKIPPED[d.action] for d in decisions if d.action != "submit"}
        record_origins(plan, config_dir, files or {})
        # A local job an earlier launch left running is waited for here, as if this launch had started it.
        adopting = backend == "local" and any(d.action == "running" for d in decisions)
        if not todo and not adopting:
            return Submitted(
                skipped, ("Nothing to submit: every job is done, already queued or still running.",)
            )
        if backend == "local":
            return Submitted({}, (), run_here(plan, profile, decisions, take_snapshot(Path(profile.log_dir))))
        if pack:
            return queue_pack(
                plan, profile, decisions, skipped, pack, take_snapshot(Path(profile.log_dir)), files
            )
        return queue(plan, profile, decisions, skipped, take_snapshot(Path(profile.log_dir)), files)


def waiting_text(run_dir: str, holder: str) -> str:
    """What a launch says while another holds the run root's lock: who, and how not to wait (before: the
    newcomer's first launch waited for `make demo`'s lock on runs/ with no word on using another root)."""
    return (
        f"waiting for the launch lock of {run_dir}/: held by {holder} (a local run holds it until its jobs "
        f"end). Not to wait, give your experiments a run root of their own: a cluster.yaml beside their "
        "YAMLs (the --config-dir folder; a copy of configs/cluster.yaml) with `run_dir: my-runs` and "
        "`log_dir: my-logs`"
    )


def launch_decisions(plan: Plan, profile, backend: str, force: bool, retry_failed: bool) -> list[Decision]:
    """What this launch does with each job (under the lock): adopt what a killed launch queued, decide,
    narrow to the failed jobs and what follows them with --retry-failed, refuse backend crossings."""
    for line in adopt_unrecorded(plan, forget_missing=True):
        err.print(line, highlight=False, soft_wrap=True)
    decisions = decide(plan, force=force)
    if retry_failed:
        failed = {
            r.job.id for r in plan_status(plan, profile.log_dir) if r.state.failed or r.state is State.UNKNOWN
        }
        decisions = hold_all_but(decisions, with_dependents(plan, failed))
    refuse_crossing_backends(decisions, backend)
    return decisions


def record_origins(plan: Plan, config_dir: Path, files: dict[str, str]) -> None:
    """Each experiment's YAML and folder (origin.json): a convenience for watching, never a reason to stop
    a launch."""
    for name, file in files.items():
        try:
            record_origin(RunRoot.of(plan.run_root).experiment(name), Path(file), config_dir)
        except OSError as exc:
            err.print(
                warning(
                    f"cannot record where {name} came from ({exc.strerror}): --status finds it only with "
                    "--config-dir"
                ),
                highlight=False,
                soft_wrap=True,
            )


def queue(plan: Plan, profile, decisions, skipped: dict[str, str], code, files) -> Submitted:
    from slurm.queueing.backends import SlurmBackend

    todo = [d.job for d in decisions if d.action == "submit"]
    limits = refuse_never_starting(todo, files, profile)
    waits_on = {d.job.id for d in decisions if d.action in ("submit", "queued")}
    batches = slurm_submissions(todo, waits_on, plan.sweep_parallel, limits, profile.max_time_s)
    ids = submit_to_slurm(decisions, batches, SlurmBackend(profile, Path.cwd(), code))
    states = {d.job.id: f"submitted {ids[d.job.id]}" for d in decisions if d.action == "submit"}
    arrays = sum(isinstance(b, JobArray) for b in batches)
    evals = sum(isinstance(b, SharedEval) for b in batches)
    how = f" in {len(batches)} submission(s): {arrays} job array(s), {evals} shared eval(s)"
    how = how if arrays or evals else ""
    watch = f"Submitted {len(states)} job(s){how}. Watch: squeue --me, python launch.py --status, --tail EXP"
    return Submitted({**skipped, **states}, (watch,))


def queue_pack(plan: Plan, profile, decisions, skipped: dict[str, str], pack, code, files) -> Submitted:
    from slurm.queueing.backends import SlurmBackend

    todo = [d.job for d in decisions if d.action == "submit"]
    gpus, budget, basis = pack
    packing = pack_plan(todo, gpus, budget, profile, basis)  # what is not queued elsewhere already
    resources = pack_resources(todo, packing, profile)
    refuse_never_starting(todo, files, profile, pack=resources)
    ids = submit_pack(decisions, SlurmBackend(profile, Path.cwd(), code), resources)
    states = {job.id: f"packed in {ids[job.id]}" for job in todo}
    watch = (
        f"Submitted {len(todo)} job(s) as one allocation ({ids[todo[0].id]}: {resources.gpus} GPU(s), "
        f"{resources.time}). Watch: python launch.py --status, --tail EXP"
    )
    return Submitted({**skipped, **states}, (packing_text(packing), watch))


def refuse_never_starting(jobs, files, profile, pack=None):
    """The cluster's limits (slurm/cluster/limits.py), read now: a job SLURM would leave pending forever, or a
    launch it would refuse halfway, is refused whole before the first sbatch. Returns the limits (None:
    they could not be read)."""
    from slurm.cluster.limits import cluster_problems

    def say(line: str) -> None:
        err.print(warning(line), highlight=False, soft_wrap=True)

    problems, limits = cluster_problems(jobs, files or {}, profile, say, pack=pack)
    if problems:
        raise ConfigError(problems)
    return limits


def run_here(plan: Plan, profile, decisions, code) -> int:
    from slurm.queueing.backends import LocalBackend

    def report(job, state: str, detail: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {job.id}: {state}" + (f" ({detail})" if detail else "")
        out.print(line, highlight=False, soft_wrap=True)

    todo = [d for d in decisions if d.action == "submit"]
    earlier = sum(d.action == "running" for d in decisions)
    backend = LocalBackend(profile, Path.cwd(), code)
    out.print(
        f"Running {len(todo)} job(s) locally"
        + (f" (and waiting for {earlier} an earlier launch started)" if earlier else "")
        + f", {profile.local_parallel_jobs} at a time, on "
        f"{backend.gpus.describe()}; logs in {profile.log_dir}/",
        highlight=False,
        soft_wrap=True,
    )
    with live_status(plan, profile):
        states = run_locally(decisions, backend, report)
    out.print(status_table(plan_status(plan, profile.log_dir), out.width))
    return 1 if any(not s.finished for s in states.values()) else 0


@contextmanager
def live_status(plan: Plan, profile):
    """In a terminal, the status table (state, step/total, loss, ETA) under the launcher's own lines,
    refreshed every POLL_S while a local run goes on, as --wait shows it on SLURM (before: minutes of
    nothing while a job trained). Into a file or a pipe, only the lines."""
    if not out.is_terminal:
        yield
        return
    stop = threading.Event()
    with Live(
        status_table(plan_status(plan, profile.log_dir), out.width), console=out, transient=True
    ) as live:

        def refresh() -> None:
            while not stop.wait(POLL_S):
                live.update(status_table(plan_status(plan, profile.log_dir), out.width))

        updater = threading.Thread(target=refresh, name="live-status", daemon=True)
        updater.start()
        try:
            yield
        finally:
            stop.set()
            updater.join()


def wait(plan: Plan, profile) -> int:
    """Refresh the status table until no job is queued or running; non-zero if any job did not complete.
    Into a file or a pipe, the table once at the end (a live display there ran into the next line)."""
    with Live(console=out, refresh_per_second=1) if out.is_terminal else nullcontext() as live:
        while True:
            rows = plan_status(plan, profile.log_dir)
            cancel_stuck(rows, profile.log_dir)
            if live is not None:
                live.update(status_table(rows, out.width))
            if not any(r.state.live and r.job.id not in never_starting(rows) for r in rows):
                break  # what is left can never start: waiting longer would be forever
            time.sleep(POLL_S)
    if live is None:
        out.print(status_table(rows, out.width))
    for line in problem_lines(rows):
        err.print(line, highlight=False, soft_wrap=True)
    return 1 if any(not r.state.finished for r in rows) else 0


def never_starting(rows) -> set[str]:
    """Jobs pending on a limit they are over, and every job that waits for one of them (rows come in plan
    order: parents first)."""
    never: set[str] = set()
    for row in rows:
        if row.reason.startswith(NEVER_STARTS_MARK) or any(d.job_id in never for d in row.job.depends_on):
            never.add(row.job.id)
    return never


def cancel_stuck(rows, log_root: str) -> None:
    """Jobs SLURM keeps pending as DependencyNeverSatisfied (a parent failed; clusters without
    kill_invalid_depend) would wait forever: cancel them, so they show as BLOCKED and can be retried."""
    from slurm.cluster.scheduler import cancel_rows

    stuck = [r for r in rows if r.stuck and r.scheduler_id]
    if stuck:
        cancel_rows(stuck, log_root)
        err.print(
            f"cancelled {len(stuck)} job(s) that could never start: " + ", ".join(r.job.id for r in stuck)
        )


def parents_of(job: PlannedJob, ids: dict[str, str]) -> list[tuple[str, str]]:
    """(scheduler id, kind) of the parents still to end; a parent that is done needs no dependency."""
    return [(ids[d.job_id], d.kind) for d in job.depends_on if d.job_id in ids]


def submit_to_slurm(decisions: list[Decision], batches: list, backend) -> dict[str, str]:
    """Queue every job that needs it, parents first, each of `batches` with one sbatch (a job, a job
    array, or a shared eval); returns plan id → SLURM id for queued jobs (`123_4` for an array's task).

    The scheduler refusing one cancels what this launch had queued. A run folder that cannot be written,
    or Ctrl-C, stops the launch with what it queued kept and recorded, and says what that is."""
    ids = {d.job.id: d.scheduler_id for d in decisions if d.action == "queued"}
    todo = [d.job for d in decisions if d.action == "submit"]
    submitted: list[str] = []
    to_queue = {job.id for job in todo}
    for batch in batches:
        jobs = jobs_of(batch)
        first, members = jobs[0], {job.id for job in jobs}
        unqueued = [
            d.job_id
            for job in jobs
            for d in job.depends_on
            if d.job_id in to_queue and d.job_id not in ids and d.job_id not in members
        ]
        if unqueued:  # it would start without waiting for them: never queue it so
            backend.cancel(list(dict.fromkeys(ids[j] for j in submitted)))
            raise LaunchError(
                f"{first.id} would be queued before {', '.join(unqueued)}, which it waits for; the "
                f"{len(submitted)} job(s) queued by this launch were cancelled (a bug: please report it)"
            )
        try:
            if isinstance(batch, JobArray):
                ids.update(submit_array(batch, ids, backend))
            elif isinstance(batch, SharedEval):
                ids.update(submit_shared_eval(batch, ids, backend))
            else:
                ids[batch.id] = submit_one(batch, parents_of(batch, ids), backend)
        except SchedulerRefused as exc:
            backend.cancel(list(dict.fromkeys(ids[j] for j in submitted)))
            raise LaunchError(
                f"submitting {first.id} failed, so the {len(submitted)} job(s) queued by this launch were "
                f"cancelled: {exc}"
            ) from None
        except OSError as exc:
            raise LaunchError(partly_submitted(submitted, todo, ids, f"{first.id}: {exc}")) from None
        except KeyboardInterrupt:
            what = f"interrupted while submitting {first.id} (if sbatch queued it, a relaunch finds and records it)"
            raise Interrupted(partly_submitted(submitted, todo, ids, what)) from None
        submitted += [job.id for job in jobs]
    return ids


class SchedulerRefused(Exception):
    """sbatch (through submitit) refused a job: nothing was queued for it."""


def submit_one(job: PlannedJob, parents: list[tuple[str, str]], backend) -> str:
    """Write the spec and the intent, sbatch, record (submit_together for one job). OSError before sbatch
    leaves nothing queued for the job; a job.json that cannot be written after it cancels the job (else
    the next launch records it)."""
    return submit_together([job], lambda token: [backend.submit(job, parents, token)], backend)[0]


def partly_submitted(submitted: list[str], todo: list[PlannedJob], ids: dict[str, str], what: str) -> str:
    """ "2 of 5 job(s) submitted (a/train as 101, b/train as 102); WHAT; relaunch to finish"."""
    listed = f" ({', '.join(f'{j} as {ids[j]}' for j in submitted)})" if submitted else ""
    return (
        f"{len(submitted)} of {len(todo)} job(s) submitted{listed}; {what}; relaunch to finish (what is "
        "queued stays queued and is not queued again)"
    )


def submit_array(array: JobArray, ids: dict[str, str], backend) -> dict[str, str]:
    """Write each task's spec and intent (one token, its task index), sbatch the array, record each task
    as `ARRAY_TASK`. Returns plan id → task id."""
    parents = [(ids[job_id], kind) for job_id, kind in array.parents if job_id in ids]
    if array.follows is not None:  # task i after task i of the previous stage's array
        parents.append((ids[array.follows.jobs[0].id].split("_")[0], "aftercorr"))
    tasks = submit_together(
        array.jobs, lambda token: backend.submit_array(array, parents, token), backend, array=True
    )
    return dict(zip((job.id for job in array.jobs), tasks, strict=True))


def submit_shared_eval(evals: SharedEval, ids: dict[str, str], backend) -> dict[str, str]:
    """Write each member's spec and intent, sbatch the one job that scores them after their trainings
    ended however they ended (`afterany`; an array's tasks as the array), record it in each member's
    job.json. Returns plan id → its job id."""
    parents = sorted({(ids[job_id].split("_")[0], "afterany") for job_id in evals.parents if job_id in ids})
    (job_id,) = set(
        submit_together(
            evals.jobs,
            lambda token: [backend.submit_shared_eval(evals, parents, token)] * len(evals.jobs),
            backend,
            shared=True,
        )
    )
    return {job.id: job_id for job in evals.jobs}


def submit_together(jobs, sbatch, backend, array: bool = False, shared: bool = False) -> list[str]:
    """submit_one for several jobs queued by one sbatch (`sbatch(token)` → each job's id, in order): every
    spec and intent written first (one token; an array's task index), each job recorded after. A failure
    is submit_one's, for them all: nothing queued, or what was queued cancelled."""
    code = backend.code.provenance()
    token = None
    for task, job in enumerate(jobs):
        archive_stale(job)
        write_spec(Path(job.run_dir), job.spec.model_dump(), code)
        token = record_intent(
            Path(job.run_dir), code, token=token, array_task=task if array else None, shared=shared
        )
    try:
        job_ids = sbatch(token)
    except OSError:
        raise
    except Exception as exc:
        for job in jobs:
            with contextlib.suppress(OSError):
                forget_intent(Path(job.run_dir))
        raise SchedulerRefused(str(exc).strip()) from None
    queued = job_ids[0].split("_")[0]
    try:
        for job, job_id in zip(jobs, job_ids, strict=True):
            record_job(Path(job.run_dir), job_id, "slurm", code, shared=shared)
    except OSError as exc:
        backend.cancel([queued])
        raise OSError(
            f"queued as SLURM job {queued}, then cancelled: {job.id}'s job.json cannot be written ({exc})"
        ) from None
    return job_ids


def submit_pack(decisions: list[Decision], backend, resources: Resources) -> dict[str, str]:
    """Queue every job that needs it as a unit of one packed allocation (one sbatch: it is queued whole or
    not at all); returns plan id → SLURM id, the allocation's for every unit."""
    ids = {d.job.id: d.scheduler_id for d in decisions if d.action == "queued"}
    todo = [d.job for d in decisions if d.action == "submit"]
    # Inside the allocation units wait for units. Parents queued as jobs of their own hold the whole
    # allocation until they end (afterany: one failing must not cancel the pack's unrelated units); a unit
    # that needs such a parent's adapter checks its DONE when its turn comes (slurm/queueing/lanes.py).
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
        report(job, State.RUNNING.value, f"pid {pid}")

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
    from slurm.cluster.scheduler import scheduler_job

    handles = []
    for d in adopted:
        record = current_job(Path(d.job.run_dir))  # a running decision's: there is one
        handles.append(
            (d.job, scheduler_job(log_root, d.job.id, record, Path(d.job.run_dir)), record.gpus or ())
        )
        report(
            d.job, State.RUNNING.value, f"pid {d.scheduler_id}, started by an earlier launch: waiting for it"
        )
    return handles


def stopped_here(ended: dict[str, State], pids: dict[str, str], todo: list[PlannedJob]) -> str:
    stopped = [job_id for job_id, state in ended.items() if state is State.CANCELLED and job_id in pids]
    waiting = [job.id for job in todo if job.id not in pids]
    listed = f" ({', '.join(stopped)})" if stopped else ""
    return (
        f"stopped {len(stopped)} running job(s){listed}, {len(waiting)} not started; relaunch to run them "
        "(what completed is not run again)"
    )
