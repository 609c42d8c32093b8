"""Our trainer against plain Hugging Face setups on the same model, data and LoRA config. Prints figures.

    python -m bench.train_throughput [--epochs 2] [--json]

Runs where train/device.py places this process (its GPU when there is one, in that GPU's precision), as the
trainer does; on a GPU it adds model FLOPs utilisation.

- "users' setup": every batch padded to a fixed max_length of 4x the data's mean length, random order, fp32,
  and a generation eval at the end of every epoch (what people ran before this project);
- "tuned HF": length-grouped batches, dynamic padding, same precision as ours, no generation eval;
- "ours": train.recipe.run_stage, as a job runs it (loss-only eval each epoch, checkpoints, metrics files);
- "ours, no eval": the same with `eval_every_epochs: null`, the work tuned HF does: what the in-training
  eval costs is the difference between the two rows (on the demo data, dev is a fifth of train's size).

Throughput is non-pad tokens per second of wall time from the start of training to the saved adapter.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from peft import LoraConfig, TaskType, get_peft_model  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    DataCollatorForSeq2Seq,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from core.config import DataSpec, TrainJob  # noqa: E402
from demo.tiny import build_tiny_models, tiny_llama  # noqa: E402
from train import data as data_lib  # noqa: E402
from train.device import Placement, current  # noqa: E402
from train.model import load_tokenizer  # noqa: E402
from train.recipe import StageRecipe  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DATA = DataSpec(
    train=str(ROOT / "data/demo/sql/train.jsonl"),
    eval=str(ROOT / "data/demo/sql/dev.jsonl"),
    input_field="question",
    target_field="sql",
    prompt_template="{schema} | {question} | SQL: ",
)
LORA = {"rank": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear", "max_trainable_percent": 100}


class StepTimer(TrainerCallback):
    """Time spent inside optimizer steps (forward, backward, update): everything else is overhead."""

    def __init__(self):
        self.step_s, self.started = 0.0, None

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_s += time.perf_counter() - self.started


class CountingCollator:
    """Wraps a collator and counts real and padded input tokens of every batch it builds."""

    def __init__(self, inner):
        self.inner, self.real, self.total = inner, 0, 0

    def __call__(self, features):
        batch = self.inner(features)
        self.real += int(batch["attention_mask"].sum())
        self.total += batch["attention_mask"].numel()
        return batch

    @property
    def padding(self) -> float:
        return 1 - self.real / self.total if self.total else 0.0


class GenerateEachEpoch(TrainerCallback):
    """The users' habit: generate on the whole eval set after every epoch."""

    def __init__(self, tokenizer, prompts):
        self.tokenizer, self.prompts = tokenizer, prompts

    def on_epoch_end(self, args, state, control, model=None, **kwargs):
        model.eval()
        self.tokenizer.padding_side = "left"
        with torch.no_grad():
            for i in range(0, len(self.prompts), 16):
                batch = self.tokenizer(self.prompts[i : i + 16], return_tensors="pt", padding=True).to(
                    model.device
                )
                model.generate(
                    **batch, max_new_tokens=48, do_sample=False, pad_token_id=self.tokenizer.pad_token_id
                )
        self.tokenizer.padding_side = "right"
        model.train()


def bench_model(folder: Path, placement: Placement) -> Path:
    """A small Llama (about 4M parameters on CPU, 120M on a GPU) with the demo tokenizer."""
    tiny = build_tiny_models(folder)["tiny-llama"]
    tokenizer = load_tokenizer(str(tiny), DATA_MODEL(tiny))
    big = placement.cuda
    torch.manual_seed(0)
    model = tiny_llama(
        len(tokenizer),
        hidden_size=768 if big else 256,
        intermediate_size=2048 if big else 688,
        num_hidden_layers=12 if big else 4,
        num_attention_heads=12 if big else 8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    )
    out = folder / "bench-llama"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def DATA_MODEL(path: Path):  # noqa: N802 - a ModelSpec for a folder
    from core.config import ModelSpec

    return ModelSpec(name_or_path=str(path), kind="causal")


def hf_run(model_dir: Path, placement: Placement, epochs: int, users: bool) -> dict:
    """users: fp32, as people ran it; tuned: the placement's precision, as ours."""
    tokenizer = load_tokenizer(str(model_dir), DATA_MODEL(model_dir))
    tokenizer.padding_side = "right"
    dataset = data_lib.tokenized(DATA.train, DATA, tokenizer, "causal")
    mean = sum(dataset["length"]) / len(dataset)
    fixed = int(4 * mean)
    if users:  # every example padded to the same fixed length
        dataset = dataset.map(lambda row: pad_to(row, fixed, tokenizer.pad_token_id))
    torch.manual_seed(0)
    dtype = torch.float32 if users else placement.load_dtype
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(placement.device)
    lora = LoraConfig(
        task_type=TaskType.CAUSAL_LM, r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"
    )
    model = get_peft_model(model, lora)
    timer = StepTimer()
    callbacks = [timer]
    if users:
        prompts, _ = data_lib.prompts_and_targets(DATA.eval, DATA, tokenizer, "causal")
        callbacks.append(GenerateEachEpoch(tokenizer, prompts))
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        num_train_epochs=epochs,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        report_to="none",
        save_strategy="no",
        logging_steps=50,
        disable_tqdm=True,
        use_cpu=not placement.cuda,
        bf16=placement.bf16 and not users,
        fp16=placement.fp16 and not users,
        tf32=(placement.tf32 and not users) or None,
        remove_unused_columns=False,
        include_num_input_tokens_seen="non_padding",
        train_sampling_strategy="random" if users else "group_by_length",
    )
    inner = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)
    collator = CountingCollator(lambda f: inner([{k: v for k, v in x.items() if k in KEEP} for x in f]))
    trainer = Trainer(
        model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=callbacks
    )
    started = time.perf_counter()
    trainer.train()
    model.save_pretrained(tempfile.mkdtemp())
    wall = time.perf_counter() - started
    return figures(collator.real, wall, timer.step_s, collator.padding)


KEEP = ("input_ids", "labels", "attention_mask")


def pad_to(row: dict, length: int, pad_id: int) -> dict:
    ids, labels = row["input_ids"][:length], row["labels"][:length]
    extra = length - len(ids)
    return {
        "input_ids": ids + [pad_id] * extra,
        "labels": labels + [-100] * extra,
        "attention_mask": [1] * len(ids) + [0] * extra,
    }


def figures(tokens: int, wall: float, step_s: float, padding: float) -> dict:
    return {
        "tokens_per_s": round(tokens / wall, 1),
        "wall_s": round(wall, 2),
        "padding_fraction": round(padding, 4),
        "non_training_fraction": round(max(0.0, 1 - step_s / wall), 4),
    }


def ours(model_dir: Path, epochs: int, run_dir: Path, evaluate: bool = True) -> dict:
    job = TrainJob(
        experiment="bench",
        stage="train",
        model={"name_or_path": str(model_dir), "kind": "causal"},
        adapter=LORA,
        data=DATA,
        train={
            "epochs": epochs,
            "learning_rate": 3e-3,
            "batch_size": 8,
            "warmup_ratio": 0,
            "save_every_steps": 200,
            "logging_steps": 50,
            "eval_every_epochs": 1 if evaluate else None,
        },
        run_dir=str(run_dir),
    )
    recipe = StageRecipe(job, threading.Event())
    recipe.setup()
    trainer = recipe.trainer
    timer, collator = StepTimer(), CountingCollator(trainer.data_collator)
    trainer.add_callback(timer)
    trainer.data_collator = collator
    make_eval_loader = trainer.get_eval_dataloader

    def uncounted_eval_loader(*args, **kwargs):  # count training batches only
        trainer.data_collator = collator.inner
        try:
            return make_eval_loader(*args, **kwargs)
        finally:
            trainer.data_collator = collator

    trainer.get_eval_dataloader = uncounted_eval_loader
    started = time.perf_counter()
    recipe.train()
    recipe.save()
    wall = time.perf_counter() - started
    return figures(collator.real, wall, timer.step_s, collator.padding)


# Dense bf16 peak of the GPUs people run this on (no sparsity), for model FLOPs utilisation.
PEAK_BF16_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
    "L4": 121e12,
}


def model_flops_utilisation(tokens_per_s: float, params: int, gpu_name: str) -> float | None:
    """6 N FLOPs per token (forward + backward, the usual estimate; a frozen base skips its weight
    gradients, so for LoRA this overstates the work a little) over the GPU's dense bf16 peak."""
    peak = next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in gpu_name), None)
    return round(6 * params * tokens_per_s / peak, 4) if peak else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    placement = current("auto")  # the trainer's own choice: "ours" runs through the same call
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench_model(Path(tmp), placement)
        results = {
            "users_setup": hf_run(model_dir, placement, args.epochs, users=True),
            "tuned_hf": hf_run(model_dir, placement, args.epochs, users=False),
            "ours": ours(model_dir, args.epochs, Path(tmp) / "run"),
            "ours_no_eval": ours(model_dir, args.epochs, Path(tmp) / "run-no-eval", evaluate=False),
        }
        if placement.cuda:
            params = LlamaForCausalLM.from_pretrained(model_dir).num_parameters()
            for row in results.values():
                row["mfu"] = model_flops_utilisation(row["tokens_per_s"], params, placement.device_name)
    for name, row in results.items():
        print(
            f"{name:13s} {row['tokens_per_s']:>10.1f} non-pad tokens/s  wall {row['wall_s']:>7.2f} s  "
            f"padding {row['padding_fraction']:.1%}  non-training {row['non_training_fraction']:.1%}"
            + (f"  MFU {row['mfu']:.1%}" if row.get("mfu") is not None else "")
        )
    summary = {
        "ratio": round(results["ours"]["tokens_per_s"] / results["users_setup"]["tokens_per_s"], 2),
        "ratio_vs_tuned": round(results["ours"]["tokens_per_s"] / results["tuned_hf"]["tokens_per_s"], 2),
        "padding_fraction": results["ours"]["padding_fraction"],
        "non_training_fraction": results["ours"]["non_training_fraction"],
        "device": placement.device,
        "device_name": placement.device_name,
        "precision": placement.precision,
        **results,
    }
    summary["ratio_vs_tuned_no_eval"] = round(
        results["ours_no_eval"]["tokens_per_s"] / results["tuned_hf"]["tokens_per_s"], 2
    )
    print(
        f"ours / users' setup: {summary['ratio']}x   ours / tuned HF: {summary['ratio_vs_tuned']}x   "
        f"ours without the in-training eval / tuned HF: {summary['ratio_vs_tuned_no_eval']}x"
    )
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    sys.exit(main())
