"""Tiny offline models for the demo and the tests: no hub, a few hundred thousand parameters.

    python -m train.tiny [OUT_DIR] [--force]      # default OUT_DIR: models/

builds a byte-level BPE tokenizer trained on the demo data, then `OUT_DIR/tiny-t5` (seq2seq) and
`OUT_DIR/tiny-llama` (causal), each saved with its tokenizer, seeded so the weights are the same every time.
A folder whose stamp matches this recipe is kept as it is.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

RECIPE_VERSION = 1
DATA = Path(__file__).resolve().parent.parent / "data" / "demo" / "sql"
SPECIALS = ["<pad>", "</s>", "<unk>", "<s>"]  # ids 0..3, the T5 convention (pad = decoder start)


def demo_texts() -> list[str]:
    texts = []
    for path in sorted(DATA.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            texts += [row["question"], row["schema"], row["sql"]]
    return texts


def train_tokenizer(texts: list[str], seq2seq: bool, vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # byte-level: any SQL round-trips
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    if seq2seq:  # like the real T5 tokenizer: every sequence ends with </s>
        tok.post_processor = processors.TemplateProcessing(
            single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        bos_token="<s>",
        padding_side="right",
    )


def tiny_t5(vocab_size: int):
    from transformers import T5Config, T5ForConditionalGeneration

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


def tiny_llama(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=3,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


BUILDERS = {"tiny-t5": (tiny_t5, True), "tiny-llama": (tiny_llama, False)}


def build_tiny_models(out_dir: Path, force: bool = False) -> dict[str, Path]:
    import torch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = None
    built = {}
    for name, (make_model, seq2seq) in BUILDERS.items():
        target = out_dir / name
        stamp = {"recipe": RECIPE_VERSION, "name": name}
        if not force and _read_stamp(target) == stamp:
            built[name] = target
            continue
        texts = texts or demo_texts()
        torch.manual_seed(0)
        tokenizer = train_tokenizer(texts, seq2seq)
        model = make_model(len(tokenizer))
        tmp = out_dir / f".{name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "tiny.json").write_text(json.dumps(stamp))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)  # never a half-written model folder
        built[name] = target
    return built


def _read_stamp(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "tiny.json").read_text())
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--force"]
    for model_name, path in build_tiny_models(
        Path(args[0] if args else "models"), "--force" in sys.argv
    ).items():
        print(f"{model_name}: {path}")
