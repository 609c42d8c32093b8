"""--status and --tail, on what the run root holds (slurm/watching/watched.py), narrowed by --config-dir and --exp;
files that do not load are warned about. --cancel watches the same way (slurm/commands/cancel.py)."""

from __future__ import annotations

from pathlib import Path

from core.problems import short_path
from slurm.planning.request import LaunchRequest
from slurm.queueing.decisions import adopt_unrecorded
from slurm.queueing.submit import cancel_stuck
from slurm.watching.render import err, folded_sweeps, out, problem_lines, status_table
from slurm.watching.status import plan_status
from slurm.watching.watched import Watched, watched_plan


def status(request: LaunchRequest, profile) -> int:
    watching = watched_plan(request, profile)
    if watching is None:
        return 0
    watched, plan = watching
    for line in adopt_unrecorded(plan, forget_missing=False):
        err.print(line, highlight=False, soft_wrap=True)
    rows = plan_status(plan, profile.log_dir)
    cancel_stuck(rows, profile.log_dir)
    # hundreds of points at a glance: a sweep is one row unless --exp names it (or one of its points)
    out.print(status_table(rows, out.width, folded_sweeps(plan, request.experiments), plan))
    for line in [*problem_lines(rows), *origin_lines(watched, profile)]:
        out.print(line, highlight=False, soft_wrap=True)
    return 0


def tail(request: LaunchRequest, profile) -> int:
    from slurm.watching.tail import follow

    watching = watched_plan(request, profile)
    return (
        0 if watching is None else follow(watching[1], request.tail, profile.log_dir, out, rank=request.rank)
    )


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
