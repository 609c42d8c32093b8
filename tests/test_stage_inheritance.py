"""Issue 48, item 1: a plan never has fewer stages than the file. A stage's data and train are the
experiment's, changed by the stage's own keys, except the keys its format or method does not read (the one
rule, core/config.py KEYS_OF_FORMATS); whatever fails in that merge is refused at a line that names the
stage, never dropped with the stage (H1: the plan lost the stage, the run ended "complete"), never found at
the job's start (M7). The real loader through `launch.py --dry-run`, and every model validator of the
schema walked through a stage that trips it only with what it inherits."""

from __future__ import annotations

import functools
import inspect
import itertools
import json
import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from core.config import DataSpec, Experiment, TrainSpec
from core.yamlfile import YamlFile, deep_merge
from slurm.planning.validation import inherited_section, resolve_stages, validate_experiment
from tests.helpers import ROOT, dry_run, experiment_folder

PAIRS = ROOT / "data" / "demo" / "sql" / "pairs-train.jsonl"
PAIRS_DEV = ROOT / "data" / "demo" / "sql" / "pairs-dev.jsonl"


def edited(configs: Path, old: str, new: str) -> None:
    path = configs / "a.yaml"
    text = path.read_text()
    assert old in text, f"test setup: {old!r} not in a.yaml"
    path.write_text(text.replace(old, new))


def test_a_stage_that_fails_a_check_across_inherited_keys_is_refused_at_its_line_not_dropped(
    tmp_path, capsys
):
    """H1's second specimen: micro_batch 4 from the experiment, batch_size 6 in the stage. Before: the
    plan was easy -> last, exit 0, and the report said `complete`."""
    stages = "stages:\n  - name: easy\n  - name: hard\n    train: {batch_size: 6}\n  - name: last\n"
    configs = experiment_folder(tmp_path, more=stages)
    edited(configs, "train: {epochs: 1,", "train: {micro_batch: 4, epochs: 1,")
    code, err = dry_run(configs, capsys)
    assert code == 2, err
    assert "a.yaml:11: stages.1.train: in stage 'hard', with what it inherits from the experiment: " in err
    assert "micro_batch 4 does not divide the effective batch batch_size x grad_accum = 6" in err
    assert "Traceback" not in err


def sft_then_dpo(tmp_path: Path, dpo_data: str, evaluation: str | None = None) -> Path:
    """The demo's shape: the experiment's data are SFT fields (input_field, target_field, data.eval), an
    SFT stage, then a DPO stage of preference pairs."""
    stages = (
        "stages:\n  - name: sft\n  - name: dpo\n"
        f"    data: {{format: preference, train: {PAIRS}{dpo_data}}}\n"
        "    train: {method: dpo, eval_every_epochs: null}\n"
    )
    configs = experiment_folder(tmp_path, more=stages)
    if evaluation is not None:
        edited(configs, "eval: {metrics: [exact_match, sql_exec],", evaluation)
    return configs


def planned(configs: Path, capsys) -> dict:
    import launch

    assert launch.main(["--all", "--config-dir", str(configs), "--dry-run", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_fields_keys_are_the_sft_stages_and_a_preference_stage_is_planned_without_them(tmp_path, capsys):
    """H1's first specimen: before, the DPO stage was gone from the plan (`stages: sft`)."""
    configs = sft_then_dpo(tmp_path, f", eval: {PAIRS_DEV}")
    plan = planned(configs, capsys)
    assert {job["id"] for job in plan["jobs"]} >= {"a/sft", "a/dpo"}
    left_out = plan["inherited_keys_left_out"]
    assert left_out == {"a/dpo": ["data.input_field", "data.target_field"]}, left_out
    dpo = next(job for job in plan["jobs"] if job["id"] == "a/dpo")
    assert dpo["spec"]["data"]["eval"] == str(PAIRS_DEV)
    code = dry_run(configs, capsys)[0]  # and the table says so, per stage
    assert code == 0
    import launch

    launch.main(["--all", "--config-dir", str(configs), "--dry-run"])
    out = capsys.readouterr().out
    assert "a/dpo does not inherit the experiment's data.input_field, data.target_field" in out


def test_a_dpo_stage_never_reads_the_sft_eval_file_it_would_inherit(tmp_path, capsys):
    """M7: the DPO stage took the experiment's SFT data.eval, passed --dry-run and --preflight, and failed
    at its start after the SFT stage had trained. Now it is refused before queueing, saying why."""
    code, err = dry_run(sft_then_dpo(tmp_path, ""), capsys)
    assert code == 2
    assert (
        "the eval job scores stage(s) ['dpo'], which have no data.eval (it does not inherit the experiment's"
        in err
    )


def test_a_dpo_stage_without_an_eval_job_trains_without_the_sft_eval_file(tmp_path, capsys):
    plan = planned(sft_then_dpo(tmp_path, "", "eval: {metrics: [],"), capsys)
    dpo = next(job for job in plan["jobs"] if job["id"] == "a/dpo")
    assert "eval" not in dpo["spec"]["data"] or dpo["spec"]["data"]["eval"] is None


# -- every model validator, through a stage that trips it only with what it inherits ----------------------
#
# The validators are enumerated from the schema: the Experiment's own and those of every model a stage can
# write (data, train and the models inside them), so a validator added later is walked without editing this
# test. For each, a search over small values of every field's type finds an experiment that is valid, a
# stage whose own keys are valid over the defaults, and whose merge (the one rule) trips the validator.

STAGE_SECTIONS = {"data": DataSpec, "train": TrainSpec}


def models_below(model: type[BaseModel]) -> list[type[BaseModel]]:
    found = [model]
    for info in model.model_fields.values():
        for arg in flat(info.annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel) and arg not in found:
                found += [m for m in models_below(arg) if m not in found]
    return found


def flat(annotation) -> list:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return flat(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [a for arg in typing.get_args(annotation) for a in flat(arg)]
    return [annotation]


def candidates(annotation) -> list:
    """Small values of each type a field may hold: every choice of a Literal, a few sizes, None, a model's
    defaults."""
    values: list = []
    for arg in flat(annotation):
        if arg is type(None):
            values.append(None)
        elif typing.get_origin(arg) is typing.Literal:
            values += list(typing.get_args(arg))
        elif arg is bool:
            values.append(True)
        elif arg is int:
            values += [1, 4, 6, 8]
        elif arg is float:
            values += [0.5, 2.0]
        elif arg is str:
            values += ["{question}", "chatml", "image"]
        elif isinstance(arg, type) and issubclass(arg, BaseModel):
            values.append(arg())
    return values


def trips(validator, section: str | None, raw: dict) -> bool:
    """Whether `validator` (of Experiment: section None; else of the section's model) refuses `raw`, built
    without validation so that only this validator judges."""
    data = DataSpec.model_construct(**raw["data"])
    train = TrainSpec.model_construct(**raw["train"])
    try:
        if section == "data":
            validator.func(data)
        elif section == "train":
            validator.func(train)
        else:
            model = Experiment.model_fields["model"].annotation.model_construct(**raw["model"])
            evaluation = Experiment.model_fields["eval"].annotation.model_construct(**raw["eval"])
            validator.func(
                Experiment.model_construct(
                    **{**raw, "model": model, "data": data, "train": train, "eval": evaluation}
                )
            )
    except (ValueError, AssertionError, TypeError, AttributeError):
        return True
    return False


def valid(raw: dict) -> bool:
    return validate_experiment(raw, [YamlFile(Path("a.yaml"), raw)])[0] is not None


BASES = [
    {
        "name": "a",
        "model": {"name_or_path": "org/m", "kind": kind},
        "data": {
            "train": "t.jsonl",
            "eval": "e.jsonl",
            **({"image_field": "image"} if kind == "image-text" else {}),
        },
        "train": {},
        "eval": evaluation,
    }
    for kind in ("causal", "seq2seq", "image-text")
    for evaluation in ({}, {"turns": "all"})
]


def settings() -> list[tuple[str, str, object]]:
    return [
        (section, key, value)
        for section, model in STAGE_SECTIONS.items()
        for key, info in model.model_fields.items()
        if key not in ("train", "eval")  # the files: a stage of another format writes its own
        for value in candidates(info.annotation)
    ]


def specimen(validator, section: str | None) -> tuple[dict, dict] | None:
    """(experiment, stage) where the experiment is valid, the stage's own keys are valid in their section
    alone, and the merge trips `validator`."""
    experiments, own_keys = search_space()
    for experiment in experiments:
        if trips(validator, section, experiment):
            continue
        for own in own_keys:
            merged = {**experiment}
            for name in STAGE_SECTIONS:
                inherited = inherited_section(name, experiment[name], own.get(name, {}))[0]
                merged[name] = deep_merge(inherited, own.get(name, {}))
            if trips(validator, section, merged):
                return experiment, own
    return None


@functools.cache
def search_space() -> tuple[list[dict], list[dict]]:
    """The valid experiments (a base with one value changed) and the stages' own keys valid alone."""
    every = settings()
    experiments = [
        deep_merge(base, {sec: {key: value}}) for base, (sec, key, value) in itertools.product(BASES, every)
    ]
    return [e for e in experiments if valid(e)], [own for own in map(stage_keys, every) if section_valid(own)]


def stage_keys(setting: tuple[str, str, object]) -> dict:
    section, key, value = setting
    own = {section: {key: value}}
    if section == "data" and key == "format":
        own["data"]["train"] = "t.jsonl"  # another format reads none of the experiment's files
    return own


def section_valid(own: dict) -> bool:
    try:
        DataSpec.model_validate({"train": "t.jsonl", **own.get("data", {})})
        TrainSpec.model_validate(own.get("train", {}))
    except ValueError:
        return False
    return True


def walked() -> list[tuple[str, object, str | None]]:
    found = [("Experiment", v, None) for v in Experiment.__pydantic_decorators__.model_validators.values()]
    for section, model in STAGE_SECTIONS.items():
        for below in models_below(model):
            found += [
                (below.__name__, v, section) for v in below.__pydantic_decorators__.model_validators.values()
            ]
    return found


@pytest.mark.parametrize("owner, validator, section", walked(), ids=lambda v: getattr(v, "cls_var_name", v))
def test_every_model_validator_tripped_by_inheritance_refuses_the_stage_never_drops_it(
    owner, validator, section
):
    assert validator.info.mode == "after", (
        f"{owner}.{validator.cls_var_name}: walk a {validator.info.mode} validator too"
    )
    found = specimen(validator, section)
    if found is None:
        # Only a check of the experiment's other sections (model, eval, resources) may be out of a stage's
        # reach; one that reads data or train must be found, else `candidates` needs a value of its type.
        reads = inspect.getsource(validator.func)
        assert section is None and "self.data" not in reads and "self.train" not in reads, (
            f"{owner}.{validator.cls_var_name}: no stage trips it; give `candidates` a value"
        )
        return
    experiment, own = found
    raw = {**experiment, "stages": [{"name": "first"}, {"name": "second", **own}]}
    chain = [YamlFile(Path("a.yaml"), raw)]
    loaded, problems = validate_experiment(raw, chain)
    assert loaded is not None and not problems, problems
    stages, problems = resolve_stages(loaded, raw, chain)
    assert [s.name for s in stages] == ["first"], stages
    assert problems and all(p.key.startswith("stages.1") for p in problems), (own, problems)


def test_fields_keys_written_for_pairs_are_refused_saying_how_a_pair_is_rendered():
    """L11: string pairs were told `a preference example is rendered by the model's chat template`; a string
    prompt is used as written."""
    with pytest.raises(ValueError, match="a string prompt is used as written, a prompt of turns is rendered"):
        DataSpec(train="p.jsonl", format="preference", input_field="question")
