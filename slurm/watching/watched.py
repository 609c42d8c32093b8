"""Which experiments --status, --tail, --cancel and --report look at: what the run root holds.

Every experiment with a run folder is loaded from the config folder it was launched from
(RUN_ROOT/EXP/origin.json, core/rundir.py), so a `make demo` is seen by a plain `--status` and a plain
`--report` covers it, whatever folder the default --config-dir names. `--config-dir` and `--exp` narrow
that; a named --config-dir also shows its experiments that have not run yet (as PLANNED).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from core.problems import ConfigError, Problem, did_you_mean
from core.rundir import Origin, run_root_experiments
from slurm.planning.experiments import chosen, load_watchable_experiments, parse_overrides
from slurm.planning.plan import Plan, build_plan
from slurm.planning.request import LaunchRequest, gpus_here
from slurm.planning.validation import LoadedExperiment
from slurm.watching.render import err, out, warning

# A config folder as loaded (slurm/planning/experiments.py load_watchable_experiments): its experiments,
# the problems of the others, every name its files give, the files that did not load whole.
FolderLoad = tuple[list[LoadedExperiment], list[Problem], set[str], set[Path]]


@dataclass(frozen=True)
class Watched:
    experiments: list[LoadedExperiment]
    warnings: list[Problem]  # files that do not load, unknown --exp names (file "command line")
    gone: list[str]  # experiments the run root holds that no config folder loads any more
    folders: dict[str, Path]  # experiment name → the config folder it was loaded from


def watched_experiments(
    run_root: Path,
    config_dir: Path,
    config_dir_named: bool,
    overrides: dict | None = None,
    names: list[str] | None = None,
    loaded_already: dict[Path, FolderLoad] | None = None,
) -> Watched:
    """With `config_dir_named`, that folder's experiments (those not run yet too); without, every
    experiment the run root holds, each from the folder it was launched from (one launched before origins
    were recorded: from `config_dir`, if it has it). `names` (--exp) narrows either. `loaded_already`: the
    folders a caller loaded (a launch, its own), read from there instead of loaded again."""
    held = run_root_experiments(run_root)
    already = loaded_already or {}
    here = config_dir.resolve()
    if config_dir_named:
        folders = [here]
    else:
        recorded = [origin.config_dir for origin in held.values() if origin is not None]
        folders = list(dict.fromkeys([*recorded, *([here] if None in held.values() else [])]))
    loaded: list[LoadedExperiment] = []
    warnings: list[Problem] = []
    came_from: dict[str, Path] = {}
    written: set[str] = set()  # names files give, loaded or not: a broken one has its own warning
    unsure: set[Path] = set()  # files that did not load whole: what was launched from them is not gone
    for folder in folders:
        if not folder.is_dir():
            continue  # its experiments are gone (below)
        found, problems, names_given, broken = already.get(folder) or load_watchable_experiments(
            folder, overrides, frozenset(held)
        )
        warnings += problems
        written |= names_given
        unsure |= broken
        for experiment in found:
            if config_dir_named or launched_from(held.get(experiment.name, False), folder, here):
                loaded.append(experiment)
                came_from[experiment.name] = folder
    if here not in folders and here.is_dir():  # what the folder looked at has is never gone
        names_here, broken_here = present_in(here, overrides, frozenset(held), already.get(here))
        written |= names_here
        unsure |= broken_here
    known = {e.name for e in loaded}
    # Gone: launched from a recorded folder that no longer has it, and no folder looked at has it either.
    # One without a record (launched before origins were kept, perhaps from another folder) is never
    # called gone, nor one launched from a file that does not load now: --cancel --removed acts on them.
    gone = (
        []
        if config_dir_named
        else [
            n
            for n, o in held.items()
            if o and n not in written and n not in known and not launched_from_any(o, unsure)
        ]
    )
    where = config_dir if config_dir_named else run_root
    for name in dict.fromkeys(names or []):
        if name not in known and name not in written:
            warnings.append(unknown_name(name, known, gone, where))
    selected = [e for e in loaded if chosen(e, names)]
    return Watched(selected, warnings, [n for n in gone if not names or n in names], came_from)


def launched_from(origin: Origin | None | bool, folder: Path, default: Path) -> bool:
    """Whether the run root's experiment (`False`: the run root has none of that name) came from `folder`."""
    if origin is False:
        return False
    if origin is None:  # no record: the default folder's experiment of that name
        return folder == default
    return same_path(origin.config_dir, folder)


def same_path(a: Path, b: Path) -> bool:
    """One file or folder, whatever the spelling: resolved, or the same inode (a shared filesystem mounted
    under another name)."""
    if Path(a).resolve() == Path(b).resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them is not there
        return False


def launched_from_any(origin: Origin, files: set[Path]) -> bool:
    return any(same_path(origin.file, file) for file in files)


def present_in(
    config_dir: Path,
    overrides: dict | None,
    held: frozenset[str] = frozenset(),
    loaded: FolderLoad | None = None,
) -> tuple[set[str], set[Path]]:
    """The experiments `config_dir` has (a sweep's points by name), the names its files give, and the files
    that do not load whole; from `loaded` when the caller has the folder loaded already."""
    found, _, names, broken = loaded or load_watchable_experiments(config_dir, overrides, held)
    return {e.name for e in found} | names, broken


def unknown_name(name: str, known: set[str], gone: list[str], where: Path) -> Problem:
    if name in gone:
        message = f"'{name}' has a run folder in {where}/, but no config folder has it any more"
    else:
        message = f"no experiment named '{name}' in {where}/" + did_you_mean(name, known)
    return replace(Problem("command line", "--exp", message), warning=True)


def removed_from(run_root: Path, config_dir: Path, names: set[str], broken: set[Path]) -> list[str]:
    """Experiments the run root holds that were launched from `config_dir` and that it no longer has (a
    file deleted, a point dropped from a sweep): a launch of that folder lists them, and leaves them be.
    `names`: every experiment name the folder gives, loaded or not; `broken`: its files that did not load
    whole (what they stand for is unknown). The caller loaded the folder already (a launch: once)."""
    here = config_dir.resolve()
    held = run_root_experiments(run_root)
    launched = [
        name for name, origin in held.items() if origin is not None and same_path(origin.config_dir, here)
    ]
    return [name for name in launched if name not in names and not launched_from_any(held[name], broken)]


def removed_text(names: list[str], run_root: Path) -> str:
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return (
        f"{run_root}/ also holds {len(names)} experiment(s) launched from this folder that it no longer has "
        f"(no longer in any config): {shown}; left as they are (`--cancel --removed` cancels their live jobs)"
    )


def watched_plan(request: LaunchRequest, profile) -> tuple[Watched, Plan] | None:
    """The watched experiments and their plan; None (said so) when the run root holds nothing to show."""
    watched = warned(request, profile)
    plan = build_plan(watched.experiments, profile, gpus_here=gpus_here(request.backend))
    unknown = any(p.file == "command line" for p in watched.warnings)
    if not plan.jobs and not watched.gone and not unknown:
        out.print(
            f"Nothing has been launched under {profile.run_dir}/ yet: `--dry-run --all` shows what would run, "
            "and --config-dir picks another folder of experiments.",
            highlight=False,
        )
        return None
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
        err.print(warning(f"{problem}{skipped}"), highlight=False, soft_wrap=True)
    return watched


def watched_of(
    request: LaunchRequest,
    profile,
    names,
    named: bool | None = None,
    loaded: dict[Path, FolderLoad] | None = None,
) -> Watched:
    """`named` (default: whether --config-dir was given) looks at that folder alone, else at every folder
    the run root's experiments came from; `loaded`: folders the caller loaded already."""
    overrides = parse_overrides(list(request.overrides))
    named = request.config_dir_named if named is None else named
    return watched_experiments(Path(profile.run_dir), request.config_dir, named, overrides, names, loaded)
