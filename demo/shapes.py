"""The demo's image + question → answer data: rendered shapes in colours, deterministic.

    python -m demo.shapes [OUT_DIR]      # default OUT_DIR: data/demo/shapes

writes `images/*.png` (56 x 56, one shape on white) and `{easy,hard,dev}.jsonl` (rows: id, image, question,
answer; image paths relative to the file). easy asks for the colour (one word), hard for colour and shape
(two words): a curriculum. dev holds other images, half of each kind of question. Same bytes on every run.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from PIL import Image, ImageDraw

SEED = 11
SIZE = 56
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 30), "blue": (30, 60, 220), "yellow": (230, 200, 20)}
SHAPES = ("circle", "square", "triangle")
TRAIN_VARIANTS = 6  # images per (colour, shape) in train: 72
DEV_VARIANTS = 2  # and in dev: 24
EASY = "What colour is the shape?"
HARD = "What colour and shape is this?"


def draw(colour: str, shape: str, rng: random.Random) -> Image.Image:
    image = Image.new("RGB", (SIZE, SIZE), "white")
    side = rng.randint(24, 40)
    x, y = rng.randint(4, SIZE - side - 4), rng.randint(4, SIZE - side - 4)
    box = (x, y, x + side, y + side)
    pen = ImageDraw.Draw(image)
    if shape == "circle":
        pen.ellipse(box, fill=COLOURS[colour])
    elif shape == "square":
        pen.rectangle(box, fill=COLOURS[colour])
    else:
        pen.polygon(
            [(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=COLOURS[colour]
        )
    return image


def build_shapes(out_dir: Path) -> dict[str, Path]:
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    splits: dict[str, list[dict]] = {"easy": [], "hard": [], "dev": []}
    for split, variants in (("train", TRAIN_VARIANTS), ("dev", DEV_VARIANTS)):
        for colour in COLOURS:
            for shape in SHAPES:
                for variant in range(variants):
                    name = f"images/{split}-{colour}-{shape}-{variant}.png"
                    draw(colour, shape, rng).save(out_dir / name, optimize=True)
                    easy = {"image": name, "question": EASY, "answer": colour}
                    hard = {"image": name, "question": HARD, "answer": f"{colour} {shape}"}
                    if split == "train":
                        splits["easy"].append(easy)
                        splits["hard"].append(hard)
                    else:
                        splits["dev"].append(easy if variant == 0 else hard)
    paths = {}
    for split, rows in splits.items():
        rng.shuffle(rows)
        paths[split] = out_dir / f"{split}.jsonl"
        paths[split].write_text(
            "".join(json.dumps({"id": i, **row}) + "\n" for i, row in enumerate(rows)), encoding="utf-8"
        )
    return paths


def texts(data_dir: Path) -> list[str]:
    """Questions and answers of every split: what the tiny vision-language model's tokenizer is trained on."""
    rows = [
        json.loads(line) for split in ("easy", "hard", "dev") for line in (data_dir / f"{split}.jsonl").open()
    ]
    return sorted({row["question"] for row in rows} | {row["answer"] for row in rows})


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    for name, path in build_shapes(Path(args[0] if args else "data/demo/shapes")).items():
        print(f"{name}: {path} ({len(path.read_text(encoding='utf-8').splitlines())} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
