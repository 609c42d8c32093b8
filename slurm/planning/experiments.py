"""Experiment YAMLs → validated experiments, or every problem in every file at once.

A file is `inherits:` + changes; `key=value` overrides from the command line apply last. This is the loader
(load_selected for a launch, load_watchable_experiments for --status and the like); one config is validated
in slurm/planning/validation.py, checked beyond its schema in slurm/planning/checks.py, and a `sweep:` block
is expanded into its points in slurm/planning/sweeps.py. Nothing here imports torch: this runs on the login
node before anything is queued.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import yaml

from core.problems import ConfigError, Problem
from core.rundir import run_root_experiments
from core.yamlfile import (
    COMMAND_LINE,
    YamlFile,
    YamlProblem,
    command_line_files,
    deep_merge,
    load_bounded,
    load_chain,
    read_yaml,
)
from slurm.cluster.profile import ClusterProfile
from slurm.planning.checks import check_names, checked
from slurm.planning.sweeps import after_whole_sweeps, expanded, of_point, same_runs, sweeps_named_as_others
from slurm.planning.validation import LoadedExperiment, resolve_stages, validate_experiment


def experiment_files(config_dir: Path) -> list[Path]:
    """Every `*.yaml` in the folder except shared fragments (`base.yaml`, `cluster.yaml`, `_*.yaml`)."""
    skip = {"base.yaml", "cluster.yaml", "baselines.yaml"}
    return sorted(
        p
        for p in config_dir.glob("*.y*ml")
        if p.suffix in (".yaml", ".yml") and p.name not in skip and not p.name.startswith("_")
    )


def parse_overrides(items: list[str]) -> dict:
    """`train.learning_rate=1e-4` → {"train": {"learning_rate": 1e-4}}; values are read as YAML."""
    merged: dict = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(
                [Problem("command line", item, "an override is KEY.PATH=VALUE, e.g. train.epochs=2")]
            )
        try:
            value = load_bounded(raw, COMMAND_LINE)[1]
        except yaml.YAMLError:
            value = raw
        except YamlProblem as exc:  # an alias bomb typed on the command line costs as much as one in a file
            raise ConfigError([replace(exc.problem, key=key, line=None)]) from None
        for part in reversed(key.split(".")):
            value = {part: value}
        merged = deep_merge(merged, value)
    return merged


def load_with_overrides(path: Path, config_dir: Path, overrides: dict | None) -> tuple[dict, list[YamlFile]]:
    """An experiment file merged with its `inherits:` chain, then with the command line's overrides, which
    join the chain so that a mistake in one is blamed on the command line."""
    raw, chain = load_chain(path, stop=config_dir.resolve().parent)
    if not overrides:
        return raw, chain
    keys, sections = command_line_files(overrides)
    return deep_merge(raw, overrides), [keys, *chain, sections]


def load_experiments(
    config_dir: Path, profile: ClusterProfile, overrides: dict | None = None, names: list[str] | None = None
) -> list[LoadedExperiment]:
    """load_selected's experiments, its warnings left out."""
    return load_selected(config_dir, profile, overrides, names).experiments


class Selection(NamedTuple):
    """What a launch loads of its folder, once: the experiments it selects, the problems of files they do
    not need (warnings), every experiment name the folder gives (each file's name, each sweep point's, loaded
    or not), the files that did not load whole, and every experiment that loaded (selected or not)."""

    experiments: list[LoadedExperiment]
    warnings: list[Problem]
    names: set[str]
    broken: set[Path]
    loaded: list[LoadedExperiment]

    def as_watched(self) -> tuple[list[LoadedExperiment], list[Problem], set[str], set[Path]]:
        """The folder as load_watchable_experiments gives it: watching a launched folder reads it from here."""
        return self.loaded, self.warnings, self.names, self.broken


def own_name(path: Path) -> str | None:
    """The `name:` a file writes itself, read without what it inherits; None if it writes none or is not
    YAML."""
    try:
        data = read_yaml(path).data
    except YamlProblem:
        return None
    name = data.get("name") if isinstance(data, dict) else None
    return str(name) if name is not None else None


def load_selected(
    config_dir: Path, profile: ClusterProfile, overrides: dict | None = None, names: list[str] | None = None
) -> Selection:
    """Load and check every experiment in `config_dir`: the experiments `names` selects (all without it)
    and the problems found in files they do not need, as warnings; raise ConfigError listing all problems.

    All files are checked even when `names` selects a few, so a broken neighbour is found now, not later;
    but a named experiment is judged on what it needs (its file and what that inherits, the experiments it
    waits on with `after:`), not held hostage by a sibling's malformed eval file. --all needs everything.
    """
    problems_of: dict[Path, list[Problem]] = {}  # each experiment file's problems, its fragments' included
    loaded: list[LoadedExperiment] = []
    written: dict[str, Path] = {}  # every name a file gives, valid or not
    files = experiment_files(config_dir)
    if not files:
        raise ConfigError([Problem(str(config_dir), "", "holds no experiment YAML files (*.yaml)")])
    held_from = run_root_experiments(Path(profile.run_dir))
    held = frozenset(held_from)
    for path in files:
        problems = problems_of.setdefault(path, [])
        try:
            raw, chain = load_with_overrides(path, config_dir, overrides)
        except YamlProblem as exc:
            problems.append(exc.problem)
            if (own := own_name(path)) is not None:  # so --exp names it, not "no experiment named"
                written[own] = path
            continue
        written[str(raw.get("name"))] = path
        points, found = expanded(raw, chain, held)
        problems += found
        for raw, chain, member in points:
            experiment, found = validate_experiment(raw, chain)
            problems += of_point(found, member)
            if experiment is not None:
                stages, found = checked(experiment, raw, chain, member, profile)
                problems += of_point(found, member)
                loaded.append(LoadedExperiment(experiment, path, tuple(stages), member))
    loaded = after_whole_sweeps(loaded)
    across = check_names(loaded, names, set(written)) + same_runs(loaded)
    across += sweeps_named_as_others(loaded, held_from, config_dir, Path(profile.run_dir))
    for problem in across:  # a check across files blames one file: it is that file's problem
        problems_of.setdefault(Path(problem.file), []).append(problem)
    errors, warnings = sorted_out(problems_of, needed_files(loaded, names, written), files)
    if errors:
        raise ConfigError(errors + warnings)
    broken = {path for path, found in problems_of.items() if any(not p.warning for p in found)}
    given = set(written) | {e.name for e in loaded}
    return Selection([e for e in loaded if chosen(e, names)], warnings, given, broken, loaded)


def sorted_out(
    problems_of: dict[Path, list[Problem]], needed: set[Path] | None, files: list[Path]
) -> tuple[list[Problem], list[Problem]]:
    """The errors (problems of the needed experiment files, and of no experiment file) and the warnings
    (problems of the others, marked skipped). A shared fragment's mistake that a needed file meets too is
    that file's error, and not also a warning."""
    counted = [
        (p, None if needed is None or path in needed or path not in files else path)
        for path, found in problems_of.items()
        for p in found
    ]
    errors = list(dict.fromkeys(p for p, skipped in counted if skipped is None and not p.warning))
    warnings = [
        p
        if skipped is None
        else replace(p, warning=True, message=f"{p.message} ({skipped.name}: not needed by --exp, skipped)")
        for p, skipped in dict.fromkeys(counted)
        if (skipped is None and p.warning)
        or (skipped is not None and replace(p, warning=False) not in errors)
    ]
    return errors, warnings


def needed_files(
    loaded: list[LoadedExperiment], names: list[str] | None, written: dict[str, Path]
) -> set[Path] | None:
    """The experiment files that launching `names` needs: theirs and those of the experiments they wait on
    (`after:`, transitively; a sweep's name stands for its points); None (every file) without names, or
    where a name in that chain is given by no file that loaded (it may be a file that did not parse)."""
    if not names:
        return None
    file_of = dict(written) | {e.name: e.file for e in loaded}
    points: dict[str, list[str]] = {}
    for item in loaded:
        if item.sweep is not None:
            points.setdefault(item.sweep.sweep, []).append(item.name)
    waits_on = {e.name: e.experiment.after for e in loaded}
    todo, seen = list(names), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        if name not in file_of and name not in points:
            return None
        seen.add(name)
        todo += waits_on.get(name, []) + points.get(name, [])
    return {file_of[name] for name in seen if name in file_of}


def chosen(loaded: LoadedExperiment, names: list[str] | None) -> bool:
    """--exp NAME: the experiment of that name, or every point of the sweep of that name."""
    return not names or loaded.name in names or (loaded.sweep is not None and loaded.sweep.sweep in names)


def load_watchable_experiments(
    config_dir: Path, overrides: dict | None = None, held: frozenset[str] = frozenset()
) -> tuple[list[LoadedExperiment], list[Problem], set[str], set[Path]]:
    """For --status, --tail, --cancel and --report (slurm/watching/watched.py): every experiment whose files parse
    and validate, the problems of the others as warnings, every name a file gives (loaded or not), and the
    files that did not load whole (what they stand for is unknown: a broken sweep file gives its name, never
    its points'). A broken neighbour must not stop anyone from watching or cancelling what runs; data files
    and resource limits are not checked (nothing is submitted)."""
    loaded, problems, written, broken = [], [], set(), set()
    for path in experiment_files(config_dir):
        try:
            raw, chain = load_with_overrides(path, config_dir, overrides)
        except YamlProblem as exc:
            problems.append(exc.problem)
            broken.add(path)
            continue
        written.add(str(raw.get("name")))
        points, found = expanded(raw, chain, held)
        problems += found
        broken |= {path} if any(not p.warning for p in found) else set()
        for raw, chain, member in points:
            experiment, found = validate_experiment(raw, chain)
            stages, more = resolve_stages(experiment, raw, chain) if experiment else ([], [])
            problems += of_point(found + more, member)
            if experiment is not None and not more:
                loaded.append(LoadedExperiment(experiment, path, tuple(stages), member))
            else:
                broken.add(path)
    # A broken fragment is one warning, not one per experiment file that inherits it.
    return (
        after_whole_sweeps(loaded),
        [replace(p, warning=True) for p in dict.fromkeys(problems) if not p.warning],
        written,
        broken,
    )
