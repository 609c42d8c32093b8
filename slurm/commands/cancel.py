"""--cancel [--exp NAME ... | --config-dir X | --removed]: stop the queued and running jobs of what is
watched (slurm/watching/watched.py), never what another experiment still needs (a shared base eval, a
packed allocation that runs other experiments' units), and, with --removed, the jobs of experiments no
config folder has any more."""

from __future__ import annotations

from pathlib import Path

from core.job_records import current_job, mark_cancelled
from core.problems import ConfigError, Problem
from core.rundir import RunDir, RunRoot
from core.states import State
from slurm.cluster.scheduler import cancel_rows
from slurm.planning.plan import Plan, build_plan
from slurm.planning.request import LaunchRequest, gpus_here
from slurm.queueing.decisions import adopt_unrecorded
from slurm.watching.render import err, error, out, warning
from slurm.watching.status import JobStatus, plan_status
from slurm.watching.watched import watched_of, watched_plan


def cancel(request: LaunchRequest, profile) -> int:
    if request.removed:
        return cancel_removed(request, profile)
    watching = watched_plan(request, profile)
    if watching is None:
        return 0
    plan = watching[1]
    for line in adopt_unrecorded(plan, forget_missing=False):
        err.print(line, highlight=False, soft_wrap=True)
    # --cancel --exp A or --config-dir X: what else the run root holds, loaded and planned once for both
    # checks below (a base eval or a pack another folder's experiment needs is not this cancel's to stop).
    narrowed = request.experiments or request.config_dir_named
    everything = (
        build_plan(
            watched_of(request, profile, None, named=False).experiments,
            profile,
            gpus_here=gpus_here(request.backend),
        )
        if narrowed
        else None
    )
    rows = plan_status(everything, profile.log_dir) if everything else []  # one squeue call for both
    kept = without_shared_evals(without_shared_bases(plan, everything, rows), rows)
    return cancel_live(kept, profile.log_dir, sharing_packs(plan, rows))


def cancel_live(plan: Plan, log_root: str, sharing: dict[str, list[str]] | None = None) -> int:
    live = [r for r in plan_status(plan, log_root) if r.state.live and r.scheduler_id]
    shared = sorted({r.scheduler_id for r in live} & set(sharing or {}))
    if shared:
        problems = [
            Problem(
                "command line",
                "--cancel",
                f"packed job {pack} also runs {', '.join(sharing[pack])}: cancelling it stops them too; "
                "name their experiments as well (--exp ...), or --all",
            )
            for pack in shared
        ]
        raise ConfigError(problems)
    running = cancel_rows(live, log_root)
    done = [r.job.id for r in live if r.job.id not in running]
    out.print(f"Cancelled {len(done)} job(s): " + (", ".join(done) or "none was queued"))
    if running:
        err.print(error(f"could not be stopped, still running: {', '.join(running)}"))
        return 1
    return 0


def without_shared_bases(plan: Plan, everything: Plan | None, rows: list[JobStatus]) -> Plan:
    """--cancel --exp A: A's jobs, less the base-model evals that an experiment it did not name still uses
    (its base row and its export read them); `everything`: the run root's plan (None: nothing narrowed),
    `rows` its status. A base eval goes with the last experiment that uses it: one whose own jobs were all
    cancelled (or blocked behind a cancelled one), or never submitted, uses it no more."""
    if everything is None or not plan.base_of:
        return plan
    chosen = set(plan.experiments())
    given_up = (State.CANCELLED, State.BLOCKED, State.PLANNED)
    using = {row.job.experiment for row in rows if row.state not in given_up} - chosen
    needed = {base for name, base in everything.base_of.items() if name in using}
    return plan.only({j.id for j in plan.jobs} - needed)


def sharing_packs(plan: Plan, everything: list[JobStatus]) -> dict[str, list[str]]:
    """Packed job id → the live units of other experiments in it: cancelling the pack would stop them;
    `everything`: the status of the run root's plan ([]: nothing narrowed, nothing else to stop)."""
    return live_sharers(plan, everything, lambda record: record.pack)


def live_sharers(plan: Plan, everything: list[JobStatus], sharing) -> dict[str, list[str]]:
    """Job id → the live jobs outside `plan` whose record (`sharing(record)`) it also runs."""
    chosen = {job.id for job in plan.jobs}
    others: dict[str, list[str]] = {}
    for row in everything:
        record = current_job(Path(row.job.run_dir))
        if record and sharing(record) and row.state.live and row.job.id not in chosen:
            others.setdefault(row.scheduler_id, []).append(row.job.id)
    return others


def without_shared_evals(plan: Plan, everything: list[JobStatus]) -> Plan:
    """--cancel --exp POINT: the point's jobs, less its eval when a shared eval scores it with points not
    named (cancelling it would stop theirs). That eval stays queued and reports the point not scored once
    its training is cancelled; said in a line."""
    sharers = live_sharers(plan, everything, lambda record: record.shared)
    kept = [
        row.job.id
        for row in everything
        if row.job.id in {j.id for j in plan.jobs} and row.scheduler_id in sharers
    ]
    for job_id in kept:
        out.print(
            f"{job_id} is scored by a shared eval with other points: left queued (it reports this point not "
            "scored once its training ended)",
            highlight=False,
            soft_wrap=True,
        )
    return plan.only({j.id for j in plan.jobs} - set(kept))


def cancel_removed(request: LaunchRequest, profile) -> int:
    """--cancel --removed: the queued or running jobs of experiments the run root holds that no config
    folder has any more (points removed from a sweep). Their configs are gone, so their job records are
    all there is: each unfinished stage's last job, if the scheduler still has it live."""
    from slurm.cluster.scheduler import cancel as cancel_jobs
    from slurm.cluster.scheduler import local_alive, scheduler_job
    from slurm.watching.status import query_slurm

    gone, run_root = watched_of(request, profile, None, named=False).gone, RunRoot.of(profile.run_dir)
    records = {
        f"{name}/{stage.name}": record
        for name in gone
        for stage in sorted(p for p in run_root.experiment(name).iterdir() if p.is_dir())
        if (record := current_job(stage)) and not RunDir(stage).done.exists()
    }
    # a pack or a shared eval also runs jobs of experiments still in a config: not this cancel's to stop
    packed = sorted(job for job, record in records.items() if record.pack or record.shared)
    live_slurm = query_slurm([r.job_id for r in records.values() if r.on_slurm])
    jobs = {
        job: scheduler_job(profile.log_dir, job, record, run_root.stage(job).path)
        for job, record in records.items()
        if job not in packed
    }

    def still_live(job: str) -> bool:
        record = records[job]
        if record.local:
            return local_alive(jobs[job])
        return record.job_id in live_slurm and live_slurm[record.job_id].state.live

    live = {job: handle for job, handle in jobs.items() if still_live(job)}
    for job in live:
        if records[job].local:
            mark_cancelled(run_root.stage(job).path, records[job].job_id)
    still = set(cancel_jobs(list(live.values())))
    done = [job for job, handle in live.items() if str(handle.job_id) not in still]
    out.print(
        f"Cancelled {len(done)} job(s) of experiments no config folder has any more: "
        + (", ".join(done) or "none was live")
        + (f" ({len(gone)} such experiment(s) in {profile.run_dir}/)" if gone else ""),
        highlight=False,
        soft_wrap=True,
    )
    if packed:
        err.print(
            warning(f"not cancelled, units of a packed allocation: {', '.join(packed)}"),
            highlight=False,
        )
    return 1 if still else 0
