"""The trainer's one loss, for every model kind (train/recipe.py hands it to the Trainer as compute_loss_func;
train/memory.py runs it on fake tensors to estimate a step's memory)."""

from __future__ import annotations

import torch


class TargetTokenLoss:
    """The Trainer's compute_loss_func, for every model kind: a micro-batch's cross-entropy summed over its
    target tokens, divided by num_items_in_batch, the Trainer's count of the target tokens of the whole
    global batch (all accumulation steps; all ranks, gathered by average_tokens_across_devices, and the
    Trainer's x world size on the loss undoes DDP's mean of the gradients). Summed over the accumulation
    steps and ranks, loss and gradient are the token mean of the global batch.

    Why not the model's own loss (issue 20): transformers 5 believes any forward taking **kwargs normalises
    by num_items_in_batch (Trainer.__init__, model_accepts_loss_kwargs), and then neither divides by the
    accumulation steps (training_step) nor drops its x world size (compute_loss). T5's forward takes
    **kwargs but averages each micro-batch itself: its loss and gradient were grad_accum x ranks too large
    (clipping at max_grad_norm then bit at a fraction of the true norm), its DDP eval loss doubled.
    Qwen2.5-VL says it does not accept them: a mean of per-micro-batch means. Given a compute_loss_func,
    the Trainer counts, gathers and scales alike for every model. Decoder-only predictions are shifted
    (position i targets token i+1), as the Trainer counts them (labels[..., 1:] unless encoder-decoder)."""

    def __init__(self, shifted: bool):
        self.shifted = shifted
        self.rows: torch.Tensor | None = None  # the last batch's (summed loss, target tokens) per example

    def __call__(self, outputs, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        logits = outputs["logits"]
        if self.shifted:
            labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        labels = labels.to(logits.device)
        token_losses = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, -2), labels.flatten(), ignore_index=-100, reduction="none"
        ).view(labels.shape)
        targets = labels.ne(-100).sum(-1)
        self.rows = torch.stack([token_losses.sum(-1), targets.to(token_losses.dtype)], -1).detach()
        total = num_items_in_batch if num_items_in_batch is not None else targets.sum()
        return token_losses.sum() / total
