"""Tiny offline models for the demo and the tests: no hub, a few hundred thousand parameters.

    python -m demo.tiny [OUT_DIR] [--force]      # default OUT_DIR: models/

builds a byte-level BPE tokenizer trained on the demo data (data/demo/sql), then `OUT_DIR/tiny-t5` (seq2seq)
and `OUT_DIR/tiny-llama` (causal), and `OUT_DIR/tiny-qwen-vl` (image-text, a Qwen2.5-VL with a processor and a
tokenizer trained on data/demo/shapes), each saved with its tokenizer and seeded so the weights are the same
every time. A folder whose `tiny.json` stamp matches this recipe and the demo data is left as it is.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

# Bump when anything below changes what gets built (sizes, tokenizer, seeds): stamped folders then rebuild.
RECIPE_VERSION = 2
SEED = 0
VOCAB_SIZE = 512
DATA = Path(__file__).resolve().parent.parent / "data" / "demo" / "sql"
SPECIALS = ["<pad>", "</s>", "<unk>", "<s>"]  # ids 0..3, the T5 convention (pad = decoder start)
STAMP = "tiny.json"


def demo_texts(data_dir: Path = DATA) -> list[str]:
    """Questions, schemas and SQL of every demo row, once each (easy/medium/hard only repeat train)."""
    texts = []
    for split in ("train", "dev"):
        path = data_dir / f"{split}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: run `python -m demo.data` first")
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            texts += [row["question"], row["schema"], row["sql"]]
    return texts


def train_tokenizer(texts: list[str], seq2seq: bool, vocab_size: int = VOCAB_SIZE):
    """A PreTrainedTokenizerFast; seq2seq appends </s> like T5's, the causal one adds nothing."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # byte-level: any string round-trips
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    if seq2seq:
        tok.post_processor = processors.TemplateProcessing(
            single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
        )
    # padding_side only reaches tokenizer_config.json as a constructor argument; the trainer flips it to
    # left for causal generation. No space clean-up, or decode(encode(sql)) could differ from sql.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        bos_token="<s>",
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )


def tiny_t5(vocab_size: int):
    from transformers import T5Config, T5ForConditionalGeneration

    # initializer_factor 1.0 and no dropout: with smaller init factors the tiny T5 did not learn at all.
    # transformers ties lm_head to the shared embedding whatever tie_word_embeddings says.
    config = T5Config(
        vocab_size=vocab_size,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
        initializer_factor=1.0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return T5ForConditionalGeneration(config)


def tiny_llama(vocab_size: int, **sizes):
    """A Llama for the demo tokenizer (its pad/eos/bos ids); `sizes` overrides the shape (the benchmark's is
    larger)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    config = LlamaConfig(
        vocab_size=vocab_size,
        **(shape | sizes),
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=3,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


# name -> (model factory, seq2seq tokenizer?)
BUILDERS: dict[str, tuple[Callable, bool]] = {"tiny-t5": (tiny_t5, True), "tiny-llama": (tiny_llama, False)}


# ---- a tiny vision-language model (Qwen2.5-VL shape) with its processor ---------------------------------
SHAPES = DATA.parent / "shapes"
VL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
               "<|image_pad|>", "<|video_pad|>"]  # fmt: skip
# The real Qwen2-VL / Qwen2.5-VL chat template (a default system turn; an image as vision_start, image_pad,
# vision_end), as transformers' own processor tests carry it: the answer-only mask is checked against it.
VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content"
    " or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video'"
    " or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)


def tiny_vl_processor(texts: list[str]):
    """A byte-level BPE tokenizer with Qwen's special tokens, trained on the shapes data, and Qwen's PIL
    image processor sized so a 56 x 56 demo image is 4 image tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessorPil

    from train.vl_processor import ImageOnlyQwen2_5_VLProcessor

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [*texts, "You are a helpful assistant.", "system user assistant"]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=VL_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    images = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56, patch_size=14, merge_size=2)
    return ImageOnlyQwen2_5_VLProcessor(
        image_processor=images, tokenizer=tokenizer, chat_template=VL_CHAT_TEMPLATE
    )


def tiny_qwen_vl(tokenizer):
    """Qwen2.5-VL, 2 text layers of width 64 and a 2-block vision tower of width 32: about 200k parameters.
    Its vision MLP has gate/up/down_proj like the language model's: what LoRA's targets must tell apart."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    special = {
        f"{name}_token_id": tokenizer.convert_tokens_to_ids(token)
        for name, token in [
            ("image", "<|image_pad|>"),
            ("video", "<|video_pad|>"),
            ("vision_start", "<|vision_start|>"),
            ("vision_end", "<|vision_end|>"),
        ]
    }
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,  # with 0.02 the frozen random lm_head caps the logits and nothing is learned
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[1],
        out_hidden_size=64,  # the text width
    )
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **special)
    return Qwen2_5_VLForConditionalGeneration(config)


def build_vl(target: Path, texts: list[str], stamp: dict) -> int:
    import torch
    from transformers.utils import logging

    logging.disable_progress_bar()

    processor = tiny_vl_processor(texts)
    torch.manual_seed(SEED)
    model = tiny_qwen_vl(processor.tokenizer)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    (tmp / STAMP).write_text(json.dumps({**stamp, "params": model.num_parameters()}, indent=1) + "\n")
    swap_in(tmp, target)
    return model.num_parameters()


def data_digest(texts: list[str]) -> str:
    # The tokenizer is trained on the data, so new demo data must rebuild the models too.
    return hashlib.sha256("\n".join(texts).encode("utf-8")).hexdigest()[:16]


def read_stamp(folder: Path) -> dict | None:
    try:
        return json.loads((folder / STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def build_one(name: str, target: Path, texts: list[str], stamp: dict) -> int:
    """Build into a temp folder next to target, then swap it in; returns the parameter count."""
    import torch
    from transformers.utils import logging

    logging.disable_progress_bar()  # a shard bar for a 1 MB file is noise in job logs
    make_model, seq2seq = BUILDERS[name]
    tokenizer = train_tokenizer(texts, seq2seq)
    torch.manual_seed(SEED)
    model = make_model(len(tokenizer))
    tmp = target.with_name(f".{name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / STAMP).write_text(json.dumps({**stamp, "params": model.num_parameters()}, indent=1) + "\n")
    swap_in(tmp, target)
    return model.num_parameters()


def swap_in(tmp: Path, target: Path) -> None:
    # rename() will not replace a non-empty folder: move the old one aside first, delete it last, so a
    # crash leaves either the old complete model or the new one at target, never a partial one.
    old = target.with_name(f".{target.name}.{os.getpid()}.old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    try:
        os.replace(tmp, target)
    except OSError:
        if read_stamp(target) is None:  # not a concurrent builder's finished model: a real failure
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)


def build_tiny_models(out_dir: Path, force: bool = False, data_dir: Path = DATA) -> dict[str, Path]:
    """Build (or keep, when the stamp matches) OUT_DIR/tiny-t5, tiny-llama and tiny-qwen-vl; returns name -> folder."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    from demo.shapes import texts as shape_texts

    texts = demo_texts(Path(data_dir))
    vl_texts = shape_texts(Path(data_dir).parent / "shapes")
    built = {}
    for name in [*BUILDERS, "tiny-qwen-vl"]:
        target = out_dir / name
        used = vl_texts if name == "tiny-qwen-vl" else texts
        stamp = {"name": name, "recipe": RECIPE_VERSION, "data": data_digest(used)}
        old = read_stamp(target)
        if not force and old is not None and {k: old.get(k) for k in stamp} == stamp:
            print(f"{name}: skipped, {target} is up to date (recipe {RECIPE_VERSION})")
        else:
            start = time.perf_counter()
            build = build_vl if name == "tiny-qwen-vl" else partial(build_one, name)
            params = build(target, used, stamp)
            # The first build's time includes importing torch and transformers (seconds; the build is not).
            print(f"{name}: built {target} ({params:,} parameters, {time.perf_counter() - start:.2f} s)")
        built[name] = target
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo.tiny", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="models", type=Path, help="default: models/")
    parser.add_argument("--force", action="store_true", help="rebuild even if the stamp matches")
    args = parser.parse_args(argv)
    build_tiny_models(args.out_dir, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
