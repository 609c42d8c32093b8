"""Base model, tokenizer and adapter, loaded in the only order that works.

Added tokens: the tokenizer is saved with the adapter, and loading goes tokenizer (from the adapter folder)
→ base → resize to the tokenizer → `PeftModel.from_pretrained`. Resizing after the adapter, or loading the
base's own tokenizer, fails with a size mismatch or silently drops the new tokens.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

from peft import LoraConfig, PeftModel, TaskType, get_peft_model, prepare_model_for_kbit_training
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    BitsAndBytesConfig,
)

from core.config import AdapterSpec, DataSpec, ModelSpec
from core.conversations import templated
from train import vl
from train.chat import text_tokenizer, use_template
from train.device import TRAINABLE_DTYPE, Placement
from train.hub_cache import fetch_hint, require_tokenizer_files

log = logging.getLogger("train.model")


class TrainableTooLarge(RuntimeError):
    """A "LoRA" setup that would train a large share of the model; names the modules responsible."""


def model_class(kind: str):
    return {"seq2seq": AutoModelForSeq2SeqLM, "image-text": AutoModelForImageTextToText}.get(
        kind, AutoModelForCausalLM
    )


def load_tokenizer(source: str, spec: ModelSpec, data: DataSpec | None = None):
    """The tokenizer; for image-text the processor (tokenizer + image processor, with data's pixel bounds).
    Conversations' chat template is set on it here (train/chat.py), so it is saved with the adapter."""
    if spec.kind == "image-text":
        from train.vl_processor import load_processor  # Qwen's processors: image-text jobs only

        tokenizer = load_processor(source, spec, data)
    else:
        revision = spec.revision if source == spec.name_or_path else None
        with fetch_hint(source, revision):
            tokenizer = AutoTokenizer.from_pretrained(source, revision=revision)
        require_tokenizer_files(source, revision)
        if tokenizer.pad_token is None:  # Llama-style tokenizers ship none; eos is the usual stand-in
            tokenizer.pad_token = tokenizer.eos_token
    if data is not None and templated(data, spec.kind):
        use_template(tokenizer, data, spec.name_or_path, spec.added_tokens)
    return tokenizer


def load_base(spec: ModelSpec, adapter: AdapterSpec | None, placement: Placement):
    """The base model on `placement.device`, its weights in `placement.load_dtype`; 4-bit when the adapter
    is QLoRA. Loaded straight onto the device (no CPU copy first), for LoRA as for QLoRA.

    The dtype is always explicit: transformers 5 otherwise loads whatever the checkpoint was saved in, and a
    bf16 checkpoint would then train in bf16 on a CPU that was asked for fp32."""
    kwargs: dict = {
        "revision": spec.revision,
        "dtype": placement.load_dtype,
        "device_map": {"": placement.device},
    }
    qlora = adapter is not None and adapter.method == "qlora"
    if qlora:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=adapter.quant_type,
            bnb_4bit_use_double_quant=adapter.double_quant,
            bnb_4bit_compute_dtype=placement.compute_dtype,
            # The vision tower stays in the load dtype: "model.visual", not "visual" (that one quantizes it).
            llm_int8_skip_modules=vl.NOT_QUANTIZED if spec.kind == "image-text" else None,
        )
    with fetch_hint(spec.name_or_path, spec.revision):
        model = model_class(spec.kind).from_pretrained(spec.name_or_path, **kwargs)
    if qlora and not placement.cuda:
        avoid_cpu_inference_repack(model)  # right after loading: before anything can run an eval forward
    return model


def max_positions(config) -> int | None:
    """The longest sequence the model's position embeddings cover; None for relative positions (T5: its
    configs may still carry an `n_positions` that limits nothing)."""
    if getattr(config, "relative_attention_num_buckets", None) is not None:
        return None
    config = getattr(config, "text_config", None) or config  # a vision-language model's language model
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def avoid_cpu_inference_repack(model) -> None:
    """bitsandbytes on CPUs with AVX512-BF16 repacks a 4-bit weight for inference after any eval forward
    under no_grad; from then on it calls a kernel without autograd and gradients are silently wrong
    (see shared notes, tiny-models §5). Turning the repack off keeps training exact."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def add_tokens(model, tokenizer, tokens: list[str]) -> list[int]:
    """Add `tokens` as special tokens and grow the embeddings to the tokenizer; returns the new ids."""
    tokenizer = text_tokenizer(tokenizer)
    before = len(tokenizer)
    if tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)})
    # Only ever grow: hub checkpoints often carry spare rows beyond the tokenizer (Qwen: 151,936 rows for
    # 151,665 tokens), and shrinking them changes the output layer for nothing.
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))
    return list(range(before, len(tokenizer)))


def token_rows(model, token_ids: list[int]) -> dict[str, list[int]] | None:
    """Where added tokens are trained: only their rows of the input embedding, and of the output layer
    when it is not tied to it (peft trainable tokens; the full matrices would be tens of percent)."""
    if not token_ids:
        return None
    names = {module: name.split(".")[-1] for name, module in model.named_modules()}
    rows = {names[model.get_input_embeddings()]: token_ids}
    output = model.get_output_embeddings()
    if output is not None and output.weight is not model.get_input_embeddings().weight:
        rows[names[output]] = token_ids
    return rows


def new_adapter(model, spec: AdapterSpec, kind: str, added_token_ids: list[int] | None = None):
    if spec.method == "qlora":
        # Gradient checkpointing is the Trainer's business (train.gradient_checkpointing), not a side effect.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    config = LoraConfig(
        task_type=TaskType.SEQ_2_SEQ_LM if kind == "seq2seq" else TaskType.CAUSAL_LM,
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=vl.lora_targets(model, spec.target_modules, spec.train_vision)
        if kind == "image-text"
        else spec.target_modules,
        modules_to_save=spec.modules_to_save or None,
        trainable_token_indices=token_rows(model, added_token_ids or []),
    )
    return trainable_in_fp32(get_peft_model(model, config))


def trainable_in_fp32(model):
    """Every trainable parameter in train.device's TRAINABLE_DTYPE (fp32), the frozen base as loaded. Under
    bf16 autocast the fp32 copies run in bf16 like their neighbours; only the update is kept exact."""
    for param in model.parameters():
        if param.requires_grad and param.dtype != TRAINABLE_DTYPE:
            param.data = param.data.to(TRAINABLE_DTYPE)
    return model


def load_trained(
    model_spec: ModelSpec,
    adapter_dir: str,
    quantize: AdapterSpec | None = None,
    trainable: bool = False,
    *,
    placement: Placement,
    data: DataSpec | None = None,
):
    """(model, tokenizer) from a saved adapter, in the one order that works with added tokens: tokenizer from
    the adapter folder → base → resize to len(tokenizer) → PeftModel.from_pretrained. Used by later stages
    (trainable=True) and by the eval job; `quantize` is the adapter spec a QLoRA adapter was trained with;
    `placement` the device and dtype to load onto (train.device); `data` the pixel bounds (image-text)."""
    tokenizer = load_tokenizer(adapter_dir, model_spec, data)
    base = load_base(model_spec, quantize, placement)
    vocabulary = len(text_tokenizer(tokenizer))
    if vocabulary > base.get_input_embeddings().weight.shape[0]:
        base.resize_token_embeddings(vocabulary)
    if quantize is not None and quantize.method == "qlora" and trainable:
        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=trainable)
    return (trainable_in_fp32(model) if trainable else model), tokenizer


@dataclass(frozen=True)
class TrainableParams:
    trainable: int
    total: int
    by_module: dict[str, int]  # trainable parameters per module kind ("lora", "embed_tokens", ...)

    @property
    def percent(self) -> float:
        return 100 * self.trainable / self.total


def module_kind(name: str) -> str:
    """What a trainable parameter belongs to, in the words a config uses."""
    if "lora_" in name:
        return "lora"
    if ".modules_to_save." in name:
        return name.split(".modules_to_save.")[0].split(".")[-1]
    if "trainable_tokens_delta" in name:
        return "added token rows of " + name.split(".token_adapter.")[0].split(".")[-1]
    return name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name


def trainable_report(model) -> TrainableParams:
    """Trainable and total parameters, each real parameter once; 4-bit weights are packed two to a byte and
    counted unpacked. peft keeps a frozen copy of every modules_to_save layer (`original_module`) that no
    forward uses while the adapter is on: counting it would understate the trainable share."""
    trainable, total, by_module = 0, 0, defaultdict(int)
    for name, param in model.named_parameters():
        if ".original_module." in name:
            continue
        count = param.numel() * (2 if getattr(param, "quant_type", None) else 1)
        total += count
        if param.requires_grad:
            trainable += count
            by_module[module_kind(name)] += count
    return TrainableParams(trainable, total, dict(by_module))


def check_trainable(model, limit_percent: float) -> TrainableParams:
    """Log the trainable share; raise TrainableTooLarge, naming the modules responsible, above the limit."""
    report = trainable_report(model)
    log.info(
        "trainable parameters: %s of %s (%.2f%%); by module: %s",
        f"{report.trainable:,}",
        f"{report.total:,}",
        report.percent,
        report.by_module,
    )
    if report.percent > limit_percent:
        culprits = sorted(((n, c) for n, c in report.by_module.items() if n != "lora"), key=lambda x: -x[1])
        if culprits:
            named = ", ".join(f"{n} ({c:,} params)" for n, c in culprits)
            hint = f"responsible: {named}; remove them from adapter.modules_to_save"
        else:
            hint = "the LoRA layers alone are this large: lower adapter.rank or target fewer modules"
        raise TrainableTooLarge(
            f"{report.percent:.1f}% of the model would be trainable ({report.trainable:,} of "
            f"{report.total:,} parameters; limit adapter.max_trainable_percent = {limit_percent:g}%); "
            f"{hint}, or raise the limit"
        )
    return report


def adapter_differences(model, spec: AdapterSpec) -> list[str]:
    """How a loaded adapter's LoRA settings differ from `spec` (a later stage keeps the loaded ones)."""
    config = model.peft_config["default"]
    loaded = {"rank": config.r, "alpha": config.lora_alpha, "dropout": config.lora_dropout}
    wanted = {"rank": spec.rank, "alpha": spec.alpha, "dropout": spec.dropout}
    return [
        f"{k}: adapter has {loaded[k]}, config says {wanted[k]}" for k in loaded if loaded[k] != wanted[k]
    ]
