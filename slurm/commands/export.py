"""--export [EXP[/STAGE] ...]: each stage's adapter merged into its base model, as a job."""

from __future__ import annotations

from slurm.commands.launch import run_preflight
from slurm.experiments import load_selected, parse_overrides
from slurm.plan import build_plan, with_exports
from slurm.queueing import submit
from slurm.render import err, out
from slurm.request import LaunchRequest


def export(request: LaunchRequest, profile) -> int:
    """--export [EXP[/STAGE] ...] (or --exp, --all): each stage's adapter merged into its base as a job
    (on SLURM, or here with --backend local), after whatever of its training and evals is not done yet,
    which is checked as a launch checks it (preflight, the GPUs here); an export already made from the same
    adapter is skipped (eval/export.py). A sweep's name exports each of its points."""
    asked = [(t.partition("/")[0], t.partition("/")[2] or None) for t in request.export]
    names = list(dict.fromkeys(name for name, _ in asked)) or (
        list(request.experiments) if request.experiments else None
    )
    overrides = parse_overrides(list(request.overrides))
    experiments, others = load_selected(request.config_dir, profile, overrides, names)
    for problem in others:
        err.print(f"[yellow]warning:[/] {problem}", highlight=False, soft_wrap=True)
    files = {e.name: str(e.file) for e in experiments}
    targets = export_targets(asked, experiments)
    plan = with_exports(build_plan(experiments, profile), targets, request.export_format == "gguf")
    if request.backend == "local":
        from slurm.local_gpus import refuse_too_many_gpus

        refuse_too_many_gpus(plan.jobs, files)
    if request.preflight:  # what is not trained yet is checked as a launch checks it
        run_preflight(plan, files, profile, show=False, as_json=False)
    code = submit(plan, profile, request, None, files)
    exports = [j for j in plan.jobs if j.kind == "export"]
    if code == 0 and request.backend == "local":
        out.print("Exported: " + ", ".join(f"{j.run_dir}/" for j in exports), highlight=False, soft_wrap=True)
    return code


def export_targets(asked: list[tuple[str, str | None]], experiments) -> list[tuple[str, str | None]]:
    """(experiment, stage or None) for each EXP[/STAGE] asked, a sweep's name standing for each of its
    points; nothing asked: every experiment loaded."""
    return [
        (e.name, stage)
        for name, stage in asked or [(e.name, None) for e in experiments]
        for e in experiments
        if e.name == name or (e.sweep is not None and e.sweep.sweep == name)
    ]
