"""Issue 31, rules 4 and 6: numbers are finite and in range, a failed number never wins, and a key written
twice is an error at both lines. The real loader (`launch.py --dry-run`, no cluster needed: a refusal comes
before any backend is asked) and the real trainer on the tiny models."""

from __future__ import annotations

import math
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError
from transformers import TrainerState

from core import config
from slurm.cluster.profile import ClusterProfile
from tests.helpers import dry_run, experiment_folder
from tests.train_helpers import make_job
from train.callbacks import FailOnNonFiniteLoss, NonFiniteLoss
from train.recipe import run_stage


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return experiment_folder(tmp_path)


def models_under(root: type[BaseModel]) -> set[type[BaseModel]]:
    """Every pydantic model a config section is made of, walked through its fields' types."""
    found, todo = set(), [root]
    while todo:
        model = todo.pop()
        if model in found:
            continue
        found.add(model)
        for field in model.model_fields.values():
            for part in flatten(field.annotation):
                if isinstance(part, type) and issubclass(part, BaseModel):
                    todo.append(part)
    return found


def flatten(annotation) -> list:
    args = typing.get_args(annotation)
    return [annotation] if not args else [a for arg in args for a in flatten(arg)]


def float_fields(model: type[BaseModel]):
    for name, field in model.model_fields.items():
        if float in flatten(field.annotation):
            yield name, field


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_no_float_field_of_any_config_section_accepts_inf_or_nan(value):
    """One rule for the whole schema (Section's allow_inf_nan=False), walked field by field: a section
    added without it fails here."""
    checked = []
    for model in (
        models_under(config.Experiment) | models_under(config.TrainJob) | models_under(ClusterProfile)
    ):
        for name, field in float_fields(model):
            kind = (
                typing.Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
            )
            listed = typing.get_origin(field.annotation) is list  # a list of floats: each item checked
            with pytest.raises(ValidationError, match="finite"):
                TypeAdapter(kind, config=model.model_config).validate_python([value] if listed else value)
            checked.append(f"{model.__name__}.{name}")
    assert {"AdapterSpec.alpha", "TrainSpec.epochs", "TrainSpec.eval_every_epochs"} <= set(checked)
    assert {"PruneJob.rungs", "PruneJob.keep"} <= set(checked)
    assert len(checked) >= 10


def number_fields(model: type[BaseModel]):
    for name, field in model.model_fields.items():
        if {int, float} & set(flatten(field.annotation)):
            yield name, field


def test_no_number_field_of_any_config_section_takes_a_boolean_for_a_number():
    """Before: `eval.limit: yes` scored 1 example and `train.micro_batch: yes` meant 1 (pydantic reads True
    as 1). Walked field by field, as the finite-number rule: a number field added without core/config.py's
    Int or Float fails here."""
    checked = []
    for model in (
        models_under(config.Experiment) | models_under(config.TrainJob) | models_under(ClusterProfile)
    ):
        for name, field in number_fields(model):
            kind = (
                typing.Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
            )
            listed = typing.get_origin(field.annotation) is list
            with pytest.raises(ValidationError, match="is a yes/no, not a number"):
                TypeAdapter(kind, config=model.model_config).validate_python([True] if listed else True)
            checked.append(f"{model.__name__}.{name}")
    assert {"EvalSpec.limit", "TrainSpec.micro_batch", "AdapterSpec.rank", "DataSpec.max_length"} <= set(
        checked
    )
    assert {
        "ClusterProfile.pack",
        "Resources.gpus",
        "PruneJob.min_points",
        "GenerationSpec.length_penalty",
    } <= set(checked)


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.micro_batch=eight", "train.micro_batch: Input should be 'auto' or a valid integer"),
        ("data.max_length=yes", "data.max_length: true is a yes/no, not a number"),
        ("adapter.target_modules=5", "adapter.target_modules: Input should be a valid list or 'all-linear'"),
    ],
)
def test_a_bad_override_of_a_key_of_several_types_is_one_command_line_error(
    folder, capsys, override, message
):
    """Before: `train.micro_batch=eight` gave two errors, one per type the key may hold, at
    `train.micro_batch.function-after[functools.partial(<function ...>)]`."""
    code, err = dry_run(folder, capsys, override)
    assert code == 2
    assert f"command line: {message}" in err
    assert err.count("error:") == 1, err
    assert "function-" not in err and "literal[" not in err


@pytest.mark.parametrize(
    "override, key",
    [
        ("adapter.alpha=.inf", "adapter.alpha"),
        ("train.epochs=.inf", "train.epochs"),
        ("train.eval_every_epochs=.inf", "train.eval_every_epochs"),
        ("eval.generation.length_penalty=.nan", "eval.generation.length_penalty"),
        ("eval.sql_timeout_s=.inf", "eval.sql_timeout_s"),
        ("train.warmup_ratio=.nan", "train.warmup_ratio"),
    ],
)
def test_a_non_finite_number_is_refused_at_its_key_before_anything_runs(folder, capsys, override, key):
    """Before: .inf epochs crashed --dry-run with OverflowError; an alpha of .inf trained to NaN."""
    code, err = dry_run(folder, capsys, override)
    assert code == 2
    assert key in err and "must be a finite number" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_a_seed_outside_what_the_libraries_take_is_refused(folder, capsys, seed):
    code, err = dry_run(folder, capsys, f"train.seed={seed}")
    assert code == 2 and "train.seed" in err


def test_a_section_written_twice_is_refused_at_both_lines(folder, capsys):
    """Before: the second `train:` block silently erased the first one's `epochs: 1`."""
    path = folder / "a.yaml"
    path.write_text(path.read_text() + "train:\n  learning_rate: 1.0e-4\n")
    code, err = dry_run(folder, capsys)
    assert code == 2
    assert f"{path}:8: train: is written twice, at lines 5 and 8" in err


def test_a_key_repeated_in_a_flow_mapping_is_named_with_every_other_duplicate(folder, capsys):
    path = folder / "a.yaml"
    text = path.read_text().replace("adapter: {rank: 8, alpha: 16}", "adapter: {rank: 8, alpha: 16, rank: 4}")
    path.write_text(text + "resources: {gpus: 2}\n")
    code, err = dry_run(folder, capsys)
    assert code == 2
    assert "adapter.rank: is written twice, at lines 3 and 3" in err
    assert "also written twice: resources (lines 7 and 8)" in err


def test_a_run_that_diverges_fails_with_the_step_instead_of_completing(tiny, tmp_path):
    """Before: an alpha of 1e30 ran to its end and the stage was reported complete: every gradient norm
    was inf, so clipping zeroed every update and nothing was learned."""
    job = make_job(tiny, tmp_path / "run", adapter={"alpha": 1e30}, max_steps=4)
    with pytest.raises(NonFiniteLoss, match=r"the gradient norm became inf at step 1 "):
        run_stage(job)
    assert not (tmp_path / "run" / "adapter").exists()  # nothing that looks finished


@pytest.mark.parametrize("fp16", [False, True])
def test_a_nan_loss_fails_the_run_even_under_fp16s_loss_scaler(fp16):
    """The callback the trainer runs, given a logged row as the Trainer logs it (a NaN loss cannot be
    caused on purpose in a tiny fp32 run: clipping keeps its weights finite)."""
    state = TrainerState(global_step=7, epoch=0.5)
    with pytest.raises(NonFiniteLoss, match="training loss became nan at step 7"):
        FailOnNonFiniteLoss(fp16).on_log(None, state, None, logs={"loss": math.nan, "grad_norm": 1.0})
    # fp16 AMP: an inf gradient norm is a step the scaler skips, not a diverged run
    if fp16:
        FailOnNonFiniteLoss(fp16).on_log(None, state, None, logs={"loss": 1.0, "grad_norm": math.inf})


def test_a_cluster_yaml_union_value_is_one_problem_at_its_line_without_pydantics_internals(tmp_path):
    """L1: `gpu_mem_gb: true` gave two problems, no line, and pydantic's union members with a memory
    address (`function-after[functools.partial(<function greater_than_validator at 0x7fa4…>`)."""
    from core.problems import ConfigError
    from slurm.cluster.profile import load_profile

    (tmp_path / "cluster.yaml").write_text("run_dir: runs\ngpu_mem_gb: true\n")
    with pytest.raises(ConfigError) as refused:
        load_profile(tmp_path)
    assert [str(p) for p in refused.value.problems] == [
        f"{tmp_path / 'cluster.yaml'}:2: gpu_mem_gb: true is a yes/no, not a number: write the number itself"
    ]
