"""The written report (runs/report.md, report.csv, the curves) of what the run root holds: the plan's jobs as
the report reads them (core/runs.py records), each task's baselines, the base models' evals, what each job
held. Written by --report and by a launch whose jobs completed here; eval/report.py renders it."""

from __future__ import annotations

from pathlib import Path

from core.problems import ConfigError, Problem
from core.rundir import RunDir
from core.runs import BaseEval, JobRun, PlanUsage, ReportInput
from core.states import State
from core.yamlfile import find_inherited
from slurm.planning.plan import Plan, build_plan
from slurm.planning.request import LaunchRequest, gpus_here
from slurm.watching.status import plan_status
from slurm.watching.watched import FolderLoad, Watched, watched_of


def written_report(
    profile, request: LaunchRequest, held: Watched | None = None, loaded: dict[Path, FolderLoad] | None = None
) -> list[Path]:
    """Every experiment the run root holds (`held`, when the caller loaded them already) and, with a named
    --config-dir, that folder's experiments not run yet; `loaded`: config folders the caller loaded already
    (a launch's own), not loaded again."""
    from eval.report import BaselinesError, write_report
    from slurm.watching.usage import plan_usage

    held = held or watched_of(request, profile, None, named=False, loaded=loaded)
    experiments = {e.name: e for e in held.experiments}
    folders = dict(held.folders)
    if request.config_dir_named:
        named = watched_of(request, profile, None, loaded=loaded)
        experiments.update({e.name: e for e in named.experiments if e.name not in experiments})
        folders.update({k: v for k, v in named.folders.items() if k not in folders})
    plan = build_plan(list(experiments.values()), profile, gpus_here=gpus_here(request.backend))
    states = {row.job.id: row.state for row in plan_status(plan, profile.log_dir)}
    baselines = [
        found
        for folder in dict.fromkeys(folders.values())
        if (found := find_inherited("baselines.yaml", folder, Path("/"))) is not None
    ]
    tasks = {name: e.experiment.task for name, e in experiments.items()}
    usage = plan_usage(plan, profile.log_dir)  # what each job held: sacct, or a local job's own clock
    try:
        return write_report(
            ReportInput(
                job_runs(plan, states, usage),
                Path(profile.run_dir),
                baselines,
                tasks,
                profile.gpu_hour_cost,
                usage,
                sweeps={name: e.sweep for name, e in experiments.items() if e.sweep is not None},
                base_evals=base_evals(plan),
                descriptions={name: e.experiment.description for name, e in experiments.items()},
            )
        )
    except BaselinesError as exc:
        raise ConfigError([Problem(str(exc.path), "task", str(exc))]) from None


def job_runs(
    plan: Plan, states: dict[str, State] | None = None, usage: PlanUsage | None = None
) -> list[JobRun]:
    """The plan's jobs as the report reads them: each training stage's summary.json read here, once."""
    states, used = states or {}, usage.jobs if usage is not None else {}
    return [
        JobRun(
            id=job.id,
            experiment=job.experiment,
            stage=job.stage,
            kind=job.kind,
            run_dir=Path(job.run_dir),
            gpus=job.resources.gpus,
            state=State(states[job.id]) if job.id in states else None,
            model=job.spec.model.name_or_path if job.kind == "train" else "",
            method=job.spec.adapter.method if job.kind == "train" else "",
            summary=RunDir.of(job.run_dir).read_summary() if job.kind == "train" else {},
            used=used.get(job.id),
        )
        for job in plan.jobs
    ]


def base_evals(plan: Plan) -> dict:
    """Experiment → the eval of its base model (eval.baseline), or why it has none, for the report."""
    found = {
        name: BaseEval(job_id, plan.job(job_id).run_dir, plan.job(job_id).spec.model.name_or_path)
        for name, job_id in plan.base_of.items()
    }
    return found | {name: BaseEval("", "", "", left_out=why) for name, why in plan.base_left_out.items()}
