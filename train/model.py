"""Base model, tokenizer and adapter, loaded in the only order that works.

Added tokens: the tokenizer is saved with the adapter, and loading goes tokenizer (from the adapter folder)
→ base → resize to the tokenizer → `PeftModel.from_pretrained`. Resizing after the adapter, or loading the
base's own tokenizer, fails with a size mismatch or silently drops the new tokens.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer, BitsAndBytesConfig

from train.config import AdapterSpec, ModelSpec

log = logging.getLogger("train.model")


class TrainableTooLarge(RuntimeError):
    """A "LoRA" setup that would train a large share of the model; names the modules responsible."""


def model_class(kind: str):
    return AutoModelForSeq2SeqLM if kind == "seq2seq" else AutoModelForCausalLM


def compute_dtype() -> torch.dtype:
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def load_tokenizer(source: str, spec: ModelSpec):
    tokenizer = AutoTokenizer.from_pretrained(
        source, revision=spec.revision if source == spec.name_or_path else None
    )
    if tokenizer.pad_token is None:  # Llama-style tokenizers ship none; eos is the usual stand-in
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_base(spec: ModelSpec, adapter: AdapterSpec | None):
    """The base model; 4-bit NF4 when the adapter is QLoRA (bitsandbytes, on GPU or CPU)."""
    kwargs: dict = {"revision": spec.revision}
    if adapter is not None and adapter.method == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=adapter.quant_type,
            bnb_4bit_use_double_quant=adapter.double_quant,
            bnb_4bit_compute_dtype=compute_dtype(),
        )
        kwargs["device_map"] = {"": 0} if torch.cuda.is_available() else "cpu"
    model = model_class(spec.kind).from_pretrained(spec.name_or_path, **kwargs)
    if adapter is not None and adapter.method == "qlora":
        avoid_cpu_inference_repack(model)
    return model


def avoid_cpu_inference_repack(model) -> None:
    """bitsandbytes on CPUs with AVX512-BF16 repacks a 4-bit weight for inference after any eval forward
    under no_grad; from then on it calls a kernel without autograd and gradients are silently wrong
    (see shared notes, tiny-models §5). Turning the repack off keeps training exact."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def add_tokens(model, tokenizer, tokens: list[str]) -> None:
    if tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)})
    if len(tokenizer) != model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))


def new_adapter(model, spec: AdapterSpec, kind: str):
    if spec.method == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    config = LoraConfig(
        task_type=TaskType.SEQ_2_SEQ_LM if kind == "seq2seq" else TaskType.CAUSAL_LM,
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=spec.target_modules,
        modules_to_save=spec.modules_to_save or None,
    )
    return get_peft_model(model, config)


def load_trained(
    model_spec: ModelSpec, adapter_dir: str, quantize: AdapterSpec | None = None, trainable: bool = False
):
    """(model, tokenizer) from a saved adapter, in the order that works with added tokens."""
    tokenizer = load_tokenizer(adapter_dir, model_spec)
    base = load_base(model_spec, quantize)
    if len(tokenizer) != base.get_input_embeddings().weight.shape[0]:
        base.resize_token_embeddings(len(tokenizer))
    if quantize is not None and quantize.method == "qlora" and trainable:
        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=trainable)
    return model, tokenizer


def trainable_report(model) -> tuple[int, int, dict[str, int]]:
    """(trainable, total, trainable parameters per top-level module kind) — 4-bit weights counted unpacked."""
    trainable, total, by_module = 0, 0, defaultdict(int)
    for name, param in model.named_parameters():
        count = param.numel() * (2 if getattr(param, "quant_type", None) else 1)
        total += count
        if param.requires_grad:
            trainable += count
            kind = "lora" if "lora_" in name else name.split(".modules_to_save")[0].split(".")[-1]
            by_module[kind] += count
    return trainable, total, dict(by_module)


def check_trainable(model, limit_percent: float) -> float:
    trainable, total, by_module = trainable_report(model)
    percent = 100 * trainable / total
    log.info("trainable parameters: %d of %d (%.2f%%)", trainable, total, percent)
    if percent > limit_percent:
        culprits = sorted(((n, c) for n, c in by_module.items() if n != "lora"), key=lambda x: -x[1])
        if culprits:
            named = ", ".join(f"{n} ({c:,} params)" for n, c in culprits)
            hint = f"responsible: {named}; remove them from adapter.modules_to_save"
        else:
            hint = "the LoRA layers alone are this large: lower adapter.rank or target fewer modules"
        raise TrainableTooLarge(
            f"{percent:.1f}% of the model would be trainable (limit adapter.max_trainable_percent = "
            f"{limit_percent:g}%); {hint}, or raise the limit"
        )
    return percent
