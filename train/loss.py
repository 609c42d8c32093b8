"""The trainer's one loss, for every model kind (train/recipe.py hands it to the Trainer as compute_loss_func;
train/memory.py runs it on fake tensors to estimate a step's memory), with or without a fused output layer.

    TargetTokenLoss(shifted=True)                             # logits → token-mean cross-entropy
    TargetTokenLoss(shifted=True, fused=liger_linear_cross_entropy)   # hidden states → the same, fused

Fused: with a 152k vocabulary the logits (their fp32 copy and their gradient) are what stop a bigger
micro-batch. A fused linear cross-entropy (Liger Kernel's, on CUDA) computes the output layer and the loss
chunk by chunk and never holds the logits. The model's forward then hands the loss its last hidden states:
`output_as_hidden` makes the output layer pass its input through for the step (whatever the model kind does
before it, T5's scaling of tied embeddings included, stays in the model's own code), and the loss applies
the output layer's weight itself. Only for an output layer that is a plain Linear without bias, not adapted
(`fusable`), and only where the batch split chose it (core/split.py: where it lets a larger micro-batch fit).
`chunked_linear_cross_entropy` is the same computation in torch, chunked as Liger chunks: the memory model
runs it on fake tensors (Triton kernels cannot), and it is the reference the GPU check compares against.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import contextmanager

import torch

# (hidden (N, H), weight (V, H), targets (N,), reduction "sum" | "none") → the summed loss, or per token
LinearCrossEntropy = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, str], torch.Tensor]
IGNORE = -100


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

    def __init__(self, shifted: bool, fused: LinearCrossEntropy | None = None):
        self.shifted = shifted
        self.fused = fused  # None: the model returns logits; else hidden states, and this applies the layer
        self.output_weight: torch.Tensor | None = None  # set by output_as_hidden while a fused step runs
        self.rows: torch.Tensor | None = (
            None  # the last eval batch's (summed loss, target tokens) per example
        )

    def __call__(self, outputs, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        scores = outputs["logits"]  # logits, or under a fused step the last hidden states
        if self.shifted:
            labels = torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[..., 1:]
        labels = labels.to(scores.device)
        targets = labels.ne(IGNORE).sum(-1)
        total = num_items_in_batch if num_items_in_batch is not None else targets.sum()
        if self.output_weight is not None and torch.is_grad_enabled():
            # Training: the summed loss, its gradients computed inside the fused pass (no per-token tensor).
            hidden = scores.flatten(0, -2).to(self.output_weight.dtype)
            return self.fused(hidden, self.output_weight, labels.flatten(), "sum") / total
        if self.output_weight is not None:
            hidden = scores.flatten(0, -2).to(self.output_weight.dtype)
            token_losses = self.fused(hidden, self.output_weight, labels.flatten(), "none").view(labels.shape)
        else:
            token_losses = torch.nn.functional.cross_entropy(
                scores.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE, reduction="none"
            ).view(labels.shape)
        self.rows = torch.stack([token_losses.sum(-1), targets.to(token_losses.dtype)], -1).detach()
        return token_losses.sum() / total

    @contextmanager
    def output_as_hidden(self, model):
        """For one step of a fused loss: the model's output layer hands back its input (the last hidden
        states, after whatever the model does before it) and this loss applies the layer's weight. Without
        a fused loss, nothing changes."""
        if self.fused is None:
            yield
            return
        layer = unwrapped(model).get_output_embeddings()
        layer.forward = passthrough
        self.output_weight = layer.weight
        try:
            yield
        finally:
            del layer.forward  # the class's own forward again
            self.output_weight = None


def passthrough(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def unwrapped(model):
    """The model under DDP's wrapper (the Trainer's `model` in compute_loss) and peft's."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def fusable(model) -> str | None:
    """Why the model's output layer cannot be fused with the loss, or None when it can: it must be a plain
    Linear without bias, neither adapted (LoRA, modules_to_save, trained token rows) nor soft-capped."""
    base = unwrapped(model)
    layer = base.get_output_embeddings()
    if type(layer) is not torch.nn.Linear:
        return f"its output layer is a {type(layer).__name__} (adapted or not a Linear)"
    if layer.bias is not None:
        return "its output layer has a bias"
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    if getattr(config, "final_logit_softcapping", None):
        return "its logits are soft-capped"
    return None


def liger_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str
) -> torch.Tensor:
    """Liger Kernel's fused linear cross-entropy (CUDA, Triton): the `[gpu]` extra."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction=reduction)(weight, hidden, targets)


def liger_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


def chunk_size(tokens: int, hidden: int, vocabulary: int) -> int:
    """Liger's chunk: enough tokens that a chunk's logits hold about as many values as all the hidden
    states (a power of two, at most every token)."""
    factor = math.ceil(vocabulary / hidden)
    return min(tokens, 1 << max(0, math.ceil(tokens / factor) - 1).bit_length())


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Liger's computation in torch: per chunk of tokens, logits, their log-softmax and, when a gradient is
    wanted, the gradients of the input and of the weight, computed in the forward (so nothing is kept but
    the input's gradient). Returns the summed loss, or the per-token losses (reduction "none", no grad)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, reduction):
        tokens, width = hidden.shape
        size = chunk_size(tokens, width, weight.shape[0])
        wants_grad = reduction == "sum" and (hidden.requires_grad or weight.requires_grad)
        losses = torch.zeros(tokens, dtype=torch.float32, device=hidden.device)
        grad_input = torch.zeros_like(hidden) if wants_grad else None
        grad_weight = torch.zeros_like(weight) if wants_grad and weight.requires_grad else None
        for start in range(0, tokens, size):
            part, target = hidden[start : start + size], targets[start : start + size]
            logits = (part @ weight.t()).float()
            keep = target.ne(IGNORE)
            safe = target.clamp(min=0)
            log_probs = torch.log_softmax(logits, -1)
            losses[start : start + size] = -log_probs.gather(-1, safe[:, None])[:, 0] * keep
            if wants_grad:
                grad = log_probs.exp_()  # softmax, in place
                grad[torch.arange(len(target), device=grad.device), safe] -= 1
                grad = grad.mul_(keep[:, None]).to(hidden.dtype)
                grad_input[start : start + size] = grad @ weight
                if grad_weight is not None:
                    grad_weight += grad.t() @ part
        ctx.save_for_backward(grad_input, grad_weight)
        return losses.sum() if reduction == "sum" else losses

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight = ctx.saved_tensors
        scale = grad_output.to(grad_input.dtype) if grad_input is not None else None
        return (
            None if grad_input is None else grad_input * scale,
            None if grad_weight is None else grad_weight * grad_output.to(grad_weight.dtype),
            None,
            None,
        )


def chunked_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str
) -> torch.Tensor:
    return ChunkedLinearCrossEntropy.apply(hidden, weight, targets, reduction)
