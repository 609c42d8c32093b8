"""Issue 40 (1): the output layer runs only at the positions that carry a target (train/loss.py
output_at_targets), and the loss, the per-example eval rows and every LoRA gradient equal those of the
whole-sequence logits, for each model kind and each way a batch's labels are laid out. The reference is
written here from scratch: the model's own full logits and torch's cross-entropy over the shifted labels."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSeq2SeqLM

from core.config import AdapterSpec
from train.loss import IGNORE, TargetTokenLoss, chunked_linear_cross_entropy
from train.model import new_adapter

LENGTH = 16
LOADERS = {
    "causal": ("tiny-llama", AutoModelForCausalLM),
    "seq2seq": ("tiny-t5", AutoModelForSeq2SeqLM),
    "image-text": ("tiny-qwen-vl", AutoModelForImageTextToText),
}


def layout(name: str, ids: torch.Tensor) -> torch.Tensor:
    """Labels for two rows of LENGTH tokens, the second right-padded (its last 3 positions -100)."""
    labels = ids.clone()
    if name == "answers only":  # prompts of different lengths, masked out
        labels[0, :11] = IGNORE
        labels[1, :4] = IGNORE
    elif name == "multi-turn":  # two answers per row, the user's turns between them masked
        labels[0, :3], labels[0, 6:10] = IGNORE, IGNORE
        labels[1, :5], labels[1, 8:11] = IGNORE, IGNORE
    labels[1, -3:] = IGNORE  # padding, in every layout (train_on: all labels the rest)
    return labels


@pytest.fixture(scope="module")
def models(tiny):
    found = {}
    for kind, (name, loader) in LOADERS.items():
        torch.manual_seed(0)
        base = loader.from_pretrained(tiny[name], dtype=torch.float32)
        targets = ["q_proj", "v_proj", "lm_head"] if kind == "causal" else None
        spec = AdapterSpec(rank=4, alpha=8, dropout=0.0, max_trainable_percent=100)
        if targets:  # an adapted output layer (LoRA on lm_head) goes through the same gathering
            spec = spec.model_copy(update={"target_modules": targets})
        found[kind] = new_adapter(base, spec, kind)
    return found


def batch_for(model, kind: str, labels_layout: str) -> dict:
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(4, vocab, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    labels = layout(labels_layout, ids)
    if kind == "seq2seq":
        inputs["decoder_input_ids"] = model.get_base_model().prepare_decoder_input_ids_from_labels(
            labels=labels
        )
    return {"inputs": inputs, "labels": labels}


def lora_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def full_logits_step(model, batch: dict, shifted: bool):
    """The reference: logits at every position, the mean cross-entropy over the target tokens."""
    model.zero_grad(set_to_none=True)
    logits, labels = model(**batch["inputs"]).logits, batch["labels"]
    if shifted:
        logits, labels = logits[:, :-1], labels[:, 1:]
    losses = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="none"
    ).view(labels.shape)
    value = losses.sum() / labels.ne(IGNORE).sum()
    value.backward()
    return value.item(), lora_grads(model), losses.sum(-1)


def at_targets_step(model, batch: dict, loss: TargetTokenLoss):
    model.zero_grad(set_to_none=True)
    with loss.output_at_targets(model, batch["labels"]):
        value = loss(model(**batch["inputs"]), batch["labels"])
    value.backward()
    with torch.no_grad(), loss.output_at_targets(model, batch["labels"]):
        loss(model(**batch["inputs"]), batch["labels"])  # an eval step: its per-example rows
    return value.item(), lora_grads(model), loss.rows[:, 0]


@pytest.mark.parametrize("labels_layout", ["answers only", "train_on all", "multi-turn"])
@pytest.mark.parametrize("kind", ["causal", "seq2seq", "image-text"])
def test_logits_at_the_targets_only_train_and_evaluate_as_logits_everywhere(models, kind, labels_layout):
    assert_equal_to_full_logits(models[kind], kind, labels_layout, TargetTokenLoss(kind != "seq2seq"))


@pytest.mark.parametrize(
    "kind", ["seq2seq", "image-text"]
)  # the causal model's lm_head is adapted: unfusable
def test_a_fused_loss_at_the_targets_only_trains_as_logits_everywhere(models, kind):
    loss = TargetTokenLoss(kind != "seq2seq", fused=chunked_linear_cross_entropy)
    assert_equal_to_full_logits(models[kind], kind, "multi-turn", loss)


def assert_equal_to_full_logits(model, kind: str, labels_layout: str, loss: TargetTokenLoss) -> None:
    batch = batch_for(model, kind, labels_layout)
    want_loss, want_grads, want_rows = full_logits_step(model, batch, loss.shifted)
    got_loss, got_grads, got_rows = at_targets_step(model, batch, loss)
    assert got_loss == pytest.approx(want_loss, rel=1e-6)
    assert torch.allclose(got_rows, want_rows, rtol=1e-5)
    assert want_grads.keys() == got_grads.keys()
    for name, grad in want_grads.items():
        assert torch.allclose(got_grads[name], grad, rtol=1e-4, atol=1e-7), name


def test_the_output_layer_sees_only_the_target_positions_and_is_whole_again_after(models):
    model = models["causal"]
    batch = batch_for(model, "causal", "answers only")
    loss, seen = TargetTokenLoss(True), []
    layer = model.get_output_embeddings()
    hook = layer.base_layer.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape))
    try:
        with torch.no_grad(), loss.output_at_targets(model, batch["labels"]):
            model(**batch["inputs"])
        model(**batch["inputs"])
    finally:
        hook.remove()
    # row 0: labels from 11 to 15 → targets at positions 10..14 (5); row 1: labels 4..12 → 3..11 (9)
    assert [tuple(shape[:-1]) for shape in seen] == [(14,), (2, LENGTH)]
