"""GPU memory of one training step, estimated on the meta device: no weights read, no GPU.

    peak ≈ weights + trainable state (param, grad, AdamW m and v) + activations + CUDA reserve

Activations are not guessed from a formula: the adapted model runs one forward on meta tensors of the job's
shape (batch × max_length) under `torch.autograd.graph.saved_tensors_hooks`, and the bytes of every tensor
autograd saves for the backward are summed. Meta tensors carry shapes and dtypes only, so this costs
milliseconds even for a 7B model, and it follows the model's real code (attention kind, MLP width, LoRA
dropout, the loss's fp32 logits). bench/preflight_memory.py checks it against a real CPU step.

Assumptions, stated so a user can judge them: a bf16-capable GPU (train/device.py: auto and bf16 → bf16
weights; fp16 and fp32 → fp32 weights); peft keeps adapter weights in fp32; AdamW holds two fp32 moments; a
4-bit weight takes half a byte plus its quantization constants; batches are padded to at most max_length.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from unittest.mock import patch

import torch

from train.vl import is_vision

GB = 1024**3
CUDA_RESERVE_GB = 1.0  # CUDA context, cuBLAS workspace and allocator fragmentation
NF4_BYTES = 0.5 * (1 + 32 / 64 / 4 / 8)  # 4 bits, plus one fp32 absmax per 64 weights (double-quantized)
TRAINABLE_BYTES = 4 + 4 + 8  # fp32 weight, its gradient, AdamW's two moments


@dataclass(frozen=True)
class MemoryEstimate:
    weights_gb: float
    trainable_state_gb: float  # adapter weights, gradients and AdamW moments
    activations_gb: float  # at the job's batch size and length
    activations_shared_gb: float  # the part of activations_gb that does not grow with the batch
    activations_per_example_gb: float
    total_gb: float

    def as_dict(self) -> dict:
        return asdict(self)

    def total_at(self, batch_size: int) -> float:
        return self.fixed_gb + batch_size * self.activations_per_example_gb

    @property
    def fixed_gb(self) -> float:
        return self.weights_gb + self.trainable_state_gb + self.activations_shared_gb + CUDA_RESERVE_GB


def weight_dtype(precision: str) -> torch.dtype:
    """The dtype weights are loaded in on a bf16 GPU (train/device.py's table for CUDA)."""
    return torch.bfloat16 if precision in ("auto", "bf16") else torch.float32


def saved_activation_bytes(model, inputs: dict) -> int:
    """Bytes autograd saves for the backward during one forward: parameters and views of them (a Linear
    saves its weight transposed) are not activations; a tensor saved by several operations is counted once."""
    saved: dict[int, int] = {}

    def pack(tensor):
        if not isinstance(tensor, torch.nn.Parameter) and not isinstance(tensor._base, torch.nn.Parameter):
            storage = tensor.untyped_storage()  # an expanded view costs its storage, not its shape
            saved[storage._cdata] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), meta_forward():
        model(**inputs)
    return sum(saved.values())


@contextmanager
def meta_forward():
    """Make a forward on meta tensors save what a real one saves. The mask helpers' data questions ("is
    this mask all ones?") cannot be answered on meta tensors: they take the branch they take under
    torch.compile, which asks none. SDPA on meta tensors falls back to its math form, which saves the
    whole attention matrix; every real device runs a fused kernel that saves only q, k, v, the output and
    a log-sum-exp row, so the fused op (which has a meta implementation) stands in for it."""
    from transformers import masking_utils

    with (
        patch.object(masking_utils, "is_tracing", lambda *args, **kwargs: True),
        patch.object(torch.nn.functional, "scaled_dot_product_attention", fused_sdpa),
    ):
        yield


MATH_SDPA = torch.nn.functional.scaled_dot_product_attention


def fused_sdpa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    if attn_mask is not None and attn_mask.requires_grad:  # a learned bias (T5): no fused kernel takes it
        return MATH_SDPA(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    if key.shape[-3] != query.shape[-3]:  # grouped-query attention: fused kernels read shared k, v heads
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
    output, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    return output


def step_inputs(kind: str, batch: int, length: int, target_length: int | None, device) -> dict:
    """A batch of the job's padded shape, with the attention mask the collator adds."""
    ids = torch.zeros(batch, length, dtype=torch.long, device=device)
    mask = torch.ones(batch, length, dtype=torch.long, device=device)
    if kind == "seq2seq":
        labels = torch.zeros(batch, target_length or length, dtype=torch.long, device=device)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def activation_bytes(
    model, kind: str, batch: int, length: int, target_length: int | None, checkpointing: bool
) -> int:
    """At a batch of this shape. With gradient checkpointing only each layer's input is kept, and one
    layer's full activations live again while its backward runs."""
    device = next(model.parameters()).device
    inputs = step_inputs(kind, batch, length, target_length, device)
    model.train()
    full = saved_activation_bytes(model, inputs)
    if not checkpointing:
        return full
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        kept = saved_activation_bytes(model, inputs)
    finally:
        base.gradient_checkpointing_disable()
    return kept + full // max(1, layer_count(base.config))


def activation_line(model, kind: str, length: int, target_length: int | None, checkpointing: bool):
    """(shared, per example) bytes: activations grow linearly with the batch, from a part every example
    shares (T5's position bias, a broadcast mask), so two batch sizes give the whole line."""
    one, two = (activation_bytes(model, kind, b, length, target_length, checkpointing) for b in (1, 2))
    return max(0, 2 * one - two), two - one


def layer_count(config) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None) or getattr(text, "num_layers", 1)
    return layers + (getattr(text, "num_decoder_layers", None) or 0)


def weight_bytes(model, qlora: bool, dtype: torch.dtype) -> float:
    """Frozen weights: 4-bit for the Linear layers bitsandbytes quantizes (all but the output layer) under
    QLoRA, else `dtype`; trainable ones are counted with their optimizer state instead."""
    output = model.get_output_embeddings()
    output_weight = output.weight if output is not None else None
    quantized = set()
    if qlora:
        for name, module in model.named_modules():
            # The vision tower of an image-text model stays out of 4-bit (train/model.py load_base).
            if (
                isinstance(module, torch.nn.Linear)
                and "lora_" not in name
                and module is not output
                and not is_vision(name)
            ):
                quantized.add(id(module.weight))
    total = 0.0
    for param in dict(model.named_parameters()).values():
        if param.requires_grad:
            continue
        size = NF4_BYTES if id(param) in quantized and param is not output_weight else dtype.itemsize
        total += param.numel() * size
    return total


def estimate(model, kind: str, qlora: bool, precision: str, shape: dict) -> MemoryEstimate:
    """`model`: the adapted model on the meta device, in weight_dtype(precision). `shape`: batch_size,
    max_length, max_target_length, gradient_checkpointing."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shared, per_example = activation_line(
        model, kind, shape["max_length"], shape["max_target_length"], shape["gradient_checkpointing"]
    )
    weights = weight_bytes(model, qlora, weight_dtype(precision)) / GB
    state = trainable * TRAINABLE_BYTES / GB
    activations = (shared + shape["batch_size"] * per_example) / GB
    total = weights + state + activations + CUDA_RESERVE_GB
    return MemoryEstimate(weights, state, activations, shared / GB, per_example / GB, total)


def largest_batch(estimate_: MemoryEstimate, gpu_mem_gb: float) -> int:
    """The largest batch whose step fits in `gpu_mem_gb` (0: not even one example)."""
    room = gpu_mem_gb - estimate_.fixed_gb
    if room <= 0 or estimate_.activations_per_example_gb <= 0:
        return 0
    return math.floor(room / estimate_.activations_per_example_gb)
