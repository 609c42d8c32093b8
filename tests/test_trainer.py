"""The trainer's guards and contracts, on the tiny models with real transformers/peft/bitsandbytes."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from train import data as data_lib
from train.config import AdapterSpec, DataSpec, ModelSpec, TrainJob
from train.model import TrainableTooLarge, load_base, load_tokenizer, load_trained, new_adapter
from train.recipe import StageRecipe, run_stage


@pytest.fixture
def sql_data(repo_root) -> DataSpec:
    return DataSpec(
        train=str(repo_root / "data/demo/sql/easy.jsonl"),
        input_field="question",
        target_field="sql",
        prompt_template="{schema} | {question} | SQL: ",
    )


def llama(repo_root: Path, **extra) -> ModelSpec:
    return ModelSpec(name_or_path=str(repo_root / "models" / "tiny-llama"), kind="causal", **extra)


def job(repo_root, run_dir, data, model=None, adapter=None, init_adapter=None, **train) -> TrainJob:
    return TrainJob(
        experiment="t",
        stage="s",
        model=model or llama(repo_root),
        adapter=adapter or AdapterSpec(rank=8, alpha=16, dropout=0.0, max_trainable_percent=30),
        data=data,
        train={
            "max_steps": 3,
            "learning_rate": 3e-3,
            "batch_size": 8,
            "logging_steps": 1,
            "eval_every_epochs": None,
        }
        | train,
        init_adapter=init_adapter,
        run_dir=str(run_dir),
    )


def test_full_matrices_in_modules_to_save_are_refused_by_name(repo_root, tmp_path, tiny_models, sql_data):
    adapter = AdapterSpec(modules_to_save=["embed_tokens", "lm_head"], allow_full_modules=True)
    with pytest.raises(TrainableTooLarge) as refused:
        StageRecipe(job(repo_root, tmp_path, sql_data, adapter=adapter), threading.Event()).setup()
    message = str(refused.value)
    assert "embed_tokens" in message and "lm_head" in message and "max_trainable_percent" in message
    assert not (tmp_path / "checkpoints").exists()


def test_added_token_survives_the_round_trip_only_in_the_right_order(
    repo_root, tmp_path, tiny_models, sql_data
):
    model = llama(repo_root, added_tokens=["<sql>"])
    assert run_stage(job(repo_root, tmp_path, sql_data, model=model)) == "completed"
    adapter_dir = tmp_path / "adapter"
    trained, tokenizer = load_trained(model, str(adapter_dir))
    base_vocab = len(load_tokenizer(model.name_or_path, model))
    assert len(tokenizer) == base_vocab + 1 and "<sql>" in tokenizer.get_vocab()
    assert trained.get_input_embeddings().weight.shape[0] == base_vocab + 1
    ids = tokenizer("x <sql>", return_tensors="pt")
    assert trained.generate(**ids, max_new_tokens=3, do_sample=False).shape[1] > ids["input_ids"].shape[1]
    # The order people get wrong: the base's own vocabulary, adapter loaded onto it.
    with pytest.raises(RuntimeError, match="size mismatch"):
        PeftModel.from_pretrained(load_base(model, None), str(adapter_dir))


def test_stage_two_starts_from_stage_one_adapter(repo_root, tmp_path, tiny_models, sql_data):
    assert run_stage(job(repo_root, tmp_path / "one", sql_data)) == "completed"
    stage_one = load_file(str(tmp_path / "one" / "adapter" / "adapter_model.safetensors"))
    recipe = StageRecipe(
        job(repo_root, tmp_path / "two", sql_data, init_adapter=str(tmp_path / "one" / "adapter")),
        threading.Event(),
    )
    recipe.setup()
    loaded = {n: p.detach() for n, p in recipe.model.named_parameters() if "lora_" in n}
    assert len(loaded) == len(stage_one)
    for name, value in stage_one.items():
        key = name.replace(".weight", ".default.weight")
        assert torch.equal(loaded[key], value), name
    assert all(p.requires_grad for n, p in recipe.model.named_parameters() if "lora_" in n)
    assert recipe.train() == "completed"
    recipe.save()
    stage_two = load_file(str(tmp_path / "two" / "adapter" / "adapter_model.safetensors"))
    assert any(not torch.equal(stage_two[k], stage_one[k]) for k in stage_one)  # and it kept training


def test_max_length_auto_covers_the_longest_example(repo_root, tiny_models, sql_data):
    tokenizer = load_tokenizer(str(repo_root / "models" / "tiny-llama"), llama(repo_root))
    dataset = data_lib.tokenized(sql_data.train, sql_data, tokenizer, "causal")
    report = data_lib.choose_lengths(dataset, sql_data, "causal")
    longest = max(dataset["length"])
    assert report.longest == longest and report.max_length >= longest and report.max_length % 8 == 0
    assert report.max_length - longest < 8
    assert report.truncated_at[128] == sum(1 for n in dataset["length"] if n > 128)
    fixed = sql_data.model_copy(update={"max_length": 16})
    cut = data_lib.truncate(dataset, data_lib.choose_lengths(dataset, fixed, "causal"))
    assert max(cut["length"]) == 16 and all(len(x) <= 16 for x in cut["labels"])


def test_causal_prompt_is_masked_out_of_the_loss(repo_root, tiny_models):
    tokenizer = load_tokenizer(str(repo_root / "models" / "tiny-llama"), llama(repo_root))
    encoded = data_lib.encode(tokenizer, ["translate: two"], ["SELECT 2"], "causal")
    prompt_len = len(tokenizer("translate: two")["input_ids"])
    target = tokenizer("SELECT 2", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    labels, inputs = encoded["labels"][0], encoded["input_ids"][0]
    assert labels[:prompt_len] == [-100] * prompt_len
    assert labels[prompt_len:] == target == inputs[prompt_len:]


def test_changed_tokenizer_never_reuses_the_tokenization_cache(
    repo_root, tmp_path, tiny_models, sql_data, monkeypatch
):
    monkeypatch.setenv("LORA_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = load_tokenizer(str(repo_root / "models" / "tiny-llama"), llama(repo_root))
    first = data_lib.tokenized(sql_data.train, sql_data, tokenizer, "causal")
    again = data_lib.tokenized(sql_data.train, sql_data, tokenizer, "causal")
    assert len(list((tmp_path / "cache" / "tokenized").iterdir())) == 1
    assert first["input_ids"] == again["input_ids"]
    tokenizer.add_special_tokens({"additional_special_tokens": ["<sql>"]})
    data_lib.tokenized(sql_data.train, sql_data, tokenizer, "causal")
    assert len(list((tmp_path / "cache" / "tokenized").iterdir())) == 2


def lora_gradients(model, batch) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def test_qlora_gradients_on_cpu_are_exact_after_an_eval_forward(repo_root, tiny_models):
    # bitsandbytes on AVX512-BF16 CPUs switches 4-bit layers to a kernel without autograd after an eval
    # forward under no_grad; load_base turns that off. Gradients after such a forward must equal a fresh
    # model's.
    spec, adapter = llama(repo_root), AdapterSpec(method="qlora", rank=8, alpha=16, dropout=0.0)
    tokenizer = load_tokenizer(spec.name_or_path, spec)
    batch = tokenizer(["SELECT name FROM customers"], return_tensors="pt")
    batch["labels"] = batch["input_ids"].clone()

    def fresh():
        torch.manual_seed(0)
        return new_adapter(load_base(spec, adapter), adapter, "causal")

    reference = lora_gradients(fresh(), batch)
    model = fresh()
    model.eval()
    with torch.no_grad():
        model(**batch)
    model.train()
    after_eval = lora_gradients(model, batch)
    assert reference.keys() == after_eval.keys() and reference
    for name, grad in reference.items():
        assert torch.allclose(grad, after_eval[name], rtol=1e-4, atol=1e-7), name
