"""eval/generate.py: the eval model on the device train/device.py names, in the trained precision, decoding
by the eval's own settings (never the base model's generation_config), and decoding that keeps the
model's added tokens while dropping pad/bos/eos."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, GenerationConfig

from core.config import EvalJob, EvalSpec, ModelSpec
from eval.generate import decode, eval_placement, framing_ids, generate, load_for_eval
from eval.job import run_eval
from tests.train_helpers import make_job, model_spec, sql_data
from train.device import Hardware, decide
from train.model import add_tokens, load_base, load_tokenizer
from train.recipe import run_stage

CPU = decide(Hardware(), "auto")
H100 = Hardware(cuda_devices=1, bf16_supported=True, capability_major=9, name="NVIDIA H100")
V100 = Hardware(cuda_devices=1, bf16_supported=False, capability_major=7, name="Tesla V100")
OPTIONS = {"num_beams": 1, "max_new_tokens": 4, "batch_size": 4}


def eval_job(tiny, tmp_path: Path, kind: str) -> EvalJob:
    return EvalJob(
        experiment="t",
        stage="s",
        model=model_spec(tiny, kind),
        adapter={"rank": 8, "alpha": 16, "dropout": 0.0},
        data=sql_data("easy", eval_split="dev"),
        eval={"metrics": ["exact_match"]},
        adapter_dir=str(tmp_path / "adapter"),
        out_dir=str(tmp_path / "eval"),
    )


class InputDevices:
    """Records the device of every input_ids the model's forward receives (a real forward pre-hook)."""

    def __init__(self, module):
        self.seen: set[torch.device] = set()
        module.register_forward_pre_hook(self.record, with_kwargs=True)

    def record(self, module, args, kwargs):
        ids = kwargs.get("input_ids", kwargs.get("decoder_input_ids"))
        if ids is not None:
            self.seen.add(ids.device)


@pytest.mark.parametrize("kind", ["causal", "seq2seq"])
def test_eval_model_and_its_inputs_are_on_the_device_train_device_names(tiny, tmp_path, kind):
    assert run_stage(make_job(tiny, tmp_path, kind, max_steps=2)) == "completed"
    job = eval_job(tiny, tmp_path, kind)
    placement = eval_placement(job.adapter_dir)
    trained = json.loads((tmp_path / "summary.json").read_text())["precision"]
    assert placement == decide(Hardware.detect(), trained)
    model, tokenizer = load_for_eval(job, placement)
    assert model.device == torch.device(placement.device)
    assert {p.device for p in model.parameters()} == {torch.device(placement.device)}
    dtypes = {("lora_" in name, p.dtype) for name, p in model.named_parameters()}
    # The base in the load dtype; peft keeps LoRA weights in fp32 over a bf16 or fp16 base
    # (autocast_adapter_dtype), as they trained: fp32 on a CPU, where the base is fp32 too.
    assert dtypes == {(False, placement.load_dtype), (True, torch.float32)}
    assert not model.training
    inputs = InputDevices(model.get_base_model())
    outputs = generate(model, tokenizer, ["customers | how many? | SQL: "] * 3, kind=kind, **OPTIONS)
    assert len(outputs) == 3 and inputs.seen == {torch.device(placement.device)}


def test_eval_runs_in_the_precision_the_stage_trained_in(tmp_path):
    adapter_dir = tmp_path / "adapter"
    # No summary.json (an adapter from elsewhere): the hardware's own choice.
    assert eval_placement(str(adapter_dir), H100).precision == "bf16"
    assert eval_placement(str(adapter_dir), V100).precision == "fp16"
    (tmp_path / "summary.json").write_text(json.dumps({"precision": "fp32"}))
    on_h100 = eval_placement(str(adapter_dir), H100)
    assert (on_h100.device, on_h100.precision, on_h100.load_dtype) == ("cuda:0", "fp32", torch.float32)
    (tmp_path / "summary.json").write_text(json.dumps({"precision": "bf16"}))
    on_h100 = eval_placement(str(adapter_dir), H100)
    assert (on_h100.device, on_h100.precision, on_h100.load_dtype) == ("cuda:0", "bf16", torch.bfloat16)
    assert eval_placement(str(adapter_dir), Hardware()).load_dtype == torch.float32  # CPU: fp32 weights


def tiny_with_token(tiny, kind: str):
    """A tiny base model with an added special token <sql>, and its id."""
    spec = ModelSpec(**model_spec(tiny, kind))
    tokenizer = load_tokenizer(spec.name_or_path, spec)
    model = load_base(spec, None, CPU)
    (sql_id,) = add_tokens(model, tokenizer, ["<sql>"])
    return model.eval(), tokenizer, sql_id


def test_decode_keeps_added_tokens_and_drops_pad_bos_eos(tiny):
    model, tokenizer, sql_id = tiny_with_token(tiny, "causal")
    text = tokenizer("SELECT <sql> name", add_special_tokens=False)["input_ids"]
    assert sql_id in text
    framed = [
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        *text,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    ]
    assert framing_ids(model, tokenizer) == {
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    }
    strip = framing_ids(model, tokenizer)
    assert decode(tokenizer, torch.tensor([framed]), strip) == ["SELECT <sql> name"]


@pytest.mark.parametrize("kind", ["causal", "seq2seq"])
def test_generated_added_tokens_reach_the_predictions(tiny, kind):
    model, tokenizer, sql_id = tiny_with_token(tiny, kind)
    # The model's own generation config makes it say <sql> and then stop: real generation, known output.
    model.generation_config.sequence_bias = {(sql_id,): 100.0, (sql_id, tokenizer.eos_token_id): 200.0}
    outputs = generate(
        model, tokenizer, ["customers | how many? | SQL: ", "list cities"], kind=kind, **OPTIONS
    )
    assert outputs == ["<sql>", "<sql>"]  # eos, padding and T5's decoder start (pad) are gone


NOISY_DECODING = {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2}


def with_generation_config(folder: Path, into: Path, **settings) -> Path:
    """A copy of a model folder whose generation_config.json adds `settings` (as a hub Instruct model's
    does: Qwen2.5-7B-Instruct ships repetition_penalty 1.05)."""
    shutil.copytree(folder, into)
    config = (
        GenerationConfig.from_pretrained(folder) if (folder / "generation_config.json").is_file() else None
    )
    config = config or GenerationConfig.from_model_config(AutoConfig.from_pretrained(folder))
    config.update(**settings)
    config.save_pretrained(into)
    return into


def test_eval_decodes_by_its_own_settings_not_the_base_models_generation_config(tiny, tmp_path):
    assert run_stage(make_job(tiny, tmp_path / "train", max_steps=2)) == "completed"
    noisy = with_generation_config(tiny["tiny-llama"], tmp_path / "noisy-llama", **NOISY_DECODING)

    def evaluated(name: str, model: Path, **generation) -> tuple[list[str], dict]:
        job = eval_job(tiny, tmp_path / "train", "causal").model_copy(
            update={
                "model": ModelSpec(name_or_path=str(model), kind="causal"),
                "eval": EvalSpec(metrics=["exact_match"], limit=8, max_new_tokens=16, generation=generation),
                "out_dir": str(tmp_path / name),
            }
        )
        results = run_eval(job)
        rows = (tmp_path / name / "predictions.jsonl").read_text().splitlines()
        return [json.loads(row)["prediction"] for row in rows], results

    plain, plain_results = evaluated("plain", tiny["tiny-llama"])
    from_noisy, noisy_results = evaluated("noisy", noisy)
    asked_for, asked_results = evaluated("asked", tiny["tiny-llama"], **NOISY_DECODING)
    assert from_noisy == plain
    assert asked_for != plain  # the settings do change this model's outputs, when the eval asks for them
    used = {"do_sample": False, "num_beams": 1, "max_new_tokens": 16, "length_penalty": 1.0}
    assert (
        plain_results["generation"]
        == noisy_results["generation"]
        == used
        | {
            "repetition_penalty": 1.0,
            "no_repeat_ngram_size": 0,
        }
    )
    assert asked_results["generation"] == used | NOISY_DECODING
    assert noisy_results["generation_overridden"] == NOISY_DECODING
    assert plain_results["generation_overridden"] == {}


def test_eval_generation_at_its_defaults_leaves_the_eval_jobs_hash_alone():
    # Left out of the dumped spec at its defaults: evals finished before the block existed are not rerun.
    assert "generation" not in EvalSpec().model_dump()
    assert EvalSpec(generation=NOISY_DECODING).model_dump()["generation"] == NOISY_DECODING | {
        "length_penalty": 1.0
    }
