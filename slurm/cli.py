"""What each launch.py action does, start to end. User mistakes end here as messages and exit code 2."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path

from rich.live import Live

from slurm.estimate import record_exact_tokens, record_splits
from slurm.experiments import load_experiments, parse_overrides
from slurm.launcher import (
    LaunchError,
    adopt_unrecorded,
    decide,
    hold_all_but,
    refuse_crossing_backends,
    run_locally,
    submit_pack,
    submit_to_slurm,
    weigh,
    with_dependents,
)
from slurm.pack import pack_plan, pack_resources
from slurm.plan import Plan, build_plan, calibration_plan, estimated_again, with_exports
from slurm.profile import load_profile
from slurm.render import (
    console,
    edges_text,
    fit,
    packing_text,
    plan_table,
    problem_lines,
    status_table,
    totals_text,
)
from slurm.request import LaunchRequest, action_of, nothing_done, request_from
from slurm.states import NEVER_STARTS_MARK, State
from slurm.status import plan_status
from slurm.watched import Watched, removed_from, removed_text, watched_experiments
from slurm.yamlfile import find_inherited
from spec.files import forget_warnings
from spec.problems import ConfigError, Problem, short_path
from spec.rundir import RunDir, current_job, mark_cancelled, record_origin
from spec.split import label as split_label

out = console()  # the terminal's width (tables fit it), or 160 columns into a file or a CI log
err = console(stderr=True)
SKIPPED = {
    "done": "COMPLETED (done)",
    "queued": "already queued",
    "running": "still running (an earlier launch)",
    "held": "not retried",
}
# A job's state in a dry run, as a relaunch would decide it (slurm/launcher.py weigh).
DRY_RUN_STATES = {
    "submit": "PLANNED",
    "done": "COMPLETED (done)",
    "queued": "queued as SLURM job",
    "running": "still running, pid",
    "refused": "REFUSED (see below)",
    "held": "not retried",
}
POLL_S = float(os.environ.get("LAUNCH_POLL_S", "5"))


# What a read-only, full or hand-altered run folder raises where a command writes (the report, the launch
# lock, a job's record): a sentence naming the file, exit 1, never a traceback.
WRITE_REFUSALS = {
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EFBIG,
    errno.EISDIR,
    errno.ENOTDIR,
}


def run(args) -> int:
    """launch.py's parsed flags → what they ask for (slurm/request.py, checked at the door) → its action."""
    forget_warnings()  # each command names every unreadable file it meets, even in one process
    try:
        return dispatch(request_from(args))
    except OSError as exc:
        if exc.errno not in WRITE_REFUSALS:
            raise
        err.print(
            f"[red]error:[/] cannot write {exc.filename or 'a file'} ({exc.strerror}): its folder is read-only or full, "
            "or a folder stands where this file belongs; fix that and run the command again",
            highlight=False,
            soft_wrap=True,
        )
        return 1
    except ConfigError as exc:
        for problem in exc.warnings:
            err.print(f"[yellow]warning:[/] {problem}", highlight=False, soft_wrap=True)
        for problem in exc.problems:
            err.print(f"[red]error:[/] {problem}", highlight=False, soft_wrap=True)
        undone = nothing_done(action_of(args))
        err.print(f"{len(exc.problems)} problem(s)" + (f"; {undone}." if undone else "."), highlight=False)
        return 2
    except LaunchError as exc:  # Interrupted (Ctrl-C) too: what was left queued or stopped, exit 130
        err.print(f"[red]error:[/] {exc}", highlight=False, soft_wrap=True)
        return exc.exit_code
    except KeyboardInterrupt:
        err.print("interrupted (Ctrl-C)", highlight=False)
        return 130


def dispatch(request: LaunchRequest) -> int:
    if not request.config_dir.is_dir():
        raise ConfigError(
            [Problem(str(request.config_dir), "--config-dir", "is not a folder of experiment YAMLs")]
        )
    profile, _ = load_profile(request.config_dir)
    return ACTIONS[request.action](request, profile)


def sync(request: LaunchRequest, profile) -> int:
    return sync_wandb(Path(profile.run_dir))


def launch(request: LaunchRequest, profile) -> int:
    """--all/--exp, --dry-run, --preflight, --calibrate, --retry-failed: load, plan, check, submit."""
    overrides = parse_overrides(list(request.overrides))
    experiments = load_experiments(request.config_dir, profile, overrides, request.experiments)
    plan = planned(experiments, profile, request)
    if removed := removed_from(Path(profile.run_dir), request.config_dir, overrides):
        err.print(removed_text(removed, Path(profile.run_dir)), highlight=False, soft_wrap=True)
    pack = requested_pack(request, profile)
    if request.action == "dry_run":
        return dry_run(plan, profile, request, pack)
    if request.action != "preflight" and request.backend == "local":
        from slurm.local_gpus import refuse_too_many_gpus  # before preflight: it may take minutes

        refuse_too_many_gpus(plan.jobs, {e.name: str(e.file) for e in experiments})
    if request.action == "preflight" or request.preflight:
        show = request.action == "preflight"
        checked = preflight(plan, experiments, profile, show=show, as_json=request.as_json and show)
        if show:
            return checked
        plan = estimated_again(
            plan, profile, {e.name: str(e.file) for e in experiments}
        )  # preflight's tokens
    code = submit(plan, profile, request, pack, {e.name: e.file for e in experiments})
    if request.action == "calibrate":
        out.print(
            f"Calibration runs write their speed to {profile.run_dir}/speeds.jsonl as they end; then "
            "--dry-run estimates these experiments from it (source: calibrated).",
            highlight=False,
        )
    elif code == 0 and (request.wait or request.backend == "local"):
        # The run ended here, every job completed: the comparison the user ran it for (beside the rest).
        written = report(profile, request)
        out.print(f"All {len(plan.jobs)} job(s) completed. Report: {written[0]}", highlight=False)
    return code


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
    experiments = load_experiments(request.config_dir, profile, overrides, names)
    files = {e.name: str(e.file) for e in experiments}
    targets = export_targets(asked, experiments)
    plan = with_exports(build_plan(experiments, profile), targets, request.export_format == "gguf")
    if request.backend == "local":
        from slurm.local_gpus import refuse_too_many_gpus

        refuse_too_many_gpus(plan.jobs, files)
    if request.preflight:  # what is not trained yet is checked as a launch checks it
        preflight(plan, experiments, profile, show=False, as_json=False)
    code = submit(plan, profile, request, None, {e.name: e.file for e in experiments})
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


def planned(experiments, profile, request: LaunchRequest) -> Plan:
    plan = build_plan(experiments, profile)
    return calibration_plan(plan, request.calibrate_steps) if request.action == "calibrate" else plan


def sync_wandb(run_root: Path) -> int:
    """--sync: upload the W&B runs that jobs wrote offline (WANDB_MODE=offline on nodes without network),
    skipping those already synced (wandb marks them with a `.synced` file)."""
    runs = [
        run for run in sorted(run_root.glob("*/*/wandb/offline-run-*")) if not any(run.glob("*.wandb.synced"))
    ]
    if not runs:
        out.print(f"No offline W&B runs to sync under {run_root}/.", highlight=False)
        return 0
    out.print(f"Syncing {len(runs)} offline W&B run(s) with `wandb sync`:", highlight=False)
    done = subprocess.run([sys.executable, "-m", "wandb", "sync", *map(str, runs)], check=False)
    if done.returncode:
        err.print(
            f"[red]error:[/] wandb sync failed (exit {done.returncode}), see above: log in on this machine "
            "first (`wandb login`, or WANDB_API_KEY in the environment), with network",
            highlight=False,
        )
        return 1
    return 0


def preflight(plan: Plan, experiments, profile, show: bool, as_json: bool) -> int:
    """Refuse (exit 2) what the jobs would refuse or could not fit, before anything is queued; torch is
    imported only on a preflight cache miss, never by the dry run or the status commands."""
    from slurm.preflight import preflight_plan

    files = {e.name: str(e.file) for e in experiments}
    fetching = profile.hub_downloads == "login"
    results, problems = preflight_plan(plan, files, profile.gpu_mem_for, fetch=fetching)
    specs = {j.id: j.spec for j in plan.jobs if j.kind == "train"}
    record_exact_tokens(
        plan.run_root,
        [(specs[r.job], r.examples, r.tokens_per_epoch) for r in results if r.tokens_per_epoch],
    )
    chosen = [(specs[r.job], r.gpu_mem_gb, r.split) for r in results if r.split and r.split["how"] == "auto"]
    record_splits(plan.run_root, chosen)
    if as_json:
        print(json.dumps([r.as_json() for r in results], indent=1))
    elif show and results:  # no empty box when nothing could be computed (the errors below say why)
        out.print(fit(preflight_table(results), out.width, PREFLIGHT_PRIORITY))
    if not fetching and (fetch := list(dict.fromkeys(c for r in results for c in r.fetch))):
        err.print(fetch_note(fetch), highlight=False, soft_wrap=True)  # fetching: they are problems
    if problems:
        raise ConfigError(problems)
    return 0


def fetch_note(commands: list[str]) -> str:
    """hub_downloads: nodes: not a refusal, the nodes download at the job's start; if they cannot after
    all, the note says how to fetch on this machine into the cache the nodes share."""
    lines = "\n".join(f"  {c}" for c in commands)
    return (
        "[yellow]warning:[/] not in this machine's Hugging Face cache, so jobs on nodes without network "
        f"would fail at their start; fetch into the shared cache (HF_HOME) first:\n{lines}"
    )


# preflight_table's columns, most important first (slurm/render.py fit).
PREFLIGHT_PRIORITY = (
    "job",
    "fits",
    "memory/GPU",
    "micro-batch",
    "trainable",
    "max_length",
    "cut at max_length",
    "tokens/epoch",
    "lengths p50/p90/p99/max",
)


def preflight_table(results):
    from rich.table import Table

    table = Table(
        "job",
        "trainable",
        "lengths p50/p90/p99/max",
        "max_length",
        "tokens/epoch",
        "cut at max_length",
        "memory/GPU",
        "fits",
        "micro-batch",
    )
    for r in results:
        memory = (
            f"{r.memory_gb:.1f} GB" + (f" of {r.gpu_mem_gb:g}" if r.gpu_mem_gb else "")
            if r.memory_gb
            else "-"
        )
        table.add_row(
            r.job,
            f"{r.trainable_percent:.2f}% ({r.trainable_params:,})",
            "\n".join(
                ("targets " if part == "targets" else "") + "/".join(map(str, values))
                for part, values in r.length_percentiles.items()
            )
            or "-",
            str(r.max_length) if r.max_length else f"skipped: {r.tokens_skipped}",
            f"{r.tokens_per_epoch:,}" if r.tokens_per_epoch else "-",
            str(r.truncated_inputs) if r.truncated_inputs is not None else "-",
            memory,
            {True: "yes", False: f"no (batch {r.largest_batch} fits)", None: "-"}[r.fits],
            split_label(r.split) or "-",
        )
    return table


def watch(request: LaunchRequest, profile) -> int:
    """--status, --tail, --cancel, --report: on what the run root holds (slurm/watched.py), narrowed by
    --config-dir and --exp; files that do not load are warned about."""
    if request.action == "cancel" and request.removed:
        return cancel_removed(request, profile)
    watched = watched_of(request, profile, request.experiments)
    unknown = [p for p in watched.warnings if p.file == "command line"]
    if request.action == "cancel" and unknown:
        raise ConfigError([replace(p, warning=False) for p in unknown])  # a cancel that cancels nothing
    for problem in watched.warnings:
        skipped = "" if problem in unknown else " (skipped)"
        err.print(f"[yellow]warning:[/] {problem}{skipped}", highlight=False, soft_wrap=True)
    if request.action == "report":
        return write_run_root_report(request, profile)
    plan = build_plan(watched.experiments, profile)
    if not plan.jobs and not watched.gone and not unknown:
        out.print(
            f"Nothing has been launched under {profile.run_dir}/ yet: `--dry-run --all` shows what would run, "
            "and --config-dir picks another folder of experiments.",
            highlight=False,
        )
        return 0
    if request.action in ("status", "cancel"):  # a submission whose launch died before recording it
        for line in adopt_unrecorded(plan, forget_missing=False):
            err.print(line, highlight=False, soft_wrap=True)
    if request.action == "status":
        code = show_status(plan, profile)
        for line in origin_lines(watched, profile):
            out.print(line, highlight=False, soft_wrap=True)
        return code
    if request.action == "tail":
        from slurm.tail import follow

        return follow(plan, request.tail, profile.log_dir, out, rank=request.rank)
    # --cancel --exp A or --config-dir X: what else the run root holds, loaded and planned once for both
    # checks below (a base eval or a pack another folder's experiment needs is not this cancel's to stop).
    narrowed = request.experiments or request.config_dir_named
    everything = run_root_plan(request, profile) if narrowed else None
    return cancel(
        without_shared_bases(plan, everything),
        profile.log_dir,
        sharing_packs(plan, everything, profile.log_dir),
    )


def run_root_plan(request: LaunchRequest, profile) -> Plan:
    """The plan of every experiment the run root holds, whatever --exp and --config-dir narrow."""
    overrides = parse_overrides(list(request.overrides))
    held = watched_experiments(Path(profile.run_dir), request.config_dir, False, overrides).experiments
    return build_plan(held, profile)


def without_shared_bases(plan: Plan, everything: Plan | None) -> Plan:
    """--cancel --exp A: A's jobs, less the base-model evals an experiment it did not name also needs
    (its base row and its export read them); `everything`: the run root's plan (None: nothing narrowed)."""
    if everything is None or not plan.base_of:
        return plan
    chosen = set(plan.experiments())
    needed = {job for name, job in everything.base_of.items() if name not in chosen}
    return plan.only({j.id for j in plan.jobs} - needed)


def watched_of(request: LaunchRequest, profile, names) -> Watched:
    overrides = parse_overrides(list(request.overrides))
    return watched_experiments(
        Path(profile.run_dir), request.config_dir, request.config_dir_named, overrides, names
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


def write_run_root_report(request: LaunchRequest, profile) -> int:
    written = report(profile, request)
    out.print("wrote " + ", ".join(str(p) for p in written))
    if request.experiments or request.config_dir_named:
        out.print(
            f"The report covers every experiment {profile.run_dir}/ holds: --exp and --config-dir narrow "
            "--status, --tail and --cancel, never the report (one report per run root, never replaced by a part).",
            highlight=False,
        )
    out.print(f"Curves: tensorboard --logdir {profile.run_dir}", highlight=False)
    return 0


def report(profile, request: LaunchRequest) -> list[Path]:
    """runs/report.md, report.csv and the loss curves of every experiment the run root holds (and, with a
    named --config-dir, that folder's experiments not run yet), with the baselines of each one's task."""
    from eval.report import BaselinesError, write_report
    from slurm.usage import plan_usage

    held = watched_experiments(
        Path(profile.run_dir), request.config_dir, False, parse_overrides(list(request.overrides))
    )
    experiments = {e.name: e for e in held.experiments}
    folders = dict(held.folders)
    if request.config_dir_named:
        named = watched_of(request, profile, None)
        experiments.update({e.name: e for e in named.experiments if e.name not in experiments})
        folders.update({k: v for k, v in named.folders.items() if k not in folders})
    plan = build_plan(list(experiments.values()), profile)
    states = {row.job.id: row.state.value for row in plan_status(plan, profile.log_dir)}
    baselines = [
        found
        for folder in dict.fromkeys(folders.values())
        if (found := find_inherited("baselines.yaml", folder, Path("/"))) is not None
    ]
    tasks = {name: e.experiment.task for name, e in experiments.items()}
    usage = plan_usage(plan, profile.log_dir)  # what each job held: sacct, or a local job's own clock
    try:
        return write_report(
            plan,
            Path(profile.run_dir),
            states,
            baselines,
            tasks,
            profile.gpu_hour_cost,
            usage,
            sweeps={name: e.sweep for name, e in experiments.items() if e.sweep is not None},
            base_evals=base_evals(plan),
        )
    except BaselinesError as exc:
        raise ConfigError([Problem(str(exc.path), "task", str(exc))]) from None


def base_evals(plan: Plan) -> dict:
    """Experiment → the eval of its base model (eval.baseline), or why it has none, for the report."""
    from eval.report import BaseEval

    found = {
        name: BaseEval(job_id, plan.job(job_id).run_dir, plan.job(job_id).spec.model.name_or_path)
        for name, job_id in plan.base_of.items()
    }
    return found | {name: BaseEval("", "", "", left_out=why) for name, why in plan.base_left_out.items()}


def show_status(plan: Plan, profile) -> int:
    rows = plan_status(plan, profile.log_dir)
    cancel_stuck(rows, profile.log_dir)
    out.print(status_table(rows, out.width))
    for line in problem_lines(rows):
        out.print(line, highlight=False, soft_wrap=True)
    return 0


def dry_run(plan: Plan, profile, request: LaunchRequest, pack: tuple[int, str] | None) -> int:
    """The plan, each job in the state a relaunch would give it (done, queued, still running, refused,
    or planned: to be submitted), with the makespan and GPU-hours of what is left and, for a pack, the
    lanes of what is left. Reads the run folders and asks squeue once (only if some job was queued)."""
    decisions, refusals = weigh(plan, force=request.force)
    states = {d.job.id: d.action if d.action != "submit" else "planned" for d in decisions}
    left = plan.left(states)
    packing = pack_plan(list(left.jobs), *pack, profile) if pack and left.jobs else None
    if request.as_json:
        extra = {"packing": packing.to_json()} if packing else {}
        print(json.dumps({**plan.to_json(states), **extra}, indent=1))
        return 0
    shown = {
        d.job.id: DRY_RUN_STATES[d.action] + (f" {d.scheduler_id}" if d.scheduler_id else "")
        for d in decisions
    }
    out.print(plan_table(plan, shown, out.width))
    if left.jobs:
        out.print(totals_text(left), highlight=False, soft_wrap=True)
    else:
        out.print("Nothing left to run: every job is done.", highlight=False)
    if packing:
        out.print(packing_text(packing), highlight=False, soft_wrap=True)
    out.print(edges_text(plan), highlight=False)
    for problem in refusals:
        err.print(f"[yellow]a launch would refuse:[/] {problem}", highlight=False, soft_wrap=True)
    return 0


def requested_pack(request: LaunchRequest, profile) -> tuple[int, str] | None:
    """(GPUs, budget) of a packed allocation: --pack/--budget, else cluster.yaml's pack/budget. A local
    launch runs unpacked (cluster.yaml's pack is for SLURM; a --pack here was refused at the door)."""
    if request.budget and not (request.pack or profile.pack):
        message = "is the time of a packed allocation: add --pack G (its GPUs)"
        raise ConfigError([Problem("command line", "--budget", message)])
    gpus = request.pack if request.pack is not None else profile.pack
    if not gpus or (request.submits and request.backend == "local"):  # --pack 0: no pack
        return None
    return gpus, request.budget or profile.budget or profile.max_time


def submit(
    plan: Plan,
    profile,
    request: LaunchRequest,
    pack: tuple[int, str] | None = None,
    files: dict[str, Path] | None = None,
) -> int:
    """Decide and submit under the run root's launch lock (a second launch waits, then finds the jobs
    queued); a local run keeps it until its jobs end. --wait follows SLURM jobs after letting it go.
    `files`: each experiment's YAML, recorded as its origin (watching finds it there)."""
    from slurm.lock import launch_lock
    from slurm.snapshot import take_snapshot

    def waiting(holder: str) -> None:
        err.print(f"waiting for the launch lock of {profile.run_dir}/: held by {holder}", highlight=False)

    backend_name = request.backend
    with launch_lock(Path(profile.run_dir), waiting):
        for line in adopt_unrecorded(plan, forget_missing=True):
            err.print(line, highlight=False, soft_wrap=True)
        decisions = decide(plan, force=request.force)
        if request.action == "retry_failed":
            failed = {
                r.job.id
                for r in plan_status(plan, profile.log_dir)
                if r.state.failed or r.state is State.UNKNOWN
            }
            decisions = hold_all_but(decisions, with_dependents(plan, failed))
        refuse_crossing_backends(decisions, backend_name)
        todo = [d for d in decisions if d.action == "submit"]
        skipped = {d.job.id: SKIPPED[d.action] for d in decisions if d.action != "submit"}
        for name, file in (files or {}).items():
            try:  # a convenience for watching: never a reason to stop a launch
                record_origin(Path(plan.run_root) / name, file, request.config_dir)
            except OSError as exc:
                err.print(
                    f"[yellow]warning:[/] cannot record where {name} came from ({exc.strerror}): "
                    "--status finds it only with --config-dir",
                    highlight=False,
                    soft_wrap=True,
                )
        # A local job an earlier launch left running is waited for here, as if this launch had started it.
        adopting = backend_name == "local" and any(d.action == "running" for d in decisions)
        if not todo and not adopting:
            out.print(plan_table(plan, skipped, out.width))
            out.print("Nothing to submit: every job is done, already queued or still running.")
        elif backend_name == "local":
            return run_here(plan, profile, decisions, take_snapshot(Path(profile.log_dir)))
        elif pack:
            queue_pack(plan, profile, decisions, skipped, pack, take_snapshot(Path(profile.log_dir)), files)
        else:
            queue(plan, profile, decisions, skipped, take_snapshot(Path(profile.log_dir)), files)
    return wait(plan, profile) if request.wait and backend_name == "slurm" else 0


def queue(plan: Plan, profile, decisions, skipped: dict[str, str], code, files) -> None:
    from slurm.backends import SlurmBackend

    refuse_never_starting([d.job for d in decisions if d.action == "submit"], files, profile)
    ids = submit_to_slurm(decisions, SlurmBackend(profile, Path.cwd(), code))
    states = {d.job.id: f"submitted {ids[d.job.id]}" for d in decisions if d.action == "submit"}
    out.print(plan_table(plan, {**skipped, **states}, out.width))
    out.print(f"Submitted {len(states)} job(s). Watch: squeue --me, python launch.py --status, --tail EXP")


def queue_pack(plan: Plan, profile, decisions, skipped: dict[str, str], pack, code, files) -> None:
    from slurm.backends import SlurmBackend

    todo = [d.job for d in decisions if d.action == "submit"]
    packing = pack_plan(todo, *pack, profile)  # what is not queued elsewhere already
    resources = pack_resources(todo, packing, profile)
    refuse_never_starting(todo, files, profile, pack=resources)
    ids = submit_pack(decisions, SlurmBackend(profile, Path.cwd(), code), resources)
    states = {job.id: f"packed in {ids[job.id]}" for job in todo}
    out.print(plan_table(plan, {**skipped, **states}, out.width))
    out.print(packing_text(packing), highlight=False, soft_wrap=True)
    out.print(
        f"Submitted {len(todo)} job(s) as one allocation ({ids[todo[0].id]}: {resources.gpus} GPU(s), "
        f"{resources.time}). Watch: python launch.py --status, --tail EXP",
        highlight=False,
    )


def refuse_never_starting(jobs, files, profile, pack=None) -> None:
    """The cluster's limits (slurm/limits.py), read now: a job SLURM would leave pending forever, or a
    launch it would refuse halfway, is refused whole before the first sbatch."""
    from slurm.limits import cluster_problems

    def say(line: str) -> None:
        err.print(f"[yellow]warning:[/] {line}", highlight=False, soft_wrap=True)

    names = {name: str(file) for name, file in (files or {}).items()}
    if problems := cluster_problems(jobs, names, profile, say, pack=pack):
        raise ConfigError(problems)


def run_here(plan: Plan, profile, decisions, code) -> int:
    from slurm.backends import LocalBackend

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
    return 1 if any(s is not State.COMPLETED for s in states.values()) else 0


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
    return 1 if any(r.state is not State.COMPLETED for r in rows) else 0


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
    stuck = [r for r in rows if r.stuck and r.scheduler_id]
    if stuck:
        cancel_rows(stuck, log_root)
        err.print(
            f"cancelled {len(stuck)} job(s) that could never start: " + ", ".join(r.job.id for r in stuck)
        )


def sharing_packs(plan: Plan, everything: Plan | None, log_root: str) -> dict[str, list[str]]:
    """Packed job id → the live units of other experiments in it: cancelling the pack would stop them;
    `everything`: the run root's plan (None: nothing narrowed, nothing else to stop)."""
    if everything is None:
        return {}
    chosen = {job.id for job in plan.jobs}
    others: dict[str, list[str]] = {}
    for row in plan_status(everything, log_root):
        record = current_job(Path(row.job.run_dir)) or {}
        if record.get("pack") and row.state.live and row.job.id not in chosen:
            others.setdefault(row.scheduler_id, []).append(row.job.id)
    return others


def cancel_removed(request: LaunchRequest, profile) -> int:
    """--cancel --removed: the queued or running jobs of experiments the run root holds that no config
    folder has any more (points removed from a sweep). Their configs are gone, so their job records are
    all there is: each unfinished stage's last job, if the scheduler still has it live."""
    from slurm.scheduler import cancel as cancel_jobs
    from slurm.scheduler import local_alive, scheduler_job
    from slurm.status import query_slurm

    overrides = parse_overrides(list(request.overrides))
    gone = watched_experiments(Path(profile.run_dir), request.config_dir, False, overrides).gone
    records = {
        f"{name}/{stage.name}": record
        for name in gone
        for stage in sorted(p for p in (Path(profile.run_dir) / name).iterdir() if p.is_dir())
        if (record := current_job(stage)) and not RunDir(stage).done.exists()
    }
    packed = sorted(job for job, record in records.items() if record.get("pack"))
    live_slurm = query_slurm([r["job_id"] for r in records.values() if r.get("backend") != "local"])
    jobs = {
        job: scheduler_job(profile.log_dir, job, record)
        for job, record in records.items()
        if job not in packed
    }

    def still_live(job: str) -> bool:
        record = records[job]
        if record.get("backend") == "local":
            return local_alive(jobs[job])
        return record["job_id"] in live_slurm and live_slurm[record["job_id"]].state.live

    live = {job: handle for job, handle in jobs.items() if still_live(job)}
    for job in live:
        if records[job].get("backend") == "local":
            mark_cancelled(Path(profile.run_dir) / job, records[job]["job_id"])
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
            f"[yellow]warning:[/] not cancelled, units of a packed allocation: {', '.join(packed)}",
            highlight=False,
        )
    return 1 if still else 0


def cancel(plan: Plan, log_root: str, sharing: dict[str, list[str]] | None = None) -> int:
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
        err.print(f"[red]error:[/] could not be stopped, still running: {', '.join(running)}")
        return 1
    return 0


def cancel_rows(rows, log_root: str) -> list[str]:
    """Through submitit (scancel), or by stopping the local processes for sure, as each job.json record
    says; returns the plan ids of local jobs whose processes still run after every signal. A local job is
    noted cancelled first: its launcher, if alive, then sees it cancelled, not failed, and starts nothing
    new."""
    from slurm.scheduler import cancel as cancel_jobs
    from slurm.scheduler import scheduler_job
    from spec.rundir import current_job, mark_cancelled

    records = {r.job.id: current_job(Path(r.job.run_dir)) for r in rows}
    for row in rows:
        if records[row.job.id].get("backend") == "local":
            mark_cancelled(Path(row.job.run_dir), records[row.job.id]["job_id"])
    jobs = {r.job.id: scheduler_job(log_root, r.job.id, records[r.job.id]) for r in rows}
    still = set(cancel_jobs(list(jobs.values())))
    return [job_id for job_id, job in jobs.items() if str(job.job_id) in still]


# Each action's function: launch.py's flag → what runs (slurm/request.py names the actions).
ACTIONS = {
    "launch": launch,
    "dry_run": launch,
    "preflight": launch,
    "calibrate": launch,
    "retry_failed": launch,
    "status": watch,
    "tail": watch,
    "cancel": watch,
    "report": watch,
    "sync": sync,
    "export": export,
}
