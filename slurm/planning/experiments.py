"""Experiment YAMLs → validated experiments, or every problem in every file at once.

A file is `inherits:` + changes; `key=value` overrides from the command line apply last. Nothing here
imports torch: this runs on the login node before anything is queued.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import yaml
from pydantic import BaseModel, ValidationError

from core import chat_templates
from core.config import DataSpec, Experiment, StageSpec, TrainSpec, kind_mismatch
from core.conversations import no_template_message, templated
from core.databases import NotADatabaseError, check_database
from core.examples import ExampleError, TextSize, check_file, needed_fields
from core.files import read_json
from core.names import PREFERENCE, REPORT_COLUMNS, SCORES_OF
from core.problems import ConfigError, Problem, did_you_mean
from core.rundir import run_root_experiments
from core.sweep import Sweep, SweepError, SweepMember, SweepSpec, expand, nested, source_of
from core.yamlfile import (
    COMMAND_LINE,
    YamlFile,
    YamlProblem,
    command_line_files,
    deep_merge,
    load_bounded,
    load_chain,
    where,
)
from slurm.cluster.profile import ClusterProfile

# Sections whose keys a "did you mean" can suggest from, by their place in the file; `sweep:` is validated on
# its own, before its points are (core/sweep.py).
SECTIONS: dict[str, type[BaseModel]] = {
    name: info.annotation
    for name, info in Experiment.model_fields.items()
    if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)
} | {"sweep": SweepSpec}


@dataclass(frozen=True)
class Stage:
    """One stage, its data and train sections resolved (experiment values + the stage's changes)."""

    name: str
    data: DataSpec
    train: TrainSpec


@dataclass(frozen=True)
class LoadedExperiment:
    experiment: Experiment
    file: Path
    stages: tuple[Stage, ...]
    sweep: SweepMember | None = None  # a point of the file's `sweep:` block

    @property
    def name(self) -> str:
        return self.experiment.name


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
    or not), and the files that did not load whole."""

    experiments: list[LoadedExperiment]
    warnings: list[Problem]
    names: set[str]
    broken: set[Path]


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
    return Selection([e for e in loaded if chosen(e, names)], warnings, given, broken)


def checked(
    experiment: Experiment,
    raw: dict,
    chain: list[YamlFile],
    member: SweepMember | None,
    profile: ClusterProfile,
) -> tuple[list[Stage], list[Problem]]:
    """A valid experiment's stages, and what the checks beyond its schema find."""
    stages, found = resolve_stages(experiment, raw, chain)
    return stages, found + (
        check_files(experiment, stages, chain)
        + check_resources(experiment, profile, chain)
        + check_auto_time(experiment, stages, chain)
        + check_select(experiment, member, chain)
        + check_prune(experiment, stages, member, chain)
        + check_kind(experiment, chain)
        + check_chat_template(experiment, stages, chain)
        + check_preference(experiment, stages, chain)
    )


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


def expanded(
    raw: dict, chain: list[YamlFile], held: frozenset[str] = frozenset()
) -> tuple[list[tuple[dict, list[YamlFile], SweepMember | None]], list[Problem]]:
    """An experiment file's config → the experiments it stands for: itself, or one per point of its
    `sweep:` block (core/sweep.py), each the config with the point's values merged in, named
    EXP-SUFFIX; a point's value is blamed on the line of the sweep that gave it. `held`: the experiments
    the run root holds: a point launched under the name it had before names were stable keeps it."""
    block = raw.get("sweep")
    if block is None:
        return [(raw, chain, None)], []
    name = str(raw.get("name"))
    try:
        sweep = expand(block, name)
    except SweepError as exc:
        return [], [to_problem(error, chain, ("sweep",)) for error in one_per_value(exc.errors)]
    base = {key: value for key, value in raw.items() if key != "sweep"}
    points = []
    for point in sweep.points:
        given = [
            YamlFile(Path(file), nested({key: value}), {tuple(key.split(".")): line})
            for key, value in point.values.items()
            for file, line in [where(chain, ("sweep", *source_of(block, key, point.seed is not None)))]
        ]
        values = {k: v for k, v in point.values.items() if k in sweep.swept}
        member = SweepMember(
            name, point.point, values, point.seed, sweep.swept, sweep.select, sweep.prune, len(sweep.points)
        )
        config = deep_merge(base, nested(point.values)) | {"name": point_name(name, point, held)}
        points.append((config, [*given, *chain], member))
    return points, never_pruned(sweep, chain)


def never_pruned(sweep: Sweep, chain: list[YamlFile]) -> list[Problem]:
    """A warning when the sweep has fewer runs than prune.min_points: no rung ever holds enough losses to
    judge by, so nothing is stopped (before: nothing said so, and the sweep simply never pruned)."""
    if sweep.prune is None or len(sweep.points) >= sweep.prune.min_points:
        return []
    message = (
        f"this sweep has {len(sweep.points)} run(s), fewer than prune.min_points {sweep.prune.min_points}: "
        "a rung judges once that many losses are recorded, so no run will ever be stopped; lower min_points "
        "or add points"
    )
    return [replace(sweep_problem(chain, ("prune",), message), warning=True)]


def point_name(sweep: str, point, held: frozenset[str]) -> str:
    """EXP-SUFFIX; the point's old name where the run root holds a folder of that name and none of the new
    (the point was launched before names were stable: its finished stages stay finished)."""
    name, old = f"{sweep}-{point.suffix}", point.legacy and f"{sweep}-{point.legacy}"
    return old if old and old != name and old in held and name not in held else name


def same_runs(loaded: list[LoadedExperiment]) -> list[Problem]:
    """Two points of one sweep that are one run once validated (1e-4 and 1.0e-4 are one number, 8 and 8.0
    one rank; a random choice drawn twice): they would train the same thing twice under two names."""
    first: dict[tuple, LoadedExperiment] = {}
    found = []
    for item in loaded:
        if item.sweep is None:
            continue
        key = (
            item.sweep.sweep,
            json.dumps(item.experiment.model_dump(exclude={"name"}), sort_keys=True, default=str),
        )
        if key not in first:
            first[key] = item
            continue
        earlier = first[key]
        found.append(
            Problem(
                str(item.file),
                "sweep",
                f"points {earlier.name} and {item.name} are the same run once their values are read "
                f"({earlier.sweep.values} and {item.sweep.values}): list each value once",
            )
        )
    return found


def check_kind(experiment: Experiment, chain: list[YamlFile]) -> list[Problem]:
    """model.kind against a local model folder's config.json (a hub model's: at preflight, which has it)."""
    config_json = Path(experiment.model.name_or_path) / "config.json"
    if not config_json.is_file():
        return []
    model_config = read_json(config_json, {}, expected=dict)
    why = kind_mismatch(experiment.model.kind, model_config)
    if why is None:
        return []
    file, line = where(chain, ("model", "kind"))
    return [Problem(file, "model.kind", why, line)]


def check_chat_template(experiment: Experiment, stages: list[Stage], chain: list[YamlFile]) -> list[Problem]:
    """Conversations need a chat template: the model folder's own, or data.chat_template (a hub model's is
    known on the node, where a missing one is refused the same way)."""
    name = experiment.model.name_or_path
    lacking = [
        stage
        for stage in stages
        if templated(stage.data, experiment.model.kind) and stage.data.chat_template is None
    ]
    if lacking and chat_templates.folder_has_template(Path(name)) is False:
        file, line = where(chain, ("data", "format"))
        return [Problem(file, "data.format", no_template_message(name, lacking[0].data.format), line)]
    return unknown_markers(experiment, stages, chain)


def unknown_markers(experiment: Experiment, stages: list[Stage], chain: list[YamlFile]) -> list[Problem]:
    """A data.chat_template's markers that a local model folder's vocabulary lacks and model.added_tokens
    does not add (a hub model's vocabulary is known to preflight, which refuses the same)."""
    vocabulary = chat_templates.folder_vocabulary(Path(experiment.model.name_or_path))
    if vocabulary is None:
        return []
    for stage in stages:
        if stage.data.chat_template is None or not templated(stage.data, experiment.model.kind):
            continue
        markers = chat_templates.markers(chat_templates.text(stage.data.chat_template))
        if missing := [m for m in markers if m not in vocabulary and m not in experiment.model.added_tokens]:
            file, line = where(chain, ("data", "chat_template"))
            message = (
                f"its markers {missing} are not tokens of {experiment.model.name_or_path}'s vocabulary: add "
                f"them with model.added_tokens: {missing} (else each is learnt as several pieces and "
                "generation has no end-of-turn token to stop at)"
            )
            return [Problem(file, "data.chat_template", message, line)]
    return []


def check_preference(experiment: Experiment, stages: list[Stage], chain: list[YamlFile]) -> list[Problem]:
    """A DPO stage's chain, before anything is queued: preference pairs for it and only for it, a model
    kind TRL's DPOTrainer trains here, and a `reference: previous` that has a previous stage."""
    problems = []
    for index, stage in enumerate(stages):
        dpo, pairs = stage.train.method == "dpo", stage.data.format == PREFERENCE
        why = None
        if dpo and not pairs:
            key = ("train", "method")
            why = (
                f"is dpo in stage {stage.name!r}, whose data is format: {stage.data.format}; DPO trains on "
                "preference pairs: set data.format: preference ({prompt, chosen, rejected} per line)"
            )
        elif pairs and not dpo:
            key = ("data", "format")
            why = (
                f"is preference in stage {stage.name!r}, an SFT stage (train.method: sft): pairs train only a "
                "DPO stage: set train.method: dpo in that stage, or give it SFT data"
            )
        elif dpo and experiment.model.kind != "causal":
            key = ("train", "method")
            why = (
                f"is dpo, but model.kind is {experiment.model.kind}: TRL's DPOTrainer trains causal models only "
                "here (it has no seq2seq path; image-text pairs are not supported yet): use a causal model"
            )
        elif dpo and index == 0 and stage.train.preference.reference == "previous":
            key = ("train", "dpo", "reference")
            why = (
                f"is previous, but stage {stage.name!r} is the first: there is no previous adapter to "
                "compare against; use reference: base (the default for a first stage), or put an SFT stage "
                "before it"
            )
        if why:
            written = getattr(experiment.stages[index], key[0])
            place = ("stages", index, *key) if key[1] in written else key
            file, line = where(chain, place)
            problems.append(Problem(file, ".".join(map(str, place)), why, line))
    return problems


def check_select(experiment: Experiment, member: SweepMember | None, chain: list[YamlFile]) -> list[Problem]:
    """A sweep's `select.metric` must be a score its eval computes (or eval_loss): else the report would
    say "none yet" for ever."""
    if member is None or member.select is None:
        return []
    scores = [score for metric in experiment.eval.metrics for score in SCORES_OF[metric]]
    known = ["eval_loss", *scores, *(REPORT_COLUMNS[score] for score in scores)]
    if member.select.metric in known:
        return []
    names = ", ".join(dict.fromkeys(known))
    message = (
        f"{member.select.metric!r} is not a score this sweep's eval computes (eval.metrics "
        f"{list(experiment.eval.metrics)} give: {names}): select on one of them, or add its metric to "
        "eval.metrics"
    )
    return [sweep_problem(chain, ("select", "metric"), message)]


def check_prune(
    experiment: Experiment, stages: list[Stage], member: SweepMember | None, chain: list[YamlFile]
) -> list[Problem]:
    """A sweep's `prune:` judges each run's in-training eval_loss at its rungs (core/pruning.py): the only
    score every run has there. So it needs eval data and eval_every_epochs, rungs on eval epochs below the
    last epoch, and one stage (a later stage's rungs would judge runs that started from different
    adapters)."""
    if member is None or member.prune is None:
        return []
    block: list[tuple[str, str]] = []  # problems with the block as a whole, at its line
    if len(stages) > 1:
        names = ", ".join(stage.name for stage in stages)
        block.append(("prune", f"prunes single-stage sweeps only for now; this one has stages {names}"))
    train, data = stages[0].train, stages[0].data
    if not data.eval:
        block.append(("prune", "needs data.eval: runs are judged on their in-training eval_loss"))
    if train.eval_every_epochs is None:
        block.append(("prune", "needs train.eval_every_epochs: a run is judged at an in-training eval"))
    if train.max_steps is not None:
        block.append(("prune", "judges at epochs, and train.max_steps overrides epochs: remove max_steps"))
    for rung in member.prune.rungs:
        if train.eval_every_epochs and not is_multiple(rung, train.eval_every_epochs):
            block.append(
                (
                    "prune.rungs",
                    f"rung {rung:g} is not a multiple of train.eval_every_epochs {train.eval_every_epochs:g}: "
                    "a run is judged at an in-training eval",
                )
            )
        if rung >= train.epochs:
            message = (
                f"rung {rung:g} is not below train.epochs {train.epochs:g}: a run stopped there saves nothing"
            )
            block.append(("prune.rungs", message))
    return [sweep_problem(chain, tuple(key.split(".")), message) for key, message in block]


def is_multiple(value: float, step: float) -> bool:
    ratio = value / step
    return abs(ratio - round(ratio)) < 1e-6 and round(ratio) >= 1


def sweep_problem(chain: list[YamlFile], path: tuple, message: str) -> Problem:
    file, line = where(chain, ("sweep", *path))
    return Problem(file, ".".join(map(str, ("sweep", *path))), message, line)


def of_point(problems: list[Problem], member: SweepMember | None) -> list[Problem]:
    """A problem with a swept value names the point; the others are the same for every point (one
    problem, not one per point)."""
    if member is None:
        return problems
    swept = [*member.values, *(["train.seed"] if member.seed is not None else [])]
    return [
        replace(p, message=f"{p.message} (sweep point {member.sweep}-{member.point or 's'})")
        if any(p.key == key or p.key.startswith(key + ".") for key in swept)
        else p
        for p in problems
    ]


def after_whole_sweeps(loaded: list[LoadedExperiment]) -> list[LoadedExperiment]:
    """`after: [SWEEP]` waits for every point of that sweep."""
    points: dict[str, list[str]] = {}
    for item in loaded:
        if item.sweep is not None:
            points.setdefault(item.sweep.sweep, []).append(item.name)
    if not points:
        return loaded
    return [
        replace(
            item,
            experiment=item.experiment.model_copy(
                update={"after": [n for t in item.experiment.after for n in points.get(t, [t])]}
            ),
        )
        if any(t in points for t in item.experiment.after)
        else item
        for item in loaded
    ]


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


def validate_experiment(raw: dict, chain: list[YamlFile]) -> tuple[Experiment | None, list[Problem]]:
    try:
        return Experiment.model_validate(raw), []
    except ValidationError as exc:
        return None, [to_problem(error, chain) for error in one_per_value(exc.errors())]


# How pydantic names the member of a union (`int | Literal['auto']`) a failed check belongs to, at the end
# of an error's place: `literal['auto']`, `function-after[...]`, `int`, `list[str]`, a model's name.
UNION_MEMBER = re.compile(r"(literal|function-\w+|list|dict|tuple|set)\[.*|int|float|str|bool|none|[A-Z]\w*")


def one_per_value(errors: list[dict]) -> list[dict]:
    """pydantic's errors with a union's members folded into one error per value: `micro_batch: eight` is one
    problem ("should be 'auto' or a valid integer"), not one per type it could have been. A member's own
    message (a value_error, e.g. "true is a yes/no") says more than the others' "should be", and wins."""
    folded: dict[tuple, list[dict]] = {}
    for error in errors:
        loc = tuple(error["loc"])
        while loc and isinstance(loc[-1], str) and UNION_MEMBER.fullmatch(loc[-1]):
            loc = loc[:-1]
        folded.setdefault(loc, []).append({**error, "loc": loc})
    return [merged(group) for group in folded.values()]


def merged(group: list[dict]) -> dict:
    if len(group) == 1:
        return group[0]
    own = [error for error in group if error["type"] in ("value_error", "assertion_error")]
    if own:
        return own[0]
    wants = [error["msg"].removeprefix("Input should be ") for error in group]
    return {**group[-1], "msg": "Input should be " + " or ".join(dict.fromkeys(wants))}


def to_problem(error: dict, chain: list[YamlFile], prefix: tuple = ()) -> Problem:
    key = (*prefix, *error["loc"])
    file, line = where(chain, key)
    kind, message = error["type"], error["msg"].removeprefix("Value error, ")
    if kind == "extra_forbidden":
        message = "unknown key" + (
            NOT_A_KEY.get(str(key[-1])) or did_you_mean(str(key[-1]), known_keys(key[:-1]))
        )
    elif kind == "missing":
        message = "is required but missing"
    elif kind == "literal_error" and isinstance(error.get("input"), str):
        choices = re.findall(r"'([^']*)'", str(error.get("ctx", {}).get("expected", "")))
        message = f"{message} (got {error['input']!r}){did_you_mean(error['input'], choices)}"
    elif kind == "finite_number":
        message = f"must be a finite number, not {error['input']!r} (YAML reads .inf and .nan as numbers)"
    elif "input" in error and kind not in ("value_error", "assertion_error"):
        message = f"{message} (got {error['input']!r})"
    return Problem(file, ".".join(map(str, key)), message, line)


# Keys people reach for that the schema has no place for, and why.
NOT_A_KEY = {
    "init_from": (
        ": a stage always starts from the adapter of the stage before it (the first from the base model), "
        "so there is nothing to set; to start from another experiment's adapter, make its stages this "
        "experiment's first ones"
    ),
}


def known_keys(section: tuple) -> list[str]:
    if not section:
        return list(Experiment.model_fields)
    model = SECTIONS.get(section[0])
    if section[0] == "stages":
        model = StageSpec if len(section) == 2 else SECTIONS.get(section[2]) if len(section) >= 3 else None
    for part in section[1 if section[0] != "stages" else 3 :]:
        field = model.model_fields.get(part) if model else None
        annotation = getattr(field, "annotation", None)
        model = next((a for a in getattr(annotation, "__args__", (annotation,)) if _is_model(a)), None)
    return list(model.model_fields) if model else []


def _is_model(value) -> bool:
    return isinstance(value, type) and issubclass(value, BaseModel)


def resolve_stages(
    experiment: Experiment, raw: dict, chain: list[YamlFile]
) -> tuple[list[Stage], list[Problem]]:
    """Each stage = the experiment's data/train plus the stage's own changes, validated in full."""
    stages, problems = [], []
    for index, stage in enumerate(experiment.stages):
        specs = {}
        for section, model in (("data", DataSpec), ("train", TrainSpec)):
            merged = deep_merge(raw.get(section) or {}, getattr(stage, section))
            try:
                specs[section] = model.model_validate(merged)
            except ValidationError as exc:
                for error in one_per_value(exc.errors()):
                    # A mistake in the experiment's own section was reported already; report the stage's.
                    if error["loc"] and error["loc"][0] in getattr(stage, section):
                        problems.append(to_problem(error, chain, ("stages", index, section)))
        if len(specs) == 2:
            if specs["train"].early_stopping and not specs["data"].eval:
                file, line = where(chain, ("train", "early_stopping"))
                problems.append(
                    Problem(
                        file,
                        "train.early_stopping",
                        f"stops on the eval loss, but stage {stage.name!r} has no data.eval; "
                        "add data.eval or remove early_stopping",
                        line,
                    )
                )
            stages.append(Stage(stage.name, specs["data"], specs["train"]))
    return stages, problems + check_eval_split(experiment, stages, chain)


def check_eval_split(experiment: Experiment, stages: list[Stage], chain: list[YamlFile]) -> list[Problem]:
    """An evaluated stage needs data.eval, unless eval.split: train says to score on the training data:
    scores on the training data must never pass for eval scores."""
    spec = experiment.eval
    if not spec.metrics or spec.split != "eval" or len(stages) != len(experiment.stages):
        return []
    evaluated = stages if spec.after_each_stage else stages[-1:]
    missing = [stage.name for stage in evaluated if not stage.data.eval]
    if not missing:
        return []
    file, line = where(chain, ("data", "eval"))
    what = f"the eval job scores stage(s) {missing}, which have no data.eval"
    hint = "add data.eval, or set `eval.split: train` to knowingly score on the training data"
    return [Problem(file, "data.eval", f"{what}; {hint}", line)]


def check_files(experiment: Experiment, stages: list[Stage], chain: list[YamlFile]) -> list[Problem]:
    """Local data files, eval databases and model folders must exist; hub names are checked on the node."""
    wanted: list[tuple[tuple, str, DataSpec | None]] = []
    for index, stage in enumerate(stages):
        for key in ("train", "eval"):
            written_in_stage = key in experiment.stages[index].data
            place = ("stages", index, "data", key) if written_in_stage else ("data", key)
            wanted.append((place, getattr(stage.data, key), stage.data))
    wanted.append((("eval", "db"), experiment.eval.db, None))
    problems, seen = [], set()
    for key, value, spec in wanted:
        if value and not value.startswith("hf:") and value not in seen:
            seen.add(value)
            file, line = where(chain, key)
            if not Path(value).is_file():
                problems.append(Problem(file, ".".join(map(str, key)), f"file not found: {value}", line))
            elif spec is not None:
                problems += check_examples(Path(value), spec, ".".join(map(str, key)))
            elif key == ("eval", "db"):
                problems += unusable_db(value, file, line)
    problems += missing_model_folder(("model", "name_or_path"), experiment.model.name_or_path, chain)
    if "bertscore" in experiment.eval.metrics:
        problems += missing_model_folder(("eval", "bertscore_model"), experiment.eval.bertscore_model, chain)
    return problems


def unusable_db(path: str, file: str, line: int | None) -> list[Problem]:
    """eval.db must be SQLite with tables: on an empty file every gold query fails and nothing is scored."""
    try:
        check_database(path)
    except (NotADatabaseError, OSError) as exc:
        return [Problem(file, "eval.db", str(exc), line)]
    return []


def missing_model_folder(key: tuple, name: str, chain: list[YamlFile]) -> list[Problem]:
    """A name that looks like a local path must be a folder; hub ids are checked on the node."""
    if not _looks_local(name) or Path(name).is_dir():
        return []
    file, line = where(chain, key)
    hint = " (the demo's tiny models are built by `python -m demo.tiny models`)" if "tiny" in name else ""
    return [Problem(file, ".".join(key), f"local model folder not found: {name}{hint}", line)]


_read: dict[tuple, TextSize | ExampleError | OSError | UnicodeDecodeError] = {}


def read_examples(path: Path, spec: DataSpec) -> TextSize | ExampleError | OSError | UnicodeDecodeError:
    """A data file's size, or its first problem. Each file is read once per command, however many
    experiments share it and whether validation or the estimates ask first."""
    try:
        stat = path.stat()
        fields = (spec.format, spec.prompt_template, *needed_fields(spec))  # the template's text counts too
        version = (str(path.resolve()), stat.st_mtime_ns, stat.st_size, fields)
        if version not in _read:
            _read[version] = _read_once(path, spec)
        return _read[version]
    except OSError as exc:
        return exc


def check_examples(path: Path, spec: DataSpec, key: str) -> list[Problem]:
    """Malformed lines, missing fields and empty files are found now, not hours later on a node."""
    found = read_examples(path, spec)
    if isinstance(found, ExampleError):
        return [Problem(e.path, "", f"{e.message} (used as {key})", e.line) for e in found.errors]
    if not isinstance(found, TextSize):
        return [Problem(str(path), "", f"cannot be read ({found})")]
    return []


def _read_once(path: Path, spec: DataSpec) -> TextSize | ExampleError | OSError | UnicodeDecodeError:
    try:
        return check_file(path, spec)
    except (ExampleError, OSError, UnicodeDecodeError) as exc:
        return exc


def _looks_local(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or Path(name).is_dir()


def check_resources(experiment: Experiment, profile: ClusterProfile, chain: list[YamlFile]) -> list[Problem]:
    # The eval job's own values only: what it leaves out is the training job's, checked once.
    return (
        over_node_limits(("resources",), experiment.resources, profile, chain)
        + over_node_limits(("eval", "resources"), experiment.eval.resources, profile, chain)
        + beyond_one_node(("resources",), experiment.resources, profile, chain)
        + beyond_one_node(("eval", "resources"), experiment.eval.resources, profile, chain)
        + eval_on_one_gpu(experiment, chain)
    )


def check_auto_time(experiment: Experiment, stages: list[Stage], chain: list[YamlFile]) -> list[Problem]:
    """`time: auto` is the job's estimate plus a margin, and an estimate counts a local data file: an
    `hf:` dataset is only fetched on the node."""
    sources = {
        ("resources", "time"): [s.data.train for s in stages],
        ("eval", "resources", "time"): [
            s.data.eval if experiment.eval.split == "eval" else s.data.train for s in stages
        ],
    }
    problems = []
    for key, used in sources.items():
        section = experiment.resources if key[0] == "resources" else experiment.eval.resources
        remote = sorted({source for source in used if source and source.startswith("hf:")})
        if section.time == "auto" and remote:
            file, line = where(chain, key)
            message = (
                f"auto needs a local data file to estimate from, but {remote[0]} is fetched on the node; "
                "write a time (HH:MM:SS)"
            )
            problems.append(Problem(file, ".".join(key), message, line))
    return problems


def beyond_one_node(section: tuple, res, profile: ClusterProfile, chain: list[YamlFile]) -> list[Problem]:
    """A training job may span nodes (one task per GPU on each, one DDP run), up to cluster.yaml's
    max_nodes when it says; an eval job is one process on one GPU, so several nodes would sit idle."""
    if res.nodes <= 1:
        return []
    file, line = where(chain, (*section, "nodes"))
    if section != ("resources",):
        message = (
            f"asks for {res.nodes} nodes but an eval job runs one process on one GPU of one node; "
            "leave eval.resources.nodes out"
        )
    elif profile.max_nodes is not None and res.nodes > profile.max_nodes:
        message = (
            f"asks for {res.nodes} nodes but this cluster has {profile.max_nodes} (configs/cluster.yaml "
            f"max_nodes); ask {profile.max_nodes} or fewer, or more GPUs per node (resources.gpus, up to "
            f"{profile.max_gpus_per_node})"
        )
    else:
        return []
    return [Problem(file, ".".join((*section, "nodes")), message, line)]


def eval_on_one_gpu(experiment: Experiment, chain: list[YamlFile]) -> list[Problem]:
    """Generation and scoring run as one process: more GPUs would sit idle in the queue and on the node."""
    gpus = experiment.eval.resources.gpus
    if gpus is None or gpus <= 1:
        return []
    file, line = where(chain, ("eval", "resources", "gpus"))
    message = f"asks for {gpus} GPUs but an eval job runs one process on one GPU; use 0 or 1"
    return [Problem(file, "eval.resources.gpus", message, line)]


def over_node_limits(section: tuple, res, profile: ClusterProfile, chain: list[YamlFile]) -> list[Problem]:
    problems = []
    limits = [
        ("gpus", res.gpus, profile.max_gpus_per_node, "GPUs"),
        ("cpus", res.cpus, profile.max_cpus_per_node, "CPUs"),
        ("mem_gb", res.mem_gb, profile.max_mem_gb_per_node, "GB of memory"),
    ]
    for key, asked, limit, unit in limits:
        if asked is not None and asked > limit:
            file, line = where(chain, (*section, key))
            message = (
                f"asks for {asked:g} {unit} but a node of this cluster has {limit:g} (configs/cluster.yaml)"
            )
            problems.append(Problem(file, ".".join((*section, key)), message, line))
    return problems


def check_names(
    loaded: list[LoadedExperiment], selected: list[str] | None, written: set[str] = frozenset()
) -> list[Problem]:
    """Duplicate names, unknown `after:` targets, cycles, unknown --exp names (`written`: every name a
    file gives; one that did not load has its own problem, and is no unknown name)."""
    problems: list[Problem] = []
    by_name: dict[str, LoadedExperiment] = {}
    for item in loaded:
        if item.name in by_name:
            other = by_name[item.name].file
            problems.append(Problem(str(item.file), "name", f"'{item.name}' is also the name in {other}"))
        by_name[item.name] = item
    sweeps: dict[str, Path] = {}
    for item in loaded:
        if item.sweep is not None and sweeps.setdefault(item.sweep.sweep, item.file) != item.file:
            first = sweeps[item.sweep.sweep]
            message = (
                f"the sweep '{item.sweep.sweep}' is also defined in {first}: its points, --exp "
                f"{item.sweep.sweep} and the report's table would mix both; rename one"
            )
            problems.append(Problem(str(item.file), "name", message))
    for name in sweeps.keys() & by_name.keys():  # --exp and after: would mean both
        message = f"'{name}' is also a sweep's name (in {sweeps[name]}): --exp {name} would mean both"
        problems.append(Problem(str(by_name[name].file), "name", message))
    for item in loaded:
        for target in item.experiment.after:
            if target not in by_name:
                message = f"unknown experiment '{target}'" + did_you_mean(target, by_name)
                problems.append(Problem(str(item.file), "after", message))
    cycle = find_cycle({n: [t for t in e.experiment.after if t in by_name] for n, e in by_name.items()})
    if cycle:
        problems.append(
            Problem(
                str(by_name[cycle[0]].file), "after", "experiments wait on each other: " + " -> ".join(cycle)
            )
        )
    for name in selected or []:
        if name not in by_name and name not in written:
            problems.append(
                Problem(
                    "command line", "--exp", f"no experiment named '{name}'" + did_you_mean(name, by_name)
                )
            )
    return problems


def sweeps_named_as_others(
    loaded: list[LoadedExperiment], held: dict, config_dir: Path, run_root: Path
) -> list[Problem]:
    """A sweep named as an experiment the run root holds from another config folder: --exp, --cancel and
    the report would take one for the other."""
    here = config_dir.resolve()
    problems = []
    for name, file in {e.sweep.sweep: e.file for e in loaded if e.sweep is not None}.items():
        origin = held.get(name)
        if origin is not None and Path(origin.config_dir).resolve() != here:
            message = (
                f"the sweep '{name}' has the name of an experiment {run_root}/ holds from "
                f"{origin.file}: --exp {name} would mean both; rename the sweep"
            )
            problems.append(Problem(str(file), "name", message))
    return problems


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """A dependency loop as a path that returns to its start, or None."""
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None
