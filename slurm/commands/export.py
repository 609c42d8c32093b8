"""--export [EXP[/STAGE] ...]: each stage's adapter merged into its base model, as a job."""

from __future__ import annotations

from pathlib import Path

from core.rundir import RunDir
from slurm.planning.experiments import load_selected, parse_overrides
from slurm.planning.plan import build_plan, with_exports
from slurm.planning.request import LaunchRequest, gpus_here
from slurm.queueing.submit import submit, wait
from slurm.watching.preflight_report import run_preflight
from slurm.watching.render import err, error, out, plan_table, warning


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
    experiments, others, *_ = load_selected(request.config_dir, profile, overrides, names)
    for problem in others:
        err.print(warning(problem), highlight=False, soft_wrap=True)
    files = {e.name: str(e.file) for e in experiments}
    targets = export_targets(asked, experiments)
    plan = with_exports(
        build_plan(experiments, profile, gpus_here=gpus_here(request.backend)),
        targets,
        request.export_format == "gguf",
    )
    if request.backend == "local":
        from slurm.cluster.local_gpus import refuse_too_many_gpus

        refuse_too_many_gpus(plan.jobs, files)
    if request.preflight:  # what is not trained yet is checked as a launch checks it
        run_preflight(plan, files, profile, show=False, as_json=False)
    done = submit(plan, profile, **request.submission, files=files)
    if done.shown:
        out.print(plan_table(plan, done.shown, out.width))
    for line in done.said:
        out.print(line, highlight=False, soft_wrap=True)
    code = (
        wait(plan, profile) if done.code == 0 and request.wait and request.backend == "slurm" else done.code
    )
    exports = [j for j in plan.jobs if j.kind == "export"]
    gguf = request.export_format == "gguf"
    if code == 0 and (request.backend == "local" or request.wait):
        out.print("Exported: " + ", ".join(f"{j.run_dir}/" for j in exports), highlight=False, soft_wrap=True)
        missing = without_gguf([Path(j.run_dir) for j in exports]) if gguf else []
        for line in missing:
            err.print(error(line), highlight=False, soft_wrap=True)
        return 1 if missing else 0
    if code == 0 and gguf:
        out.print(GGUF_ON_THE_NODE, highlight=False, soft_wrap=True)
    return code


GGUF_ON_THE_NODE = (
    "GGUF: each export job makes model.gguf only where llama.cpp's convert_hf_to_gguf.py is found on its "
    "node (LLAMA_CPP_DIR, else PATH); without it the export holds the merged model only, and its README.md "
    "says the command to run."
)


def without_gguf(out_dirs: list[Path]) -> list[str]:
    """For each finished export folder that holds no GGUF file, a sentence saying so (the merged model is
    there) and how to make one. Before: `--export-format gguf` without llama.cpp exited 0 saying
    "Exported:", and only a warning in the job's log said there was no GGUF."""
    lines = []
    for out_dir in out_dirs:
        result = RunDir(out_dir).read_export_done().get("result") or {}
        if not result.get("gguf"):
            command = result.get("gguf_command") or "python convert_hf_to_gguf.py " + str(out_dir)
            lines.append(
                f"no GGUF was made in {out_dir}/ (it holds the merged model): llama.cpp's convert_hf_to_gguf.py "
                f"was not found (LLAMA_CPP_DIR, PATH) where the export ran; set LLAMA_CPP_DIR and run the "
                f"--export again, or run: {command}"
            )
    return lines


def export_targets(asked: list[tuple[str, str | None]], experiments) -> list[tuple[str, str | None]]:
    """(experiment, stage or None) for each EXP[/STAGE] asked, a sweep's name standing for each of its
    points; nothing asked: every experiment loaded."""
    return [
        (e.name, stage)
        for name, stage in asked or [(e.name, None) for e in experiments]
        for e in experiments
        if e.name == name or (e.sweep is not None and e.sweep.sweep == name)
    ]
