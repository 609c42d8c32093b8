"""A file's `sweep:` block → the experiments it stands for, one per point (expanded; core/sweep.py computes
the points), and what is checked of a sweep: its `select:` metric, its `prune:` block, points that are one
run, a sweep named as another folder's experiment; `after: [SWEEP]` waits for every point
(after_whole_sweeps).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from core.config import Experiment
from core.names import PREFERENCE_SCORES, REPORT_COLUMNS, SCORES_OF
from core.problems import Problem, one_per_value
from core.sweep import Sweep, SweepError, SweepMember, expand, nested, source_of
from core.yamlfile import YamlFile, deep_merge, where
from slurm.planning.validation import LoadedExperiment, Stage, to_problem


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
            name,
            point.point,
            values,
            point.seed,
            sweep.swept,
            sweep.select,
            sweep.prune,
            len(sweep.points),
            sweep.parallel,
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
        stages = [(s.name, s.data.model_dump(), s.train.model_dump()) for s in item.stages]
        key = (  # the stages as resolved too: a train.dpo swept for a curriculum's DPO stage lives there only
            item.sweep.sweep,
            json.dumps([item.experiment.model_dump(exclude={"name"}), stages], sort_keys=True, default=str),
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


def check_select(
    experiment: Experiment, stages: list[Stage], member: SweepMember | None, chain: list[YamlFile]
) -> list[Problem]:
    """A sweep's `select.metric` must be a score its eval computes (or eval_loss): else the report would
    say "none yet" for ever. An eval of preference pairs (the last stage's data, as in a DPO stage) also
    scores preference_accuracy and preference_margin (eval/preference.py)."""
    if member is None or member.select is None:
        return []
    scores = [score for metric in experiment.eval.metrics for score in SCORES_OF[metric]]
    if stages and stages[-1].data.format == "preference":
        scores += PREFERENCE_SCORES
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
    if train.method == "grpo":
        block.append(
            (
                "prune",
                "is not for GRPO stages yet: a GRPO stage has no in-training eval_loss to judge a run by "
                "(its eval is the eval job's scores); sweep it without prune",
            )
        )
    elif not data.eval:
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
