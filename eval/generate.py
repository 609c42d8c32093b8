"""Batched generation from a fine-tuned model: sorted by length, decoded without prompt or padding."""

from __future__ import annotations

import torch


@torch.inference_mode()
def generate(
    model,
    tokenizer,
    prompts: list[str],
    *,
    kind: str,
    num_beams: int,
    max_new_tokens: int,
    batch_size: int,
    max_length: int | None = None,
) -> list[str]:
    """One output per prompt, in the prompts' order.

    Prompts are batched by length (little padding, so little wasted compute). Causal models pad on the
    left so every prompt ends where generation starts, and only the new tokens are decoded.
    """
    tokenizer.padding_side = "left" if kind == "causal" else "right"
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: list[str] = [""] * len(prompts)
    device = next(model.parameters()).device
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        encoded = tokenizer(
            [prompts[i] for i in batch],
            return_tensors="pt",
            padding=True,
            truncation=max_length is not None,
            max_length=max_length,
            add_special_tokens=True,  # as in training (train/data.py encodes prompts the same way)
        ).to(device)
        generated = model.generate(
            **encoded,
            num_beams=num_beams,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        if kind == "causal":
            generated = generated[:, encoded["input_ids"].shape[1] :]
        texts = tokenizer.batch_decode(generated, skip_special_tokens=True)
        for index, text in zip(batch, texts, strict=True):
            outputs[index] = text.strip()
    return outputs


def adapter_changes_output(model, tokenizer, prompts: list[str], **kwargs) -> bool:
    """Does the adapter change anything? A "fine-tuned" model that generates exactly like its base
    usually means the adapter was never applied (or never trained)."""
    with_adapter = generate(model, tokenizer, prompts, **kwargs)
    with model.disable_adapter():
        base = generate(model, tokenizer, prompts, **kwargs)
    return with_adapter != base
