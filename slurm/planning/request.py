"""What one launch.py command asks for: typed, and checked once at the door, before any file is loaded.

A flag that cannot work with the others (a `--pack` where no SLURM runs, `--budget` that is no duration,
`--rank` without `--tail`) is refused here, before loading experiments, planning, preflight or the launch
lock; the rest of the CLI (slurm/cli.py) reads this object, never argparse's namespace.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from core.config import slurm_duration
from core.problems import ConfigError, Problem
from slurm.cluster.client import pick_backend

Action = Literal[
    "launch",
    "dry_run",
    "preflight",
    "calibrate",
    "retry_failed",
    "status",
    "tail",
    "cancel",
    "report",
    "sync",
    "export",
]
# The flags that name an action (argparse keeps them mutually exclusive); none of them: a launch.
ACTION_FLAGS: tuple[Action, ...] = tuple(action for action in get_args(Action) if action != "launch")
WATCHING: tuple[Action, ...] = ("status", "tail", "cancel", "report")
SUBMITTING: tuple[Action, ...] = ("launch", "calibrate", "retry_failed", "export")
# Actions that need experiments named (--all or --exp); the others take every experiment when none is.
NAMING: tuple[Action, ...] = ("launch", "calibrate", "preflight", "export")
DEFAULT_CONFIG_DIR = Path("configs/experiments")
PLANNING: tuple[Action, ...] = (
    "launch",
    "retry_failed",
    "calibrate",
    "dry_run",
)  # the dry run shows a launch
# Each option (argparse's name), its flag, the verbs it applies to, and what to say where it does not (None:
# that it does nothing there): given to another verb it is refused, never silently ignored (before:
# `--report --exp a` reported every experiment, `--export --pack 2` made no pack, `--status --json` printed
# a table).
APPLIES_TO: dict[str, tuple[str, tuple[Action, ...], str | None]] = {
    "json": ("--json", ("dry_run", "preflight"), None),
    "no_preflight": ("--no-preflight", (*SUBMITTING, "dry_run"), None),
    "wait": ("--wait", SUBMITTING, None),
    "force": ("--force", (*SUBMITTING, "dry_run"), None),
    "backend": ("--backend", (*SUBMITTING, "dry_run", "status", "cancel"), None),
    "pack": ("--pack", (*PLANNING, "preflight"), None),
    "budget": ("--budget", (*PLANNING, "preflight"), None),
    "budget_basis": ("--budget-basis", (*PLANNING, "preflight"), None),
    "export_format": ("--export-format", ("export",), None),
    "removed": ("--removed", ("cancel",), "picks what --cancel stops: add --cancel"),
    "rank": ("--rank", ("tail",), "picks the task of a multi-GPU job whose log --tail follows: add --tail"),
    "calibrate_steps": ("--calibrate-steps", ("calibrate",), None),
    "exp": ("--exp", tuple(a for a in get_args(Action) if a not in ("sync", "report")), None),
    "all": ("--all", tuple(a for a in get_args(Action) if a not in ("sync", "report", "tail")), None),
    "overrides": ("KEY=VALUE", tuple(a for a in get_args(Action) if a != "sync"), None),
}


@dataclass(frozen=True)
class LaunchRequest:
    action: Action
    config_dir: Path
    experiments: tuple[str, ...] | None  # --exp NAME...; None: every experiment of config_dir
    overrides: tuple[str, ...] = ()  # KEY=VALUE
    # A submitting action's is resolved once at the door (`auto` asks sinfo): never `auto` there.
    backend: Literal["auto", "slurm", "local"] = "auto"
    # --config-dir was given: watching shows that folder's experiments; without it, what the run root holds.
    config_dir_named: bool = True
    as_json: bool = False  # --json (dry run, preflight)
    preflight: bool = True  # before submitting (--no-preflight: False)
    wait: bool = False
    pack: int | None = None  # --pack G; None: cluster.yaml's `pack`, if any
    budget: str | None = None  # --pack's time limit, a SLURM duration
    # --budget-basis: a pruned sweep's runs counted whole (worst) or as pruning is expected to leave them
    budget_basis: Literal["worst", "expected"] = "worst"
    force: bool = False
    removed: bool = False  # --cancel --removed
    export: tuple[str, ...] = ()  # --export EXP[/STAGE] ...: what to export (with --all: every experiment)
    export_format: Literal["safetensors", "gguf"] = "safetensors"
    tail: str | None = None  # EXP[/STAGE]
    rank: int = 0  # with --tail
    calibrate_steps: int = 30

    @property
    def submits(self) -> bool:
        return self.action in SUBMITTING

    @property
    def submission(self) -> dict:
        """What slurm/queueing/submit.py submit reads of the request, as its keyword arguments."""
        return {
            "backend": self.backend,
            "config_dir": self.config_dir,
            "force": self.force,
            "retry_failed": self.action == "retry_failed",
        }


def action_of(args) -> Action:
    named = [flag for flag in ACTION_FLAGS if getattr(args, flag, None) not in (None, False)]
    return named[0] if named else "launch"


def nothing_done(action: Action) -> str:
    """What a refused command did not do, for its last line: a read-only command submits nothing anyway."""
    if action == "cancel":
        return "nothing was cancelled"
    return "nothing was submitted" if action in SUBMITTING else ""


def request_from(args) -> LaunchRequest:
    """argparse's namespace → a LaunchRequest, or ConfigError (exit 2) naming every flag that is wrong."""
    action = action_of(args)
    request = LaunchRequest(
        action=action,
        config_dir=args.config_dir or DEFAULT_CONFIG_DIR,
        config_dir_named=args.config_dir is not None,
        experiments=tuple(args.exp) if args.exp else None,
        overrides=tuple(args.overrides),
        backend=backend_here(args.backend or "auto") if action in SUBMITTING else args.backend or "auto",
        as_json=args.json,
        preflight=not args.no_preflight,
        wait=args.wait,
        pack=args.pack,
        budget=args.budget,
        budget_basis=args.budget_basis or "worst",
        force=args.force,
        removed=args.removed,
        export=tuple(args.export or ()),
        export_format=args.export_format or "safetensors",
        tail=args.tail,
        rank=args.rank or 0,
        calibrate_steps=30 if args.calibrate_steps is None else args.calibrate_steps,
    )
    misplaced = not_for_the_verb(args, action)
    wrong = {p.key for p in misplaced}  # a misplaced flag is named once, for being there, not its value too
    problems = misplaced + [
        p
        for p in door_problems(request, chose=bool(args.all or args.exp or args.export))
        if p.key not in wrong
    ]
    if problems:
        raise ConfigError(problems)
    return request


def not_for_the_verb(args, action: Action) -> list[Problem]:
    """Each option given (argparse leaves one not given None, False or empty) to a verb it does not apply
    to, named with the verbs that take it."""
    found = []
    for name, (flag, verbs, hint) in APPLIES_TO.items():
        value = getattr(args, name, None)
        if value is None or value is False or value == [] or action in verbs:
            continue
        takers = ", ".join(verb_flag(v) for v in verbs)
        message = hint or f"does nothing for {verb_flag(action)}: it is for {takers}; remove it"
        found.append(Problem("command line", flag, message))
    return found


def verb_flag(action: Action) -> str:
    return "a launch" if action == "launch" else "--" + action.replace("_", "-")


def door_problems(request: LaunchRequest, chose: bool) -> list[Problem]:
    def problem(flag: str, what: str) -> Problem:
        return Problem("command line", flag, what)

    found = []
    if request.action in NAMING and not chose:
        found.append(problem("", "say which experiments: --all or --exp NAME [NAME ...]"))
    if request.calibrate_steps < 1:
        found.append(problem("--calibrate-steps", "must be at least 1"))
    if request.rank < 0:
        found.append(problem("--rank", "must be 0 or more (task 0 is rank 0)"))
    if request.pack is not None and request.pack < 0:
        found.append(problem("--pack", "must be the number of GPUs of the allocation (0: no pack)"))
    if request.budget:
        try:
            slurm_duration(request.budget)
        except ValueError as exc:
            found.append(problem("--budget", str(exc)))
    if request.pack and request.submits and request.backend == "local":
        found.append(
            problem(
                "--pack",
                "packs a SLURM allocation, and there is no SLURM here: locally, jobs already share this "
                "machine (`local_parallel_jobs` in cluster.yaml sets how many run at once)",
            )
        )
    return found


def backend_here(backend: str) -> str:
    """`slurm` or `local`: what `auto` means on this machine (sbatch on PATH)."""
    return pick_backend(backend)


def gpus_here(backend: str) -> int | None:
    """This machine's GPUs when a plan runs here (the local backend), for its estimates and `time: auto`
    limits (core/devices.py estimated_gpus); None on SLURM. The launch, the dry run, an export and the
    watching commands plan alike, so --status names the limit a local job ran under."""
    if backend_here(backend) != "local":
        return None
    from slurm.cluster.local_gpus import VisibleGpus

    return len(set(VisibleGpus.detect().ids))
