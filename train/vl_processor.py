"""The processor of a vision-language model: its tokenizer, image processor and chat template, loaded with
the data's pixel bounds. Apart from train/vl.py because its classes subclass Qwen's processors, whose import
loads their image processing (PIL, the Qwen-VL modules): only an image-text job imports this module."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from transformers import (
    AutoProcessor,
    ProcessorMixin,
    Qwen2_5_VLConfig,
    Qwen2_5_VLProcessor,
    Qwen3VLConfig,
    Qwen3VLProcessor,
)

from core.config import DataSpec, ModelSpec

log = logging.getLogger("train.vl")


class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
    """Qwen's stock processors insist on a video processor, which needs torchvision; CPU installs (this
    project's tests) have none. The tiny demo model's folder names these image-only classes."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def register_image_only_processors() -> None:
    """Without this AutoProcessor silently returns the bare tokenizer for a folder naming the classes above.
    A hub folder names the stock class, which wins over this registration and loads as usual."""
    AutoProcessor.register(Qwen2_5_VLConfig, ImageOnlyQwen2_5_VLProcessor, exist_ok=True)
    AutoProcessor.register(Qwen3VLConfig, ImageOnlyQwen3VLProcessor, exist_ok=True)


def load_processor(source: str, spec: ModelSpec, data: DataSpec | None = None):
    """The model's processor (tokenizer + image processor + chat template) with the data's pixel bounds;
    saved with the adapter, so later stages and the eval job resize images the same way."""
    from train.hub_cache import fetch_hint

    register_image_only_processors()
    revision = spec.revision if source == spec.name_or_path else None
    with fetch_hint(source, revision):
        try:
            processor = AutoProcessor.from_pretrained(source, revision=revision)
        except (OSError, ValueError, AttributeError) as exc:
            processor = image_only(source, revision, exc)
    if not isinstance(processor, ProcessorMixin):  # AutoProcessor falls back to the bare tokenizer
        raise ValueError(
            f"{source} has no image processor (processor_config.json): is it a vision-language model?"
        )
    if data is not None and (data.min_pixels or data.max_pixels):
        # Set on the loaded image processor, not passed to from_pretrained: hub Qwen2.5-VL folders carry
        # top-level min_pixels/max_pixels that the image processor applies over a `size` argument, and
        # min_pixels/max_pixels arguments are deprecated. `size` is in pixels (shortest_edge: the least,
        # longest_edge: the most), and save_pretrained writes it with the adapter.
        size = processor.image_processor.size
        processor.image_processor.size = dataclasses.replace(
            size,
            shortest_edge=data.min_pixels or size.shortest_edge,
            longest_edge=data.max_pixels or size.longest_edge,
        )
    if processor.tokenizer.pad_token is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    return processor


def image_only(source: str, revision: str | None, failure: Exception):
    """A stock Qwen processor that failed to load for want of torchvision (its video half), loaded as its
    image-only subclass: a node without torchvision still trains and evaluates on images. Any other
    failure is raised as it was."""
    from transformers.utils import cached_file

    if "video" not in str(failure).lower() and "torchvision" not in str(failure).lower():
        raise failure
    named = ""
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        path = cached_file(source, name, revision=revision, _raise_exceptions_for_missing_entries=False)
        if path:
            named = json.loads(Path(path).read_text(encoding="utf-8")).get("processor_class") or named
        if named:
            break
    subclass = {
        "Qwen2_5_VLProcessor": ImageOnlyQwen2_5_VLProcessor,
        "Qwen3VLProcessor": ImageOnlyQwen3VLProcessor,
    }
    if named not in subclass:
        raise failure
    log.warning("%s: %s; loading its images-only part (%s)", source, failure, subclass[named].__name__)
    return subclass[named].from_pretrained(source, revision=revision)
