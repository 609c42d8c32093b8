"""The tiny offline models: built with no hub, reloadable through the Auto classes, deterministic, and
left alone when already built."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from demo.tiny import STAMP, build_tiny_models

SQL = "SELECT name FROM customers WHERE city = 'Paris' ORDER BY age DESC LIMIT 2"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    return build_tiny_models(tmp_path_factory.mktemp("models"))


def digests(folder: Path) -> dict[str, tuple[str, int]]:
    return {
        p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(folder.iterdir())
    }


def demo_sql(repo_root: Path) -> list[str]:
    lines = []
    for split in ("train", "dev"):
        lines += (repo_root / "data" / "demo" / "sql" / f"{split}.jsonl").read_text().splitlines()
    return [json.loads(line)["sql"] for line in lines]


def test_tiny_t5_reloads_and_generates(built):
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built["tiny-t5"])
    model = AutoModelForSeq2SeqLM.from_pretrained(built["tiny-t5"])
    assert type(model).__name__ == "T5ForConditionalGeneration"
    assert 130_000 <= model.num_parameters() <= 270_000
    ids = tokenizer(SQL)["input_ids"]
    assert ids[-1] == tokenizer.eos_token_id == 1  # </s> appended, like T5's own tokenizer
    assert tokenizer.decode(ids, skip_special_tokens=True) == SQL
    assert tokenizer.padding_side == "right" and tokenizer.pad_token_id == 0
    batch = tokenizer(["names of customers in Nice", SQL], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=6, do_sample=False)
    assert out.shape[0] == 2 and out[0, 0].item() == model.config.decoder_start_token_id == 0


def test_tiny_llama_reloads_and_generates(built):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built["tiny-llama"])
    model = AutoModelForCausalLM.from_pretrained(built["tiny-llama"])
    assert type(model).__name__ == "LlamaForCausalLM"
    assert 130_000 <= model.num_parameters() <= 270_000
    assert model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    ids = tokenizer(SQL)["input_ids"]
    assert tokenizer.eos_token_id not in ids  # no </s> post-processor: the trainer appends eos itself
    assert tokenizer.decode(ids) == SQL
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (0, 1, 3)
    assert tokenizer.padding_side == "right"
    batch = tokenizer([SQL], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape[1] <= len(ids) + 6


def test_the_tokenizer_round_trips_and_keeps_the_demo_sql_short(built, repo_root):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built["tiny-llama"])
    texts = [*demo_sql(repo_root), "SELECT x FROM t WHERE y = 'é, ü' ;  two  spaces\tand a tab"]
    for text in texts:
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert max(len(tokenizer(sql)["input_ids"]) for sql in demo_sql(repo_root)) <= 40


def test_a_second_build_skips_and_touches_nothing(built, capsys):
    before = {name: digests(folder) for name, folder in built.items()}
    assert build_tiny_models(next(iter(built.values())).parent) == built
    assert capsys.readouterr().out.count(": skipped") == 3
    assert {name: digests(folder) for name, folder in built.items()} == before


def test_force_rebuilds_the_same_weights_and_leaves_no_temp_folder(built, tmp_path, capsys):
    out = build_tiny_models(tmp_path, force=True)
    assert capsys.readouterr().out.count(": built ") == 3
    for name, folder in out.items():
        for file in ("model.safetensors", "tokenizer.json", "config.json"):
            assert (folder / file).read_bytes() == (built[name] / file).read_bytes(), (name, file)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-llama", "tiny-qwen-vl", "tiny-t5"]


def test_a_stale_stamp_is_rebuilt(tmp_path, capsys):
    out = build_tiny_models(tmp_path)
    stamp = out["tiny-t5"] / STAMP
    stamp.write_text(json.dumps({**json.loads(stamp.read_text()), "recipe": 0}))
    (out["tiny-llama"] / STAMP).unlink()  # a folder without a stamp is not trusted either
    capsys.readouterr()
    build_tiny_models(tmp_path)
    assert capsys.readouterr().out.count(": built ") == 2  # tiny-qwen-vl was up to date
    assert json.loads(stamp.read_text())["recipe"] != 0


def test_tiny_qwen_vl_reloads_through_the_auto_classes_and_generates_from_an_image(built, repo_root):
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from core.config import ModelSpec
    from train.chat import rendered, with_image
    from train.vl_processor import load_processor

    processor = load_processor(str(built["tiny-qwen-vl"]), ModelSpec(name_or_path="x", kind="image-text"))
    model = AutoModelForImageTextToText.from_pretrained(built["tiny-qwen-vl"])
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert 150_000 <= model.num_parameters() <= 270_000
    image = Image.open(repo_root / "data" / "demo" / "shapes" / "images" / "dev-red-circle-0.png")
    batch = processor(
        text=[rendered(processor, with_image([{"role": "user", "content": "What colour?"}]), True)],
        images=[image],
        return_tensors="pt",
    )
    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((batch["input_ids"] == image_pad).sum()) == 4  # 56 x 56: 4 x 4 patches, merged 2 x 2
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == batch["input_ids"].shape[1] + 3
