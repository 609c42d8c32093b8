"""Vision-language examples (`model.kind: image-text`): chat prompts, lengths with the image tokens counted,
the answer-only collator, and which layers LoRA may touch (the processor: train/vl_processor.py).

An example is an image (data.image_field, a path relative to the data file) and a conversation
(core/conversations.py: a question and an answer as `fields`, or turns as `messages`/`sharegpt`/`alpaca`). The
image leads the first user turn; the processor's chat template renders it, and train/chat.py labels the
assistant's answers only, the same code as for text: the system and user turns, every image token and the
padding are -100.

Images are never cut: an example whose text and image tokens exceed max_length is dropped and counted
(truncating through image tokens makes the processor raise mid-epoch). Lengths are known before any pixel is
decoded: the image's size comes from its file header, and the processor's bounds (data.min_pixels,
data.max_pixels) decide its tokens. Pixels are read in the collator, batch by batch; nothing is cached.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

from core.config import DataSpec
from core.examples import image_path
from train import chat
from train.data import FIXED_LENGTHS, LengthReport, round_up

if TYPE_CHECKING:  # imported where used: an eval job reads prompts without loading datasets
    import datasets

log = logging.getLogger("train.vl")

# Where vision-language models keep their parts, by module name (Qwen2.5-VL, Qwen3-VL: model.language_model,
# model.visual; LLaVA-style: model.language_model, model.vision_tower / multi_modal_projector).
LANGUAGE = re.compile(r"(^|\.)language_model\.")
VISION = re.compile(r"(^|\.)(visual|vision_tower|vision_model|multi_modal_projector)(\.|$)")
# Kept out of 4-bit: the vision tower (small, and quantizing it costs accuracy) and the output layer.
NOT_QUANTIZED = ["model.visual", "model.vision_tower", "model.multi_modal_projector", "lm_head"]


# ---- the processor: train/vl_processor.py (its classes import Qwen's processors; only image-text loads it)
def image_tokens(processor, path: Path) -> int:
    """How many image tokens the processor makes of this image, from its size alone (the file header)."""
    from PIL import Image

    with Image.open(path) as image:
        width, height = image.size
    images = processor.image_processor
    return images.get_number_of_image_patches(height, width, {}) // images.merge_size**2


# ---- examples and lengths -----------------------------------------------------------------------------
def examples(source: str, spec: DataSpec, processor, limit: int | None = None) -> datasets.Dataset:
    """One row per example: text (the conversation through the processor's chat template, one image
    placeholder in its first user turn), input_ids and labels of that text (answers only, train/chat.py),
    image (absolute path), length (text + image tokens) and target_length (labelled tokens)."""
    import datasets

    from train.data import read_rows, turns_of

    rows = read_rows(source, spec)[:limit]
    conversations = [turns_of(row, spec, "image-text") for row in rows]
    chat.within_bounds(processor, conversations)
    encoded = [chat.encode(processor, turns, spec.train_on) for turns in conversations]
    images = [str(image_path(row, spec, source).resolve()) for row in rows]
    # The template holds one image placeholder; the processor expands it to the image's tokens.
    image_lengths = [image_tokens(processor, Path(path)) for path in images]
    return datasets.Dataset.from_dict(
        {
            "text": [e.text for e in encoded],
            "input_ids": [e.input_ids for e in encoded],
            "labels": [e.labels for e in encoded],
            "image": images,
            "length": [len(e.input_ids) - 1 + n for e, n in zip(encoded, image_lengths, strict=True)],
            "target_length": [sum(1 for x in e.labels if x != -100) for e in encoded],
        }
    )


def choose_length(dataset: datasets.Dataset, spec: DataSpec, max_positions: int | None) -> LengthReport:
    """max_length as for text (auto: the smallest multiple of 8 that holds the longest example, capped at
    the model's positions); `inputs_truncated` counts the examples it drops, since none is cut."""
    from train.data import pick_length

    lengths = dataset["length"]
    longest = max(lengths)
    max_length = pick_length(spec.max_length, longest, max_positions, "max_length")
    return LengthReport(
        max_length=max_length,
        max_target_length=None,
        longest=longest,
        longest_target=max(dataset["target_length"]),
        inputs_truncated=sum(1 for n in lengths if n > max_length),
        targets_truncated=0,
        truncated_at={n: sum(1 for x in lengths if x > n) for n in FIXED_LENGTHS},
    )


def drop_too_long(dataset: datasets.Dataset, lengths: LengthReport) -> datasets.Dataset:
    kept = dataset.select([i for i, n in enumerate(dataset["length"]) if n <= lengths.max_length])
    if len(kept) == 0:
        raise ValueError(
            f"max_length {lengths.max_length} drops every example (the shortest needs "
            f"{min(dataset['length'])} tokens with its image): raise data.max_length, lower data.max_pixels, "
            "or use 'auto'"
        )
    if len(kept) < len(dataset):
        log.warning(
            "%d of %d examples dropped: longer than max_length %d with their image tokens (images are never "
            "truncated; lower data.max_pixels or raise data.max_length to keep them)",
            len(dataset) - len(kept),
            len(dataset),
            lengths.max_length,
        )
    return kept


# ---- batches ------------------------------------------------------------------------------------------
class Collator:
    """Rows of `examples()` → a padded batch: input_ids, attention_mask, labels (answer only),
    mm_token_type_ids (1 on image tokens: Qwen3-VL requires it, Qwen2.5-VL silently computes a different
    loss without it), pixel_values and image_grid_thw. `pad_to_multiple_of` as train/device.py says."""

    def __init__(self, processor, pad_to_multiple_of: int | None = None):
        self.processor, self.tokenizer = processor, processor.tokenizer
        self.multiple = pad_to_multiple_of or 1

    def encode(self, row: dict) -> dict:
        """The row's text through the processor, which expands the one image placeholder to the image's
        tokens; the row's labels are expanded at the same place, the image's tokens -100 (with train_on:
        all too), so every text token keeps its label wherever it stands."""
        from PIL import Image

        with Image.open(row["image"]) as image:
            encoded = self.processor(text=[row["text"]], images=[image.convert("RGB")], return_tensors="pt")
        ids, text_ids = encoded["input_ids"][0].tolist(), row["input_ids"]
        image_id = self.processor.image_token_id
        at, added = text_ids.index(image_id), len(ids) - len(text_ids)
        if added < 0 or ids[:at] != text_ids[:at] or ids[at + added + 1 :] != text_ids[at + 1 :]:
            raise ValueError(f"{row['image']}: the processor's tokens differ from the chat rendering's")
        types = encoded.get("mm_token_type_ids")
        return {
            "input_ids": ids,
            "labels": row["labels"][:at] + [-100] * (added + 1) + row["labels"][at + 1 :],
            "mm_token_type_ids": types[0].tolist()
            if types is not None
            else [int(i == image_id) for i in ids],
            "pixel_values": encoded["pixel_values"],
            "image_grid_thw": encoded["image_grid_thw"],
        }

    def __call__(self, rows: list[dict]) -> dict:
        import torch

        features = [self.encode(row) for row in rows]
        width = round_up(max(len(f["input_ids"]) for f in features), self.multiple)

        def padded(key: str, value: int):
            return torch.tensor([f[key] + [value] * (width - len(f[key])) for f in features])

        return {
            "input_ids": padded("input_ids", self.tokenizer.pad_token_id),
            "attention_mask": torch.tensor(
                [[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features]
            ),
            "labels": padded("labels", -100),
            "mm_token_type_ids": padded("mm_token_type_ids", 0),
            "pixel_values": torch.cat([f["pixel_values"] for f in features]),
            "image_grid_thw": torch.cat([f["image_grid_thw"] for f in features]),
        }


def generation_inputs(processor, prompts: list[str], images: list[str], device):
    """A left-padded batch of chat prompts with their images, for generate()."""
    from PIL import Image

    opened = [Image.open(path).convert("RGB") for path in images]
    encoded = processor(text=prompts, images=opened, padding=True, padding_side="left", return_tensors="pt")
    return encoded.to(device)


# ---- LoRA targets -------------------------------------------------------------------------------------
def lora_targets(model, target_modules: list[str] | str, train_vision: bool) -> list[str]:
    """Full names of the Linear layers LoRA adapts: those of the language model whose last name part is
    in `target_modules` (any, for "all-linear"); with train_vision, the vision tower's and projector's
    Linear layers too. Named in full, because a bare name list hits the vision tower too (Qwen2.5-VL's
    vision MLP also has gate/up/down_proj), and so adapter_config.json records exactly what was trained."""
    import torch

    wanted = None if target_modules == "all-linear" else set(target_modules)
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name.endswith("lm_head"):
            continue
        if VISION.search(name):
            if train_vision:
                names.append(name)
        elif LANGUAGE.search(name) and (wanted is None or name.rsplit(".", 1)[-1] in wanted):
            names.append(name)
    if not names:
        raise ValueError(
            f"adapter.target_modules {target_modules} matches no Linear layer of the language model "
            "(names like q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or 'all-linear')"
        )
    return names


def is_vision(name: str) -> bool:
    return bool(VISION.search(name))
