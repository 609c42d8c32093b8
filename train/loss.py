"""The trainer's one loss, for every model kind (train/recipe.py hands it to the Trainer as compute_loss_func;
train/memory.py runs it on fake tensors to estimate a step's memory), with or without a fused output layer.

    loss = TargetTokenLoss(shifted=True)                            # logits → token-mean cross-entropy
    loss = TargetTokenLoss(shifted=True, fused=liger_linear_cross_entropy)   # hidden states → the same, fused
    with loss.output_at_targets(model, labels):                     # the output layer only where a label is
        value = loss(model(**inputs), labels)

Logits only where the loss is: a prompt-heavy example (a 240-token prompt, a 30-token answer) has no label at
~88 % of its positions, and the output layer (151,936 x 896 in Qwen2.5-0.5B: a quarter of its forward) would
compute logits there for nothing, forward and backward. `output_at_targets` makes the output layer, for one
step, gather the hidden states at the positions that carry a target (the label of the next position for a
causal or image-text model, the decoder position's own for seq2seq) and apply itself there only; the loss gets
those logits, one row per target token. Whatever a model does after its output layer (Gemma's soft-capping,
a logit scale) runs on them unchanged, element by element. transformers' own `logits_to_keep` does not serve:
one index list for the whole batch (the union of every row's positions), and T5 does not take it.

Fused: with a 152k vocabulary the logits (their fp32 copy and their gradient) are what stop a bigger
micro-batch. A fused linear cross-entropy (Liger Kernel's, on CUDA) computes the output layer and the loss
chunk by chunk and never holds the logits. The output layer then hands the loss the gathered hidden states
(whatever the model kind does before it, T5's scaling of tied embeddings included, stays in the model's own
code), and the loss applies the layer's weight itself. Only for an output layer that is a plain Linear
without bias, not adapted (`fusable`), and only where the batch split chose it (core/split.py: where it lets a
larger micro-batch fit). `chunked_linear_cross_entropy` is the same computation in torch, chunked as Liger
chunks: the memory model runs it on fake tensors (Triton kernels cannot), and it is the reference the GPU
check compares against.
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
    (position i targets token i+1), as the Trainer counts them (labels[..., 1:] unless encoder-decoder).

    The outputs' logits are either the model's whole (batch, length, vocabulary) or, under
    `output_at_targets`, one row per target token in the order of `target_positions`: the same loss."""

    def __init__(self, shifted: bool, fused: LinearCrossEntropy | None = None):
        self.shifted = shifted
        self.fused = fused  # None: the output layer gives logits; else hidden states, and this applies it
        self.output_weight: torch.Tensor | None = None  # set by output_at_targets while a fused step runs
        self.rows: torch.Tensor | None = (
            None  # the last eval batch's (summed loss, target tokens) per example
        )
        self.positions: torch.Tensor | None = None  # set by output_at_targets for the step it wraps

    def aligned(self, labels: torch.Tensor) -> torch.Tensor:
        """The target of each position: a causal model's position i predicts token i+1."""
        if self.shifted:
            return torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[..., 1:]
        return labels

    def target_positions(self, labels: torch.Tensor) -> torch.Tensor:
        """The flat indices (into batch x length) of the positions that carry a target, in order."""
        return flat_targets(self.aligned(labels))

    def __call__(self, outputs, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        scores = outputs["logits"]  # logits, or under a fused step the hidden states
        labels = self.aligned(labels).to(scores.device)
        positions = self.positions if self.positions is not None else flat_targets(labels)
        positions = positions.to(scores.device)
        if scores.shape[:-1] == labels.shape:  # the whole sequence's: keep the target positions' rows
            scores = scores.flatten(0, -2).index_select(0, positions)
        scores = scores.reshape(-1, scores.shape[-1])
        targets = labels.flatten().index_select(0, positions)
        total = num_items_in_batch if num_items_in_batch is not None else targets.numel()
        if self.output_weight is not None and torch.is_grad_enabled():
            # Training: the summed loss, its gradients computed inside the fused pass (no per-token tensor).
            return self.fused(scores.to(self.output_weight.dtype), self.output_weight, targets, "sum") / total
        if self.output_weight is not None:
            hidden = scores.to(self.output_weight.dtype)
            token_losses = self.fused(hidden, self.output_weight, targets, "none")
        else:
            token_losses = torch.nn.functional.cross_entropy(scores.float(), targets, reduction="none")
        self.rows = self.per_example(token_losses, positions, labels).detach()
        return token_losses.sum() / total

    @staticmethod
    def per_example(
        token_losses: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        """(summed loss, target tokens) per example of the batch."""
        examples, length = labels.shape[0], labels.shape[-1]
        summed = token_losses.new_zeros(examples).index_add_(0, positions // length, token_losses)
        return torch.stack([summed, labels.ne(IGNORE).sum(-1).to(summed.dtype)], -1)

    @contextmanager
    def output_at_targets(self, model, labels: torch.Tensor | None, positions: torch.Tensor | None = None):
        """For one step: the model's output layer applies itself only at the positions that carry a target
        (or, with a fused loss, hands back the hidden states there and this loss applies the layer's
        weight). `positions`: target_positions(labels), when the caller has them (the memory model runs on
        fake tensors, which cannot count). Without labels (no loss to compute) nothing changes."""
        if labels is None:
            yield
            return
        positions = self.target_positions(labels) if positions is None else positions
        layer = unwrapped(model).get_output_embeddings()
        own = vars(layer).get("forward")  # an instance's own forward (accelerate's hooks), kept
        apply = passthrough if self.fused is not None else layer.forward
        shape = labels.shape
        layer.forward = lambda hidden: at_positions(apply, positions, shape, hidden)
        self.positions = positions
        self.output_weight = layer.weight if self.fused is not None else None
        try:
            yield
        finally:
            if own is None:
                del layer.forward  # the class's own forward again
            else:
                layer.forward = own
            self.positions = self.output_weight = None


def flat_targets(aligned: torch.Tensor) -> torch.Tensor:
    """The flat indices of the positions whose aligned label is a target."""
    return aligned.ne(IGNORE).flatten().nonzero()[:, 0]


def at_positions(apply: Callable, positions: torch.Tensor, shape, hidden: torch.Tensor) -> torch.Tensor:
    """`apply` (the output layer, or passthrough) on the hidden states at `positions` (flat indices into
    the labels' batch x length), as one sequence: (1, targets, width)."""
    if hidden.shape[:-1] != shape:
        raise RuntimeError(
            f"the output layer got hidden states of shape {tuple(hidden.shape)} for labels of shape "
            f"{tuple(shape)}: this model's outputs do not line up with its labels (train/loss.py)"
        )
    gathered = hidden.flatten(0, -2).index_select(0, positions.to(hidden.device))
    return apply(gathered)[None]


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
