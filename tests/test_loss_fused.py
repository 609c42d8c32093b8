"""Issue 29 (2): the trainer's one loss, with the output layer fused in (train/loss.py). On a CPU the fused
path runs torch's chunked equivalent of Liger's kernel (Liger's own is a GPU-only check, in bench/gpu_check);
what is checked here is the wiring every model kind goes through: the output layer hands back the hidden
states at the target positions for the step, the loss applies its weight, and loss and gradients equal the plain path's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSeq2SeqLM

from bench import preflight_memory as bench
from core.config import AdapterSpec
from core.split import MemoryFigures, StepLine, choose, usable_gb
from train.loss import TargetTokenLoss, chunk_size, chunked_linear_cross_entropy, fusable
from train.model import new_adapter

LOADERS = {
    "causal": ("tiny-llama", AutoModelForCausalLM),
    "seq2seq": ("tiny-t5", AutoModelForSeq2SeqLM),
    "image-text": ("tiny-qwen-vl", AutoModelForImageTextToText),
}


def test_chunks_are_livers_power_of_two_holding_about_the_hidden_states_worth_of_logits():
    # 8192 tokens, H 896, V 151,936: factor ceil(V / H) = 170, ceil(8192 / 170) = 49 → 64
    assert chunk_size(8192, 896, 151_936) == 64
    assert chunk_size(10, 64, 100) == 8  # factor 2, ceil(10 / 2) = 5 → 8
    assert chunk_size(3, 512, 100) == 3  # one chunk of every token, never more


def test_the_chunked_loss_and_its_gradients_equal_the_plain_cross_entropy():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    weight = torch.randn(100, 16, requires_grad=True)
    targets = torch.randint(0, 100, (37,))
    targets[::5] = -100
    chunked = chunked_linear_cross_entropy(hidden, weight, targets, "sum")
    chunked.backward()
    hidden2, weight2 = hidden.detach().requires_grad_(), weight.detach().clone().requires_grad_()
    plain = torch.nn.functional.cross_entropy(
        hidden2 @ weight2.t(), targets, ignore_index=-100, reduction="sum"
    )
    plain.backward()
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-6)
    assert torch.allclose(hidden.grad, hidden2.grad, atol=1e-5)
    assert torch.allclose(weight.grad, weight2.grad, atol=1e-5)


def model_and_batch(tiny, kind: str):
    name, loader = LOADERS[kind]
    torch.manual_seed(0)
    base = loader.from_pretrained(tiny[name], dtype=torch.float32)
    model = new_adapter(base, AdapterSpec(rank=8, alpha=16, dropout=0.0, max_trainable_percent=100), kind)
    vocab = base.get_output_embeddings().weight.shape[0]
    ids = torch.randint(4, vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :5] = -100  # the prompt, masked out
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def step(model, batch: dict, loss: TargetTokenLoss):
    model.zero_grad(set_to_none=True)
    inputs = dict(batch)
    labels = inputs.pop("labels")
    if "decoder_input_ids" not in inputs and hasattr(
        model.get_base_model(), "prepare_decoder_input_ids_from_labels"
    ):
        inputs["decoder_input_ids"] = model.get_base_model().prepare_decoder_input_ids_from_labels(
            labels=labels
        )
    with loss.output_at_targets(model, labels):
        value = loss(model(**inputs), labels)
    value.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return value.item(), grads


@pytest.mark.parametrize("kind", ["causal", "seq2seq", "image-text"])
def test_a_fused_step_trains_what_the_plain_step_trains_for_each_model_kind(tiny, kind):
    model, batch = model_and_batch(tiny, kind)
    assert fusable(model) is None
    shifted = kind != "seq2seq"
    plain_loss, plain_grads = step(model, batch, TargetTokenLoss(shifted))
    fused_loss, fused_grads = step(model, batch, TargetTokenLoss(shifted, fused=chunked_linear_cross_entropy))
    assert fused_loss == pytest.approx(plain_loss, rel=1e-5)
    for name, grad in plain_grads.items():
        assert torch.allclose(fused_grads[name], grad, rtol=1e-4, atol=1e-6), name
    # after the step the output layer computes logits again (generation, the eval job)
    layer = model.get_output_embeddings()
    assert layer(torch.zeros(1, layer.in_features)).shape[-1] == layer.out_features


def test_an_eval_step_under_the_fused_loss_gives_the_per_example_rows_of_the_plain_one(tiny):
    model, batch = model_and_batch(tiny, "causal")
    rows = []
    for fused in (None, chunked_linear_cross_entropy):
        loss = TargetTokenLoss(True, fused=fused)
        inputs = dict(batch)
        labels = inputs.pop("labels")
        with torch.no_grad(), loss.output_at_targets(model, labels):
            loss(model(**inputs), labels)
        rows.append(loss.rows)
    assert torch.allclose(rows[0], rows[1], rtol=1e-5)


def test_an_adapted_output_layer_is_not_fused(tiny):
    name, loader = LOADERS["causal"]
    base = loader.from_pretrained(tiny[name])
    spec = AdapterSpec(rank=8, target_modules=["q_proj", "lm_head"], max_trainable_percent=100)
    assert "output layer" in fusable(new_adapter(base, spec, "causal"))


@pytest.mark.slow
def test_the_memory_model_knows_the_fused_path_saves_the_logits(tmp_path):
    """Qwen's 152k vocabulary on a small model: the logits and the loss are most of the step, and a fused
    loss removes them (preflight counts them; the GPU check compares with the measured peak)."""
    from train.memory_figures import measure_memory

    kind, batch, length = "causal", 4, 128
    changes = {"from": bench.ROOT / "models" / "tiny-llama" / "config.json", "hidden_size": 64}
    folder = bench.model_folder(
        tmp_path, "model", changes | {"intermediate_size": 128, "vocab_size": 32000}, kind
    )
    job = bench.bench_job(folder, kind, {}, batch, False)
    shape = {
        "batch_size": batch,
        "max_length": length,
        "max_target_length": length,
        "gradient_checkpointing": False,
        "grad_accum": 2,
    }
    plain = measure_memory(job, shape, None)
    fused = measure_memory(job, shape, None, fused=True)
    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    logits_gb = batch * length * vocab * 4 / 1e9  # one fp32 copy of the logits
    assert fused.activations_per_example_gb < plain.activations_per_example_gb
    assert plain.activations_gb - fused.activations_gb > logits_gb  # at least the fp32 logits are gone


def test_the_fused_loss_is_chosen_only_where_it_buys_a_larger_micro_batch():
    plain = MemoryFigures(plain=(StepLine(2.0, 4.0),), checkpointed=(StepLine(2.0, 1.0),))
    fused = MemoryFigures(plain=(StepLine(2.0, 1.0),), checkpointed=(StepLine(2.0, 0.5),))
    # 80 GB (76 usable): plain fits 16 (2 + 64 = 66) already: the plain loss, which is faster at equal size
    roomy = choose(plain, usable_gb(80), 16, fused=fused)
    assert (roomy.micro_batch, roomy.fused_loss) == (16, False)
    # 40 GB (38 usable): plain fits 8 (34), fused 16 (18): the fused loss, for the larger micro-batch
    tight = choose(plain, usable_gb(40), 16, fused=fused)
    assert (tight.micro_batch, tight.grad_accum, tight.fused_loss) == (16, 1, True)
    assert "fused" in tight.describe() and "the plain one: micro 8" in tight.reason
