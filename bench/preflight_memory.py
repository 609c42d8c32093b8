"""Preflight's activation estimate (meta device, no weights) against a real CPU forward of the tiny models.

    python -m bench.preflight_memory [--json]

Both sides sum what autograd saves for the backward (torch.autograd.graph.saved_tensors_hooks), in fp32.
The estimate runs the adapted model on meta tensors (train/memory.py); the measurement runs the real model,
weights loaded, on a real padded batch, and counts each saved storage once by its address, parameters left out.
With gradient checkpointing both add one layer's full activations (the layer being recomputed) to what
the checkpointed forward keeps. Target: every estimate within 20% of its measurement.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from train.config import AdapterSpec, ModelSpec, TrainJob
from train.memory import activation_line, layer_count, step_inputs
from train.model import model_class, new_adapter
from train.preflight import meta_model

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "tiny-llama": ("causal", "all-linear"),
    "tiny-t5": ("seq2seq", ["q", "k", "v", "o", "wi_0", "wi_1", "wo"]),
}
SHAPES = [(1, 32), (4, 64), (8, 128), (16, 256)]


def measured_bytes(model, inputs: dict) -> int:
    """Each saved storage once, by address; the storages are held until the end, so a freed address is
    never reused by another tensor and counted once for two."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, torch.UntypedStorage] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(**inputs)
    return sum(storage.nbytes() for storage in saved.values())


def real_model(folder: Path, kind: str, targets):
    model = model_class(kind).from_pretrained(folder, dtype=torch.float32)
    model = new_adapter(model, AdapterSpec(rank=8, alpha=16, dropout=0.0, target_modules=targets), kind)
    return model.train()


def measured(model, kind: str, batch: int, length: int, checkpointing: bool) -> int:
    inputs = step_inputs(kind, batch, length, length, "cpu")
    # One padded position, as dynamic padding leaves in almost every batch: the model then builds its full
    # attention mask (an all-ones mask lets it skip that, which no padded training batch can).
    inputs["attention_mask"][0, -1] = 0
    full = measured_bytes(model, inputs)
    if not checkpointing:
        return full
    base = model.get_base_model()
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        return measured_bytes(model, inputs) + full // layer_count(base.config)
    finally:
        base.gradient_checkpointing_disable()


def rows() -> list[dict]:
    out = []
    for name, (kind, targets) in MODELS.items():
        folder = ROOT / "models" / name
        job = TrainJob(
            experiment="bench",
            stage="s",
            model=ModelSpec(name_or_path=str(folder), kind=kind),
            adapter=AdapterSpec(rank=8, alpha=16, dropout=0.0, target_modules=targets),
            data={"train": "unused.jsonl"},
            train={},
            run_dir="unused",
        )
        meta, _ = meta_model(job)
        real = real_model(folder, kind, targets)
        for batch, length in SHAPES:
            for checkpointing in (False, True):
                shared, per_example = activation_line(meta, kind, length, length, checkpointing)
                estimate = shared + batch * per_example
                actual = measured(real, kind, batch, length, checkpointing)
                out.append(
                    {
                        "model": name,
                        "batch": batch,
                        "length": length,
                        "checkpointing": checkpointing,
                        "estimate_mb": round(estimate / 2**20, 3),
                        "measured_mb": round(actual / 2**20, 3),
                        "error_percent": round(100 * (estimate - actual) / actual, 1),
                    }
                )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    table = rows()
    if parser.parse_args().json:
        print(json.dumps(table, indent=1))
    else:
        print(
            f"{'model':<11} {'batch':>5} {'len':>4} {'ckpt':>5} {'estimate MB':>12} {'measured MB':>12} {'error':>7}"
        )
        for r in table:
            print(
                f"{r['model']:<11} {r['batch']:>5} {r['length']:>4} {str(r['checkpointing']):>5} "
                f"{r['estimate_mb']:>12} {r['measured_mb']:>12} {r['error_percent']:>6}%"
            )
    worst = max(abs(r["error_percent"]) for r in table)
    print(f"worst error {worst}% (target: within 20%)")
    return 0 if worst <= 20 else 1


if __name__ == "__main__":
    raise SystemExit(main())
