"""Vision-language (model.kind: image-text) on the tiny Qwen2.5-VL and the demo shapes: the answer-only loss
mask, LoRA kept off the vision tower, over-long examples dropped and counted, missing images refused before
anything is queued, and the demo curriculum through the launcher on the local backend."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

import launch
from core.config import AdapterSpec, DataSpec, ModelSpec
from tests.conftest import write_cluster_yaml

SHAPES = Path(__file__).resolve().parent.parent / "data" / "demo" / "shapes"


@pytest.fixture(scope="module")
def processor(tiny):
    from train.vl_processor import load_processor

    return load_processor(str(tiny["tiny-qwen-vl"]), ModelSpec(name_or_path="x", kind="image-text"))


def spec(**changes) -> DataSpec:
    fields = dict(
        train=str(SHAPES / "hard.jsonl"), image_field="image", input_field="question", target_field="answer"
    )
    return DataSpec(**(fields | changes))


def test_only_the_answer_is_learned_never_the_prompt_the_image_tokens_or_padding(processor):
    from train.vl import Collator, examples

    rows = examples(str(SHAPES / "dev.jsonl"), spec(), processor, limit=6)  # both questions, two lengths
    lines = (SHAPES / "dev.jsonl").read_text().splitlines()[:6]
    answers = [json.loads(line)["answer"] for line in lines]
    batch = Collator(processor)([rows[i] for i in range(len(rows))])
    tokenizer = processor.tokenizer
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert len(set(rows["length"])) > 1  # padding is exercised
    for i, row in enumerate(rows):
        ids, labels, mask = batch["input_ids"][i], batch["labels"][i], batch["attention_mask"][i]
        learned = (labels != -100).nonzero().flatten()
        # One block, the answer and the end of the turn as the input has it, then the newline ChatML puts
        # between turns (not learnt: train/chat.py), then the padding.
        assert learned.numel() > 0 and bool((learned.diff() == 1).all())
        assert int(learned[-1]) == int(mask.sum()) - 2 and tokenizer.decode(ids[int(learned[-1]) + 1]) == "\n"
        assert tokenizer.decode(labels[learned]) == answers[i] + "<|im_end|>"
        assert bool((labels[learned] == ids[learned]).all())
        # Everything before it is -100: the system and user turns, the image and the assistant header.
        assert bool((labels[: int(learned[0])] == -100).all())
        images = ids == image_pad
        assert int(images.sum()) == 4 and bool((labels[images] == -100).all())
        assert bool((batch["mm_token_type_ids"][i].bool() == images).all())
        assert bool((labels[mask == 0] == -100).all()) and bool(
            (ids[mask == 0] == tokenizer.pad_token_id).all()
        )
        # The length counted from the image's size alone is the length of the encoded example.
        assert row["length"] == int(mask.sum())
        # The text is the chat template's own rendering of the whole conversation, image first.
        question = "What colour and shape is this?" if "shape is this" in row["text"] else None
        if question:
            whole = [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
                {"role": "assistant", "content": [{"type": "text", "text": answers[i]}]},
            ]
            assert processor.apply_chat_template(whole, tokenize=False) == row["text"]


def test_a_multi_turn_image_conversation_learns_every_answer_after_the_image(processor, tmp_path):
    from train.vl import Collator, examples

    image = str((SHAPES / "images").resolve() / sorted(p.name for p in (SHAPES / "images").iterdir())[0])
    turns = [
        {"role": "user", "content": "What colour is it?"},
        {"role": "assistant", "content": "red"},
        {"role": "user", "content": "And its shape?"},
        {"role": "assistant", "content": "circle"},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"image": image, "messages": turns}) + "\n")
    data = DataSpec(train=str(path), image_field="image", format="messages")
    rows = examples(str(path), data, processor)
    batch = Collator(processor)([rows[0]])
    labels, ids = batch["labels"][0], batch["input_ids"][0]
    learned = (labels != -100).nonzero().flatten().tolist()
    pieces = processor.tokenizer.decode(ids[learned])
    assert pieces == "red<|im_end|>circle<|im_end|>"  # both answers, after the 4 image tokens, nothing else
    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert max(i for i, t in enumerate(ids.tolist()) if t == image_pad) < learned[0]
    assert rows[0]["length"] == len(ids)
    # train_on: all learns every text token, before the image too, and never an image token.
    everything = examples(str(path), data.model_copy(update={"train_on": "all"}), processor)
    batch = Collator(processor)([everything[0]])
    images = batch["input_ids"][0] == image_pad
    assert bool((batch["labels"][0][images] == -100).all())
    assert bool((batch["labels"][0][~images] == batch["input_ids"][0][~images]).all())


def lora_layers(model) -> list[str]:
    from peft.tuners.lora import LoraLayer

    return [
        name.removeprefix("base_model.model.")
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer) and not name.endswith(("lora_A", "lora_B"))
    ]


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]])
def test_lora_targets_hit_no_vision_module_unless_asked(tiny, targets):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from train.model import new_adapter

    def base():
        return AutoModelForImageTextToText.from_pretrained(tiny["tiny-qwen-vl"])

    # The trap this guards against: the same names given to peft as they are hit the vision MLP too.
    if isinstance(targets, list):
        trap = lora_layers(get_peft_model(base(), LoraConfig(r=4, target_modules=targets)))
        assert any(".visual." in name for name in trap)

    text_only = lora_layers(new_adapter(base(), AdapterSpec(rank=4, target_modules=targets), "image-text"))
    assert text_only and all(name.startswith("model.language_model.layers.") for name in text_only)
    if isinstance(targets, list):
        assert {name.rsplit(".", 1)[-1] for name in text_only} == set(targets)
    else:  # every Linear of the language model's layers: 7 per layer, 2 layers
        assert len(text_only) == 14

    widened = lora_layers(
        new_adapter(base(), AdapterSpec(rank=4, target_modules=targets, train_vision=True), "image-text")
    )
    assert set(text_only) < set(widened) and any(name.startswith("model.visual.") for name in widened)


def test_qlora_keeps_the_vision_tower_and_output_layer_out_of_4_bit(tiny):
    import bitsandbytes as bnb

    from train.device import Hardware, decide
    from train.model import load_base

    placement = decide(Hardware(cuda_devices=0), "auto")
    model = load_base(
        ModelSpec(name_or_path=str(tiny["tiny-qwen-vl"]), kind="image-text"),
        AdapterSpec(method="qlora"),
        placement,
    )
    quantized = [name for name, module in model.named_modules() if isinstance(module, bnb.nn.Linear4bit)]
    assert len(quantized) == 14 and all(name.startswith("model.language_model.") for name in quantized)


def test_an_over_long_example_is_dropped_and_counted_never_cut(processor, tmp_path):
    from train.vl import choose_length, drop_too_long, examples

    rows = [json.loads(line) for line in (SHAPES / "hard.jsonl").read_text().splitlines()[:5]]
    for row in rows:
        row["image"] = str(SHAPES / row["image"])  # absolute: the file lives elsewhere
    rows[2]["question"] = "What colour and shape is this? " * 12
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    dataset = examples(str(data), spec(train=str(data)), processor)
    lengths = choose_length(dataset, spec(train=str(data), max_length=48), max_positions=512)
    assert dataset["length"][2] > 48 >= max(n for i, n in enumerate(dataset["length"]) if i != 2)
    assert lengths.inputs_truncated == 1
    kept = drop_too_long(dataset, lengths)
    assert len(kept) == 4 and rows[2]["question"] not in " ".join(kept["text"])
    # auto holds every example instead, the long one included
    assert choose_length(dataset, spec(train=str(data)), max_positions=512).inputs_truncated == 0


VL_CONFIG = """\
name: {name}
model: {{name_or_path: {root}/models/tiny-qwen-vl, kind: image-text}}
adapter: {{rank: 8, alpha: 16, max_trainable_percent: 25}}
data:
  train: {train}
  eval: {root}/data/demo/shapes/dev.jsonl
  image_field: image
  input_field: question
  target_field: answer
train: {{epochs: 1, learning_rate: 5.0e-3, batch_size: 8}}
eval: {{metrics: [exact_match], max_new_tokens: 4}}
resources: {{gpus: 0, cpus: 1, mem_gb: 2, time: "00:20:00", signal_delay_s: 60}}
"""


def test_a_missing_image_is_a_validation_error_with_file_and_line(repo_root, tiny, tmp_path, capsys):
    rows = (SHAPES / "easy.jsonl").read_text().splitlines()[:4]
    shutil.copytree(SHAPES / "images", tmp_path / "images")
    broken = json.loads(rows[2]) | {"image": "images/nowhere.png"}
    data = tmp_path / "easy.jsonl"
    data.write_text("\n".join([rows[0], rows[1], json.dumps(broken), rows[3]]) + "\n")
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "vl.yaml").write_text(VL_CONFIG.format(name="vl", root=repo_root, train=data))
    assert launch.main(["--all", "--config-dir", str(folder), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"{data}:3: image file not found: {tmp_path / 'images' / 'nowhere.png'}" in err
    assert "relative to the data file" in err and "Traceback" not in err


def test_image_settings_are_refused_for_a_text_model_and_required_for_an_image_text_one(
    repo_root, tmp_path, capsys
):
    folder = tmp_path / "configs"
    folder.mkdir()
    text = VL_CONFIG.format(name="vl", root=repo_root, train=SHAPES / "easy.jsonl")
    (folder / "vl.yaml").write_text(text.replace("  image_field: image\n", ""))
    (folder / "txt.yaml").write_text(
        text.replace("name: vl", "name: txt").replace("kind: image-text", "kind: causal")
    )
    assert launch.main(["--all", "--config-dir", str(folder), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "vl.yaml" in err and "needs data.image_field" in err
    assert "txt.yaml" in err and "are for model.kind image-text" in err and "Traceback" not in err


def test_pixel_bounds_the_wrong_way_round_are_refused_with_file_and_key(repo_root, tmp_path, capsys):
    folder = tmp_path / "configs"
    folder.mkdir()
    text = VL_CONFIG.format(name="vl", root=repo_root, train=SHAPES / "easy.jsonl")
    (folder / "vl.yaml").write_text(text)
    bounds = ["data.min_pixels=50176", "data.max_pixels=3136"]
    assert launch.main(["--all", "--config-dir", str(folder), "--dry-run", *bounds]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "min_pixels 50176 is above max_pixels 3136" in err and "Traceback" not in err
    assert launch.main(["--all", "--config-dir", str(folder), "--dry-run", "data.min_pixels=3136"]) == 0


@pytest.mark.slow
def test_the_demo_curriculum_trains_chains_and_scores_through_the_launcher_locally(
    repo_root, tiny, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(repo_root)
    configs = tmp_path / "configs"
    (configs / "demo").mkdir(parents=True)
    shutil.copy(repo_root / "configs" / "base.yaml", configs / "base.yaml")
    shutil.copy(repo_root / "configs" / "demo" / "shapes-vl-qlora-curriculum.yaml", configs / "demo")
    write_cluster_yaml(configs, tmp_path)
    assert launch.main(["--all", "--config-dir", str(configs / "demo"), "--backend", "local"]) == 0
    runs = tmp_path / "runs" / "shapes-vl-qlora-curriculum"
    for stage in ("colours", "shapes"):
        losses = [
            json.loads(line).get("loss") for line in (runs / stage / "metrics.jsonl").read_text().splitlines()
        ]
        losses = [x for x in losses if x is not None]
        assert len(losses) >= 3 and losses[-1] < losses[0] / 2, (stage, losses)
    summary = json.loads((runs / "shapes" / "summary.json").read_text())
    assert summary["init_adapter"] == str(runs / "colours" / "adapter") and summary["dropped_too_long"] == 0
    config = json.loads((runs / "shapes" / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] and not [m for m in config["target_modules"] if "visual" in m]
    results = json.loads((runs / "eval" / "results.json").read_text())
    assert results["n"] == 24 and results["adapter_changes_output"] is True
    predictions = [json.loads(row) for row in (runs / "eval" / "predictions.jsonl").read_text().splitlines()]
    # Generation learned the answers' form: a colour word first (what stage 1 taught), for every image.
    colours = {"red", "green", "blue", "yellow"}
    assert sum(p["prediction"].split()[:1] in ([c] for c in colours) for p in predictions) >= 18


def test_the_shipped_shapes_regenerate_byte_for_byte_and_dev_shares_no_image_with_train(tmp_path):
    from demo.shapes import build_shapes

    built = build_shapes(tmp_path)
    for name, path in built.items():
        assert path.read_bytes() == (SHAPES / f"{name}.jsonl").read_bytes(), name
    images = sorted(p.name for p in (tmp_path / "images").iterdir())
    assert images == sorted(p.name for p in (SHAPES / "images").iterdir())
    assert all((tmp_path / "images" / n).read_bytes() == (SHAPES / "images" / n).read_bytes() for n in images)
    rows = {
        name: [json.loads(line) for line in path.read_text().splitlines()] for name, path in built.items()
    }
    train = {row["image"] for row in rows["easy"] + rows["hard"]}
    assert train.isdisjoint(row["image"] for row in rows["dev"])
    # easy answers a colour (one word), hard a colour and a shape (two): the curriculum's two steps
    assert {len(row["answer"].split()) for row in rows["easy"]} == {1}
    assert {len(row["answer"].split()) for row in rows["hard"]} == {2}


def test_pixel_bounds_set_the_image_tokens_and_travel_with_the_saved_processor(tiny, tmp_path):
    from PIL import Image

    from train.vl import image_tokens
    from train.vl_processor import load_processor

    image = tmp_path / "big.png"
    Image.new("RGB", (112, 112), "white").save(image)
    model = ModelSpec(name_or_path="x", kind="image-text")
    default = load_processor(str(tiny["tiny-qwen-vl"]), model)
    assert image_tokens(default, image) == 4  # the tiny processor's own bound: 56 x 56 pixels
    wider = load_processor(str(tiny["tiny-qwen-vl"]), model, spec(max_pixels=112 * 112))
    assert image_tokens(wider, image) == 16
    wider.save_pretrained(tmp_path / "adapter")  # as the trainer saves it beside the adapter
    assert image_tokens(load_processor(str(tmp_path / "adapter"), model), image) == 16
    # Hub Qwen2.5-VL folders carry the older top-level min_pixels/max_pixels, which the image processor
    # applies over any `size` it is given: the bounds must win over them too.
    hub_like = tmp_path / "hub-like"
    shutil.copytree(tiny["tiny-qwen-vl"], hub_like)
    config = json.loads((hub_like / "processor_config.json").read_text())
    config["image_processor"] |= {"min_pixels": 3136, "max_pixels": 3136}
    (hub_like / "processor_config.json").write_text(json.dumps(config))
    assert image_tokens(load_processor(str(hub_like), model), image) == 4
    from_hub = load_processor(str(hub_like), model, spec(max_pixels=112 * 112))
    assert image_tokens(from_hub, image) == 16
    from_hub.save_pretrained(tmp_path / "adapter2")
    assert image_tokens(load_processor(str(tmp_path / "adapter2"), model), image) == 16


def test_a_stock_qwen_processor_loads_its_image_part_where_torchvision_is_missing(tiny, tmp_path):
    # A hub folder names the stock class, whose video half needs torchvision (absent from this CPU install,
    # as from many cluster environments): the job must still get a working image processor.
    from PIL import Image
    from transformers import Qwen2_5_VLProcessor

    from train.vl import image_tokens
    from train.vl_processor import ImageOnlyQwen2_5_VLProcessor, load_processor

    stock = tmp_path / "stock"
    shutil.copytree(tiny["tiny-qwen-vl"], stock)
    config = json.loads((stock / "processor_config.json").read_text())
    (stock / "processor_config.json").write_text(
        json.dumps(config | {"processor_class": "Qwen2_5_VLProcessor"})
    )
    processor = load_processor(str(stock), ModelSpec(name_or_path="x", kind="image-text"))
    has_torchvision = importlib.util.find_spec("torchvision") is not None
    assert type(processor) is (Qwen2_5_VLProcessor if has_torchvision else ImageOnlyQwen2_5_VLProcessor)
    image = tmp_path / "shape.png"
    Image.new("RGB", (56, 56), "red").save(image)
    assert image_tokens(processor, image) == 4
