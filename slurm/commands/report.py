"""--report: runs/report.md, report.csv and the loss curves of every experiment the run root holds, with
the baselines of each one's task (slurm/watching/reporting.py writes it, here and after a local launch)."""

from __future__ import annotations

from pathlib import Path

from core.rundir import run_root_experiments
from slurm.planning.request import LaunchRequest
from slurm.watching.render import err, out
from slurm.watching.reporting import written_report
from slurm.watching.watched import warned


def report(request: LaunchRequest, profile) -> int:
    if not request.config_dir_named and not run_root_experiments(Path(profile.run_dir)):
        # Before: an empty report.md written and exit 0, when the runs were in another folder's run root.
        err.print(
            f"nothing to report: the run root {profile.run_dir}/ holds no run. Launch first, or give the "
            "--config-dir whose cluster.yaml names the run root of your runs (its run_dir)",
            highlight=False,
            soft_wrap=True,
        )
        return 1
    watched = warned(request, profile)  # the files that do not load, named as --status names them
    narrowed = request.experiments or request.config_dir_named
    written = written_report(profile, request, held=None if narrowed else watched)
    out.print("wrote " + ", ".join(str(p) for p in written))
    if narrowed:
        out.print(
            f"The report covers every experiment {profile.run_dir}/ holds: --exp and --config-dir narrow "
            "--status, --tail and --cancel, never the report (one report per run root, never replaced by a part).",
            highlight=False,
        )
    out.print(f"Curves: tensorboard --logdir {profile.run_dir}", highlight=False)
    return 0
