"""train/recipe.py end to end on the tiny models: a short run and what it leaves in the run directory,
stage chaining, eval with early stopping, data order, the command line."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch
import yaml
from safetensors.torch import load_file

from core.config import ModelSpec
from tests.train_helpers import make_job, read_jsonl, sql_data
from train import data as data_lib
from train.checkpoints import checkpoints, step_of
from train.device import current
from train.model import load_tokenizer
from train.recipe import StageRecipe, run_stage

TRAIN_ROW = {"step", "epoch", "loss", "learning_rate", "grad_norm", "tokens_per_s", "samples_per_s", "time"}


@pytest.mark.slow
def test_short_run_learns_and_writes_the_run_directory(tiny, tmp_path):
    job = make_job(tiny, tmp_path, max_steps=30, logging_steps=5)
    assert run_stage(job) == "completed"

    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 5, 10, 15, 20, 25, 30]
    assert all(r.keys() >= TRAIN_ROW and r["tokens_per_s"] > 0 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3  # a random base with LoRA: 6.2 → 5.6 in 30 steps

    progress = json.loads((tmp_path / "progress.json").read_text())
    assert progress["step"] == progress["total_steps"] == 30 and progress["eta_s"] == 0
    assert progress.keys() >= {"epoch", "last_loss", "updated_at"}

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["trainable_params"] < summary["total_params"]
    assert summary["trainable_percent"] == pytest.approx(
        100 * summary["trainable_params"] / summary["total_params"], abs=1e-3
    )
    assert summary["max_length"] % 8 == 0 and summary["max_length"] >= summary["longest_example"]
    assert 0 <= summary["padding_fraction"] < 0.5  # length-grouped batches pad little
    # What train/device.py's table gives this machine: cpu/fp32 here, cuda:0/bf16 on a bf16 GPU.
    here = current("auto")
    assert (summary["device"], summary["precision"], summary["global_step"]) == (
        here.device,
        here.precision,
        30,
    )
    assert (summary["device_name"], summary["truncated_inputs"], summary["truncated_targets"]) == (
        here.device_name,
        0,
        0,
    )
    assert summary["train_runtime_s"] > 0 and summary["best_eval_loss"] is None

    adapter = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= adapter
    base_side = json.loads((tiny["tiny-llama"] / "tokenizer_config.json").read_text()).get(
        "padding_side", "right"
    )
    saved_side = json.loads((tmp_path / "adapter" / "tokenizer_config.json").read_text()).get(
        "padding_side", "right"
    )
    assert saved_side == base_side  # training pads on the right; generation needs the base's own side


def lora_tensors(model) -> dict[str, torch.Tensor]:
    return {
        n.replace(".default", ""): p.detach().clone() for n, p in model.named_parameters() if "lora_" in n
    }


@pytest.mark.slow
def test_stage_two_continues_stage_one_adapter(tiny, tmp_path):
    assert run_stage(make_job(tiny, tmp_path / "one")) == "completed"
    stage_one = load_file(str(tmp_path / "one" / "adapter" / "adapter_model.safetensors"))
    job = make_job(tiny, tmp_path / "two", data=sql_data("medium"))
    recipe = StageRecipe(
        job.model_copy(update={"init_adapter": str(tmp_path / "one" / "adapter")}), threading.Event()
    )
    recipe.setup()
    loaded = lora_tensors(recipe.model)
    assert len(loaded) == len(stage_one) > 0
    for name, value in stage_one.items():
        assert torch.equal(loaded[name], value), name
    assert all(p.requires_grad for n, p in recipe.model.named_parameters() if "lora_" in n)
    assert recipe.train() == "completed"
    recipe.save()
    stage_two = load_file(str(tmp_path / "two" / "adapter" / "adapter_model.safetensors"))
    assert any(not torch.equal(stage_two[k], stage_one[k]) for k in stage_one)  # and it kept training


@pytest.mark.slow
def test_seq2seq_eval_early_stopping_keeps_best_and_newest(tiny, tmp_path):
    job = make_job(
        tiny,
        tmp_path,
        "seq2seq",
        data=sql_data("easy", eval_split="dev"),
        max_steps=None,
        epochs=6,
        eval_every_epochs=0.5,
        save_every_steps=3,
        early_stopping={"patience": 1, "threshold": 10.0},  # no eval improves by 10: stops at the 2nd eval
    )
    assert run_stage(job) == "completed"
    evals = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "eval_loss" in r]
    assert len(evals) == 2 and all({"step", "epoch", "eval_loss"} <= r.keys() for r in evals)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["best_eval_loss"] == min(r["eval_loss"] for r in evals)
    assert summary["global_step"] == evals[-1]["step"] < 6 * 11  # stopped early
    # Saved every 3 steps and at each eval; only the newest and the best are left.
    best_step = min(evals, key=lambda r: r["eval_loss"])["step"]
    assert {step_of(c) for c in checkpoints(tmp_path / "checkpoints")} == {summary["global_step"], best_step}


@pytest.mark.slow
def test_evals_fall_on_epoch_ends_with_gradient_accumulation(tiny, tmp_path):
    # 240 examples in batches of 8: 30 batches an epoch; 4 per step: 7 full steps and a last one of 2
    # batches, which the Trainer still takes. Epoch ends at steps 8 and 16, not 7 and 14.
    job = make_job(
        tiny,
        tmp_path,
        data=sql_data("train", eval_split="dev"),
        max_steps=None,
        epochs=2,
        batch_size=8,
        grad_accum=4,
        eval_every_epochs=1,
        logging_steps=50,
    )
    assert run_stage(job) == "completed"
    evals = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [8, 16]
    assert [r["epoch"] for r in evals] == [1.0, 2.0]
    assert json.loads((tmp_path / "summary.json").read_text())["global_step"] == 16


def test_max_length_auto_stops_at_the_model_positions_and_counts_what_it_cuts(tiny, tmp_path):
    short = tmp_path / "llama-64-positions"
    shutil.copytree(tiny["tiny-llama"], short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 64}))
    job = make_job(tiny, tmp_path / "run", model={"name_or_path": str(short), "kind": "causal"}, max_steps=2)
    assert run_stage(job) == "completed"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    tokenizer = load_tokenizer(str(short), ModelSpec(name_or_path=str(short), kind="causal"))
    lengths = data_lib.tokenized(job.data.train, job.data, tokenizer, "causal")["length"]
    longer = sum(1 for n in lengths if n > 64)
    assert summary["longest_example"] == max(lengths) > 64 and longer > 0
    assert (summary["max_length"], summary["truncated_inputs"]) == (64, longer)


def test_file_order_keeps_the_curriculum(tiny, tmp_path):
    recipe = StageRecipe(make_job(tiny, tmp_path, data=sql_data(order="file")), threading.Event())
    recipe.setup()
    assert recipe.batch_order() == list(range(len(recipe.train_set)))
    shuffled = StageRecipe(make_job(tiny, tmp_path / "s"), threading.Event())
    shuffled.setup()
    order = shuffled.batch_order()
    assert sorted(order) == list(range(len(shuffled.train_set))) and order != sorted(order)


def test_early_stopping_without_eval_data_is_refused(tiny, tmp_path):
    # Refused by the job's schema, before any model is loaded; the launcher says it with file and line.
    with pytest.raises(ValueError, match="needs data.eval"):
        make_job(tiny, tmp_path, eval_every_epochs=1, early_stopping={"patience": 2})


def test_bf16_on_cpu_and_the_command_line(tiny, tmp_path):
    from train.__main__ import main

    job = make_job(tiny, tmp_path, precision="bf16", max_steps=2)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job.model_dump()))
    assert main([str(tmp_path / "job.yaml")]) == 0
    # bf16 everywhere but on a GPU without native bf16 (there: fp16 AMP, train/device.py).
    assert json.loads((tmp_path / "summary.json").read_text())["precision"] == current("bf16").precision
