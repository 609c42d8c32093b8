"""One experiment's config → a validated Experiment and its stages, or its problems at `file:line`.

pydantic's errors become Problems blamed on the line that wrote the value (to_problem), a union's members
folded into one problem per value; each stage is the experiment's data/train plus its own changes, validated
in full (resolve_stages). LoadedExperiment is what loading gives (slurm/planning/experiments.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import BaseModel, ValidationError

from core.config import (
    FILES_OF_A_FORMAT,
    KEYS_OF_FORMATS,
    KEYS_OF_METHODS,
    DataSpec,
    Experiment,
    StageSpec,
    TrainSpec,
)
from core.names import SQL_REWARD_SCORES
from core.problems import Problem, did_you_mean, one_per_value
from core.sweep import SweepMember, SweepSpec
from core.yamlfile import YamlFile, deep_merge, where

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
    # The experiment's keys this stage does not inherit, dotted (inherited_section): --dry-run lists them.
    left_out: tuple[str, ...] = ()


@dataclass(frozen=True)
class LoadedExperiment:
    experiment: Experiment
    file: Path
    stages: tuple[Stage, ...]
    sweep: SweepMember | None = None  # a point of the file's `sweep:` block

    @property
    def name(self) -> str:
        return self.experiment.name


def validate_experiment(raw: dict, chain: list[YamlFile]) -> tuple[Experiment | None, list[Problem]]:
    try:
        return Experiment.model_validate(without_stages_blocks(raw)), []
    except ValidationError as exc:
        return None, [to_problem(error, chain) for error in one_per_value(exc.errors())]


def blocks_for_stages(raw: dict) -> list[str]:
    """A curriculum's own method blocks (`train.dpo`, `train.grpo`) written for its stages of that method,
    so that `train.dpo.beta` can be swept (a sweep's keys are the experiment's): the experiment's method is
    not the block's, and a stage's is. Each is then validated in those stages, and left out of the others
    (resolve_stages, core/config.py KEYS_OF_METHODS)."""
    train, stages = raw.get("train"), raw.get("stages")
    if not isinstance(train, dict) or not isinstance(stages, list):
        return []
    methods = {
        s["train"].get("method") for s in stages if isinstance(s, dict) and isinstance(s.get("train"), dict)
    }
    return [
        block
        for block, readers in KEYS_OF_METHODS.items()
        if block in train and train.get("method", "sft") not in readers and methods & readers
    ]


def without_stages_blocks(raw: dict) -> dict:
    """`raw` as the experiment's own sections are validated: method blocks written for its stages left out."""
    blocks = blocks_for_stages(raw)
    if not blocks:
        return raw
    return {**raw, "train": {k: v for k, v in raw["train"].items() if k not in blocks}}


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
    """Each stage = the experiment's data/train as the stage inherits them (inherited_section) plus the
    stage's own changes, validated as the whole experiment is: every check of every section, those across
    keys too. A stage is planned, or the launch is refused with its problem; never dropped in silence."""
    stages, problems, reported = [], [], set()
    base = without_stages_blocks(raw)
    for index, stage in enumerate(experiment.stages):
        resolved, left_out = {}, []
        for section in ("data", "train"):
            inherited, dropped = inherited_section(section, raw.get(section) or {}, getattr(stage, section))
            resolved[section] = deep_merge(inherited, getattr(stage, section))
            left_out += [f"{section}.{key}" for key in dropped]
        try:
            whole = Experiment.model_validate({**base, **resolved})
        except ValidationError as exc:
            for problem in stage_problems(exc.errors(), index, stage, chain):
                if problem not in reported:  # an inherited key's mistake, once for all its stages
                    reported.add(problem)
                    problems.append(problem)
            continue
        if whole.train.early_stopping and not whole.data.eval:
            file, line = where(chain, ("train", "early_stopping"))
            message = (
                f"stops on the eval loss, but stage {stage.name!r} has no data.eval{inherits_no_eval(left_out)}; "
                "add data.eval or remove early_stopping"
            )
            problems.append(Problem(file, "train.early_stopping", message, line))
        stages.append(Stage(stage.name, whole.data, with_reward_databases(whole), tuple(left_out)))
    return stages, problems + check_eval_split(experiment, stages, chain)


def with_reward_databases(whole: Experiment) -> TrainSpec:
    """A GRPO stage's train with each SQL reward's database written: its own `db`, else eval.db (the
    database is what the reward computes against, so it is part of the stage's identity)."""
    train = whole.train
    if train.method != "grpo" or not whole.eval.db:
        return train
    rewards = [
        reward.model_copy(update={"db": whole.eval.db})
        if reward.score in SQL_REWARD_SCORES and not reward.db
        else reward
        for reward in train.reward_objective.rewards
    ]
    return train.model_copy(update={"grpo": train.reward_objective.model_copy(update={"rewards": rewards})})


def inherited_section(section: str, experiments: dict, stages: dict) -> tuple[dict, list[str]]:
    """The experiment's `section` as a stage that writes `stages` there inherits it, and the keys left out:
    those its format (data) or method (train) does not read (core/config.py KEYS_OF_FORMATS)."""
    if section == "data":
        own_format = experiments.get("format", "fields")
        reads = stages.get("format", own_format)
        unread = {key for key, formats in KEYS_OF_FORMATS.items() if reads not in formats}
        unread |= set(FILES_OF_A_FORMAT) if reads != own_format else set()
    else:
        reads = stages.get("method", experiments.get("method", "sft"))
        unread = {key for key, methods in KEYS_OF_METHODS.items() if reads not in methods}
    dropped = [key for key in experiments if key in unread and key not in stages]
    return {k: v for k, v in experiments.items() if k not in dropped}, dropped


def inherits_no_eval(left_out: list[str] | tuple[str, ...]) -> str:
    """Why a stage has no data.eval when the experiment has one: it was written for another format."""
    if "data.eval" not in left_out:
        return ""
    return " (it does not inherit the experiment's data.eval, a file of the experiment's data.format)"


def stage_problems(errors: list[dict], index: int, stage: StageSpec, chain: list[YamlFile]) -> list[Problem]:
    """A stage's errors, each at the line that wrote it: the stage's own key; an inherited key (the
    experiment's, valid there: train.dpo is validated in the DPO stages only); else (a check across keys,
    some the stage's, some inherited) the stage's section, naming the stage."""
    problems = []
    for error in one_per_value(errors):
        loc = tuple(error["loc"])
        section = loc[0] if loc and loc[0] in ("data", "train") else None
        if section and len(loc) > 1 and loc[1] in getattr(stage, section):
            problems.append(to_problem(error, chain, ("stages", index)))
        elif section and len(loc) > 1:
            problems.append(to_problem(error, chain))
        else:
            place = ("stages", index, section) if section and getattr(stage, section) else ("stages", index)
            problem = to_problem({**error, "loc": ()}, chain, place)
            message = f"in stage {stage.name!r}, with what it inherits from the experiment: {problem.message}"
            problems.append(replace(problem, message=message))
    return problems


def check_eval_split(experiment: Experiment, stages: list[Stage], chain: list[YamlFile]) -> list[Problem]:
    """An evaluated stage needs data.eval, unless eval.split: train says to score on the training data:
    scores on the training data must never pass for eval scores."""
    spec = experiment.eval
    if not spec.metrics or spec.split != "eval" or len(stages) != len(experiment.stages):
        return []
    evaluated = stages if spec.after_each_stage else stages[-1:]
    lacking = [stage for stage in evaluated if not stage.data.eval]
    if not lacking:
        return []
    file, line = where(chain, ("data", "eval"))
    what = f"the eval job scores stage(s) {[s.name for s in lacking]}, which have no data.eval"
    what += inherits_no_eval(lacking[0].left_out)
    hint = "add data.eval, or set `eval.split: train` to knowingly score on the training data"
    return [Problem(file, "data.eval", f"{what}; {hint}", line)]
