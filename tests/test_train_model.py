"""train/model.py: the trainable-% guard and count, added tokens and the one load order, CPU QLoRA gradients,
dtype."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from core.config import AdapterSpec, ModelSpec
from tests.train_helpers import make_job, model_spec
from train.device import Hardware, decide
from train.model import (
    TrainableTooLarge,
    load_base,
    load_tokenizer,
    load_trained,
    max_positions,
    new_adapter,
    trainable_report,
)
from train.recipe import StageRecipe, run_stage

CPU = decide(Hardware(), "auto")


@pytest.mark.parametrize(("kind", "full"), [("causal", ["embed_tokens", "lm_head"]), ("seq2seq", ["shared"])])
def test_trainable_share_counts_each_real_parameter_once(tiny, kind, full):
    # peft keeps a frozen original of every modules_to_save layer next to its trainable copy; only one of
    # them runs, so the total is the base model's own count plus the LoRA matrices.
    spec = ModelSpec(**model_spec(tiny, kind))
    base_count = load_base(spec, None, CPU).num_parameters()
    adapter = AdapterSpec(rank=8, modules_to_save=full, allow_full_modules=True, max_trainable_percent=100)
    model = new_adapter(load_base(spec, None, CPU), adapter, kind)
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    report = trainable_report(model)
    assert report.total == base_count + lora
    assert report.trainable == lora + len(full) * 512 * 64  # each full matrix: vocabulary x width
    assert report.by_module == {"lora": lora} | {name: 512 * 64 for name in full}


def test_full_embedding_matrices_are_refused_naming_them(tiny, tmp_path):
    # The schema lets this through only with allow_full_modules; the trainer still refuses above the limit.
    adapter = {
        "modules_to_save": ["embed_tokens", "lm_head"],
        "allow_full_modules": True,
        "max_trainable_percent": 10,
    }
    recipe = StageRecipe(make_job(tiny, tmp_path, adapter=adapter), threading.Event())
    with pytest.raises(TrainableTooLarge) as refused:
        recipe.setup()
    message = str(refused.value)
    vocab_times_width = 64 * len(load_tokenizer(str(tiny["tiny-llama"]), ModelSpec(**model_spec(tiny))))
    assert f"embed_tokens ({vocab_times_width:,} params)" in message
    assert f"lm_head ({vocab_times_width:,} params)" in message
    assert "max_trainable_percent" in message
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "adapter").exists()


@pytest.mark.parametrize("kind", ["causal", "seq2seq"])
@pytest.mark.slow
def test_added_token_round_trip_in_the_one_load_order(tiny, tmp_path, kind):
    spec = ModelSpec(**model_spec(tiny, kind, added_tokens=["<sql>"]))
    assert run_stage(make_job(tiny, tmp_path, kind, model=spec.model_dump(), max_steps=4)) == "completed"
    adapter_dir = tmp_path / "adapter"
    base_vocab = len(load_tokenizer(spec.name_or_path, spec))

    model, tokenizer = load_trained(spec, str(adapter_dir), placement=CPU)  # from the saved folder only
    sql_id = tokenizer.convert_tokens_to_ids("<sql>")
    assert len(tokenizer) == base_vocab + 1 and sql_id == base_vocab
    assert model.get_input_embeddings().weight.shape[0] == base_vocab + 1
    # Only the new token's rows were trained, and training moved them.
    saved = load_file(str(adapter_dir / "adapter_model.safetensors"))
    deltas = [v for k, v in saved.items() if "trainable_tokens_delta" in k]
    assert deltas and all(d.shape == (1, 64) and d.abs().sum() > 0 for d in deltas)
    ids = tokenizer("customers | <sql> | SQL: ", return_tensors="pt")
    generated = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > (1 if kind == "seq2seq" else ids["input_ids"].shape[1])

    # The order people get wrong: the adapter onto a base with the base's own vocabulary.
    with pytest.raises((RuntimeError, IndexError)):
        PeftModel.from_pretrained(load_base(spec, None, CPU), str(adapter_dir))


def lora_gradients(model, batch) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def gradients_after_an_eval_forward(model, batch) -> dict[str, torch.Tensor]:
    model.eval()
    with torch.no_grad():
        model(**batch)
    model.train()
    return lora_gradients(model, batch)


def has_avx512_bf16() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.is_file() and "avx512_bf16" in cpuinfo.read_text()


def test_qlora_gradients_on_cpu_are_exact_after_an_eval_forward(tiny):
    # bitsandbytes on AVX512-BF16 CPUs switches 4-bit layers to a kernel without autograd after an eval
    # forward under no_grad (shared notes §5); load_base turns that off. An eval forward must not change
    # the gradients.
    spec, adapter = ModelSpec(**model_spec(tiny)), AdapterSpec(method="qlora", rank=8, alpha=16, dropout=0.0)
    tokenizer = load_tokenizer(spec.name_or_path, spec)
    batch = tokenizer(["SELECT name FROM customers WHERE city = 'Oslo'"], return_tensors="pt")
    batch["labels"] = batch["input_ids"].clone()

    def fresh():
        torch.manual_seed(0)
        model = new_adapter(load_base(spec, adapter, CPU), adapter, "causal")
        for name, param in model.named_parameters():
            if "lora_B" in name:  # B starts at zero, which would leave lora_A without a gradient
                torch.nn.init.normal_(param, std=0.02)
        return model

    reference = lora_gradients(fresh(), batch)
    after_eval = gradients_after_an_eval_forward(fresh(), batch)
    assert reference.keys() == after_eval.keys() and len(reference) >= 8
    for name, grad in reference.items():
        assert grad.abs().sum() > 0, name
        assert torch.allclose(grad, after_eval[name], rtol=1e-4, atol=1e-7), name

    if has_avx512_bf16():  # show that this test would catch the bug: without the fix, gradients go wrong
        import bitsandbytes as bnb

        broken = fresh()
        for module in broken.modules():
            if isinstance(module, bnb.nn.Linear4bit):
                module.support_avx512bf16_for_cpu = True
        wrong = gradients_after_an_eval_forward(broken, batch)
        assert any(not torch.allclose(reference[n], wrong[n], rtol=1e-4, atol=1e-7) for n in reference)


def test_base_loads_in_fp32_on_cpu_whatever_dtype_it_was_saved_in(tiny, tmp_path):
    spec = ModelSpec(**model_spec(tiny))
    load_base(spec, None, CPU).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    load_tokenizer(spec.name_or_path, spec).save_pretrained(tmp_path / "bf16")
    model = load_base(ModelSpec(name_or_path=str(tmp_path / "bf16"), kind="causal"), None, CPU)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_max_positions_of_absolute_and_relative_position_models(tiny):
    from transformers import AutoConfig, GPT2Config, T5Config

    assert max_positions(AutoConfig.from_pretrained(tiny["tiny-llama"])) == 512
    assert max_positions(GPT2Config(n_positions=256)) == 256
    assert max_positions(AutoConfig.from_pretrained(tiny["tiny-t5"])) is None
    assert max_positions(T5Config(n_positions=512)) is None  # t5-base's config says 512; nothing limits it


def bf16_weights_on_cpu():
    """The placement a bf16 GPU gets (bf16 weights), on this CPU: what peft leaves in bf16 shows here too."""
    from dataclasses import replace

    return replace(CPU, precision="bf16", load_dtype=torch.bfloat16, compute_dtype=torch.bfloat16)


@pytest.mark.parametrize("kind", ["causal", "seq2seq"])
def test_modules_to_save_copies_do_not_train_in_bf16(tiny, tmp_path, kind):
    # peft upcasts LoRA weights to fp32 but left modules_to_save copies (and added-token rows) in the load
    # dtype: AdamW then kept bf16 weights and bf16 moments on every bf16 GPU.
    spec = ModelSpec(**model_spec(tiny, kind))
    placement = bf16_weights_on_cpu()
    adapter = AdapterSpec(
        rank=8, modules_to_save=["lm_head"], allow_full_modules=True, max_trainable_percent=100
    )
    model = new_adapter(load_base(spec, None, placement), adapter, kind)
    trainable = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
    assert any(".modules_to_save." in n for n in trainable)
    assert set(trainable.values()) == {torch.float32}, trainable
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16}  # the base stays as loaded: only what trains is upcast
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as the Trainer runs a bf16 step
        extra = {"decoder_input_ids": ids} if kind == "seq2seq" else {}
        loss = model(input_ids=ids, labels=ids, **extra).loss
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if ".modules_to_save." in n and p.requires_grad]
    assert grads and all(g is not None and g.dtype == torch.float32 for g in grads)

    # A later stage continues the saved adapter: its trainable copies are fp32 again.
    model.save_pretrained(tmp_path / "adapter")
    load_tokenizer(spec.name_or_path, spec).save_pretrained(tmp_path / "adapter")
    again, _ = load_trained(spec, str(tmp_path / "adapter"), trainable=True, placement=placement)
    assert {p.dtype for p in again.parameters() if p.requires_grad} == {torch.float32}
