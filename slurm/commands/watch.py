"""--status and --tail, on what the run root holds (slurm/watched.py), narrowed by --config-dir and --exp;
files that do not load are warned about. --cancel watches the same way (slurm/commands/cancel.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from core.problems import ConfigError, short_path
from slurm.decisions import adopt_unrecorded
from slurm.experiments import parse_overrides
from slurm.plan import Plan, build_plan
from slurm.queueing import cancel_stuck
from slurm.render import err, out, problem_lines, status_table
from slurm.request import LaunchRequest
from slurm.status import plan_status
from slurm.watched import Watched, watched_experiments


def status(request: LaunchRequest, profile) -> int:
    watching = watched_plan(request, profile)
    if watching is None:
        return 0
    watched, plan = watching
    rows = plan_status(plan, profile.log_dir)
    cancel_stuck(rows, profile.log_dir)
    out.print(status_table(rows, out.width))
    for line in [*problem_lines(rows), *origin_lines(watched, profile)]:
        out.print(line, highlight=False, soft_wrap=True)
    return 0


def tail(request: LaunchRequest, profile) -> int:
    from slurm.tail import follow

    watching = watched_plan(request, profile)
    return (
        0 if watching is None else follow(watching[1], request.tail, profile.log_dir, out, rank=request.rank)
    )


def watched_plan(request: LaunchRequest, profile) -> tuple[Watched, Plan] | None:
    """The watched experiments and their plan; None (said so) when the run root holds nothing to show.
    --status and --cancel first record what a launch killed mid-sbatch left queued unrecorded."""
    watched = warned(request, profile)
    plan = build_plan(watched.experiments, profile)
    unknown = any(p.file == "command line" for p in watched.warnings)
    if not plan.jobs and not watched.gone and not unknown:
        out.print(
            f"Nothing has been launched under {profile.run_dir}/ yet: `--dry-run --all` shows what would run, "
            "and --config-dir picks another folder of experiments.",
            highlight=False,
        )
        return None
    if request.action in ("status", "cancel"):
        for line in adopt_unrecorded(plan, forget_missing=False):
            err.print(line, highlight=False, soft_wrap=True)
    return watched, plan


def warned(request: LaunchRequest, profile) -> Watched:
    """The watched experiments, each file that did not load warned about (skipped); an --exp name nothing
    has is refused by --cancel (a cancel that cancels nothing), warned about by the others."""
    watched = watched_of(request, profile, request.experiments)
    unknown = [p for p in watched.warnings if p.file == "command line"]
    if request.action == "cancel" and unknown:
        raise ConfigError([replace(p, warning=False) for p in unknown])
    for problem in watched.warnings:
        skipped = "" if problem in unknown else " (skipped)"
        err.print(f"[yellow]warning:[/] {problem}{skipped}", highlight=False, soft_wrap=True)
    return watched


def watched_of(request: LaunchRequest, profile, names, named: bool | None = None) -> Watched:
    """`named` (default: whether --config-dir was given) looks at that folder alone, else at every folder
    the run root's experiments came from."""
    overrides = parse_overrides(list(request.overrides))
    named = request.config_dir_named if named is None else named
    return watched_experiments(Path(profile.run_dir), request.config_dir, named, overrides, names)


def origin_lines(watched: Watched, profile) -> list[str]:
    """Where the experiments shown came from, and what the run root holds that no config has any more."""
    folders: dict[Path, int] = {}
    for folder in watched.folders.values():
        folders[folder] = folders.get(folder, 0) + 1
    lines = [
        "From " + ", ".join(f"{short_path(str(f))}/ ({n} experiment(s))" for f, n in folders.items()) + "."
    ]
    if watched.gone:
        lines.append(
            f"{profile.run_dir}/ also holds {', '.join(watched.gone)}: no longer in any config folder "
            "(their run folders are kept; a relaunch does not touch them)."
        )
    return lines if folders or watched.gone else []
