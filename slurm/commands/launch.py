"""--all/--exp, --dry-run, --preflight, --calibrate, --retry-failed: load and validate every experiment,
plan, check what can be checked here, then submit (slurm/queueing/submit.py) or, for a dry run, print."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from core.problems import ConfigError, Problem
from core.states import State
from slurm.planning.arrays import JobArray, slurm_submissions
from slurm.planning.experiments import load_selected, parse_overrides
from slurm.planning.pack import pack_plan
from slurm.planning.plan import Plan, build_plan, calibration_plan, estimated_again
from slurm.planning.request import LaunchRequest, backend_here, gpus_here
from slurm.planning.shared_evals import SharedEval
from slurm.planning.validation import LoadedExperiment
from slurm.queueing.decisions import weigh
from slurm.queueing.submit import submit, wait
from slurm.watching.preflight_report import run_preflight
from slurm.watching.render import (
    batches_text,
    edges_text,
    err,
    folded_sweeps,
    labelled,
    out,
    packing_text,
    plan_table,
    totals_text,
    warning,
)
from slurm.watching.reporting import written_report
from slurm.watching.watched import FolderLoad, removed_from, removed_text

# A job's state in a dry run, as a relaunch would decide it (slurm/queueing/decisions.py weigh).
DRY_RUN_STATES = {
    "submit": State.PLANNED.value,
    "done": "COMPLETED (done)",
    "queued": "queued as SLURM job",
    "running": "still running, pid",
    "refused": "REFUSED (see below)",
    "held": "not retried",
}


@dataclass(frozen=True)
class Loaded:
    """The experiments a launch names, validated, and their plan; `folder`: the config folder as loaded
    (its path → what load_watchable_experiments would give), for the report of a run that ends here."""

    experiments: list[LoadedExperiment]
    plan: Plan
    folder: dict[Path, FolderLoad]

    @property
    def files(self) -> dict[str, str]:
        return {e.name: str(e.file) for e in self.experiments}


def loaded(request: LaunchRequest, profile) -> Loaded:
    """Load and validate (every problem at once, ConfigError), plan; say what the run root holds that the
    folder no longer has."""
    overrides = parse_overrides(list(request.overrides))
    selection = load_selected(request.config_dir, profile, overrides, request.experiments)
    experiments, others, names, broken, _ = selection
    for problem in others:
        err.print(
            warning(problem),
            highlight=False,
            soft_wrap=True,
        )
    plan = build_plan(experiments, profile, gpus_here=gpus_here(request.backend))
    if request.action == "calibrate":
        plan = calibration_plan(plan, request.calibrate_steps)
    if removed := removed_from(Path(profile.run_dir), request.config_dir, names, broken):
        err.print(removed_text(removed, Path(profile.run_dir)), highlight=False, soft_wrap=True)
    return Loaded(experiments, plan, {request.config_dir.resolve(): selection.as_watched()})


def launch(request: LaunchRequest, profile) -> int:
    """--all/--exp and --retry-failed: submit what is not done, queued or running; a run that ended here
    (local, or --wait) with every job completed ends with the comparison the user ran it for."""
    run, code = submitted(request, profile)
    if code == 0 and (request.wait or request.backend == "local"):
        written = written_report(profile, request, loaded=run.folder)  # the folder, not loaded again
        out.print(f"All {len(run.plan.jobs)} job(s) completed. Report: {written[0]}", highlight=False)
    return code


def calibrate(request: LaunchRequest, profile) -> int:
    """--calibrate: a few dozen steps of each experiment on the real GPUs, for the estimates."""
    _, code = submitted(request, profile)
    out.print(
        f"Calibration runs write their speed to {profile.run_dir}/speeds.jsonl as they end; then "
        "--dry-run estimates these experiments from it (source: calibrated).",
        highlight=False,
    )
    return code


def submitted(request: LaunchRequest, profile) -> tuple[Loaded, int]:
    """Load, plan, check, submit (slurm/queueing/submit.py): what a launch and a calibration share."""
    run = loaded(request, profile)
    pack = requested_pack(request, profile)
    plan = checked(run, request, profile)
    done = submit(plan, profile, **request.submission, pack=pack, files=run.files)
    if done.shown:
        out.print(plan_table(plan, done.shown, out.width))
    for line in done.said:
        out.print(line, highlight=False, soft_wrap=True)
    return run, wait(
        plan, profile
    ) if done.code == 0 and request.wait and request.backend == "slurm" else done.code


def checked(run: Loaded, request: LaunchRequest, profile) -> Plan:
    """The plan to submit, once what needs no queue is checked: this machine's GPUs for a local run
    (before preflight: it may take minutes), preflight (whose exact token counts re-estimate the plan)."""
    if request.backend == "local":
        from slurm.cluster.local_gpus import refuse_too_many_gpus

        refuse_too_many_gpus(run.plan.jobs, run.files)
    if not request.preflight:
        return run.plan
    run_preflight(run.plan, run.files, profile, show=False, as_json=False)
    return estimated_again(run.plan, profile, run.files)


def preflight(request: LaunchRequest, profile) -> int:
    """--preflight alone: the checks' table (or --json); nothing is submitted."""
    run = loaded(request, profile)
    requested_pack(request, profile)  # a --budget without --pack is refused here too
    return run_preflight(run.plan, run.files, profile, show=True, as_json=request.as_json)


def requested_pack(request: LaunchRequest, profile) -> tuple[int, str, str] | None:
    """(GPUs, budget, basis) of a packed allocation: --pack/--budget, else cluster.yaml's pack/budget,
    and --budget-basis (what a pruned sweep's units count: worst, or expected). A local
    launch runs unpacked (cluster.yaml's pack is for SLURM; a --pack here was refused at the door)."""
    if request.budget and not (request.pack or profile.pack):
        message = "is the time of a packed allocation: add --pack G (its GPUs)"
        raise ConfigError([Problem("command line", "--budget", message)])
    gpus = request.pack if request.pack is not None else profile.pack
    if request.budget_basis != "worst" and not gpus:
        message = "says how a packed allocation's budget counts a pruned sweep: add --pack G --budget T"
        raise ConfigError([Problem("command line", "--budget-basis", message)])
    if not gpus or (request.submits and request.backend == "local"):  # --pack 0: no pack
        return None
    return gpus, request.budget or profile.budget or profile.max_time, request.budget_basis


def placement_refusals(decisions, refusals, files: dict[str, str], profile, backend: str):
    """What a launch on `backend` (auto: this machine's) refuses of the jobs it would submit, as the launch
    judges it: more GPUs or nodes than this machine has (local), or limits the cluster would never meet
    (SLURM: read as the launch reads them). Those jobs are `refused` (L2: before, PLANNED). Returns
    (decisions, refusals) with them, and the cluster's limits where SLURM's were read (else None)."""
    todo = [d.job for d in decisions if d.action == "submit"]
    limits = None
    if not todo:
        return decisions, refusals, limits
    if backend_here(backend) == "local":
        from slurm.cluster.local_gpus import VisibleGpus, too_many_gpus

        visible = VisibleGpus.detect()
        found = {job.id: too_many_gpus([job], visible, files) for job in todo}
    else:
        from slurm.cluster.limits import cluster_problems

        problems, limits = cluster_problems(todo, files, profile, lambda line: None)
        by_file = {}
        for problem in problems:
            by_file.setdefault(problem.file, []).append(problem)
        found = {job.id: by_file.pop(files.get(job.experiment, job.experiment), []) for job in todo}
        refusals = [*refusals, *(p for rest in by_file.values() for p in rest)]  # the allocation's own
    refused = {job_id for job_id, problems in found.items() if problems}
    decided = [replace(d, action="refused") if d.job.id in refused else d for d in decisions]
    return decided, [*refusals, *dict.fromkeys(p for problems in found.values() for p in problems)], limits


def slurm_batches(decisions, plan: Plan, limits, profile, backend: str) -> list:
    """How a launch on SLURM would queue what is left (slurm/planning/arrays.py slurm_submissions): nothing
    when it would run here."""
    if limits is None and backend_here(backend) != "slurm":
        return []
    todo = [d.job for d in decisions if d.action == "submit"]
    waits_on = {d.job.id for d in decisions if d.action in ("submit", "queued")}
    return slurm_submissions(todo, waits_on, plan.sweep_parallel, limits, profile.max_time_s)


def dry_run(request: LaunchRequest, profile) -> int:
    """The plan, each job in the state a relaunch would give it (done, queued, still running, refused,
    or planned: to be submitted), with the makespan and GPU-hours of what is left and, for a pack, the
    lanes of what is left. Reads the run folders and asks squeue once (only if some job was queued)."""
    run, pack = loaded(request, profile), requested_pack(request, profile)
    plan = run.plan
    decisions, refusals = weigh(plan, force=request.force)
    decisions, refusals, limits = placement_refusals(decisions, refusals, run.files, profile, request.backend)
    states = {d.job.id: d.action if d.action != "submit" else "planned" for d in decisions}
    left = plan.left(states)
    packing = None
    if pack and left.jobs:
        gpus, budget, basis = pack
        packing = pack_plan(list(left.jobs), gpus, budget, profile, basis)
    left_out = {
        f"{e.name}/{s.name}": list(s.left_out) for e in run.experiments for s in e.stages if s.left_out
    }
    batches = [] if packing else slurm_batches(decisions, plan, limits, profile, request.backend)
    if request.as_json:
        extra = {"packing": packing.to_json()} if packing else {}
        extra |= {"inherited_keys_left_out": left_out} if left_out else {}
        for key, kind in (("job_arrays", JobArray), ("shared_evals", SharedEval)):
            extra[key] = [b.to_json() for b in batches if isinstance(b, kind)]
        print(json.dumps({**plan.to_json(states), **extra}, indent=1))
        return 0
    shown = {
        d.job.id: DRY_RUN_STATES[d.action] + (f" {d.scheduler_id}" if d.scheduler_id else "")
        for d in decisions
    }
    folded = folded_sweeps(plan, request.experiments)  # hundreds of points at a glance
    out.print(plan_table(plan, shown, out.width, folded))
    if left.jobs:
        out.print(totals_text(left), highlight=False, soft_wrap=True)
    else:
        out.print("Nothing left to run: every job is done.", highlight=False)
    if packing:
        out.print(packing_text(packing), highlight=False, soft_wrap=True)
    for line in batches_text(batches):
        out.print(line, highlight=False, soft_wrap=True)
    out.print(edges_text(plan, folded), highlight=False)
    for stage, keys in left_out.items():
        out.print(
            f"{stage} does not inherit the experiment's {', '.join(keys)}: its data.format or train.method "
            "does not read them (they are the other stages')",
            highlight=False,
            soft_wrap=True,
        )
    for problem in refusals:
        err.print(labelled("a launch would refuse:", "yellow", problem), highlight=False, soft_wrap=True)
    return 0
