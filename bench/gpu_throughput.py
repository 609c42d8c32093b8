"""Throughput at the size users train: our trainer against tuned Hugging Face setups, warm. Prints figures.

    python -m bench.gpu_throughput [--examples 400] [--repeats 2] [--json]

On a GPU: a Qwen2.5-0.5B-shaped model (494 M parameters, Qwen's vocabulary of 151,936; random weights, the
demo tokenizer), ~240-token prompts built from the demo SQL data (a ~30-token answer: ~89 % of positions carry
no label), LoRA r16 on every linear layer, bf16, one epoch. On a CPU the same rows on a tiny Qwen2 (so the
command answers anywhere; the figures that matter are the GPU's). Rows, all on the same tokenized data:

- tuned HF 4x8: the user's config (`batch_size: 4, grad_accum: 8`) in a tuned HF Trainer (bf16, length-grouped
  batches, dynamic padding to a multiple of 8, fused AdamW, 4 loader workers);
- tuned HF at auto's split, plain and + Liger (Liger's kernels: where liger-kernel is installed, on CUDA): the
  best a user reaches by hand at the split our trainer chose;
- ours 4x8 auto: the same config through train.recipe with `micro_batch: auto` (what a job runs); its setup
  (loading, choosing the split) is outside its timed window and printed beside it;
- ours 8x1 and tuned HF 8x1: no accumulation to trade, our own overhead alone.

Measured warm: first an untimed run of every kernel path (HF plain, HF + Liger, ours) on a few batches in this
process (Triton compiles Liger's kernels there, cuBLAS picks its algorithms); then the rows interleaved, each
`--repeats` times; each row's median tokens/s and its spread (min, max). Two headline numbers:
- the split gain: ours auto / tuned HF at the user's 4x8 (what choosing the split buys);
- the trainer at equal split: ours auto / the best tuned HF row at the same split (plain or + Liger).

Tokens are counted from the dataset (every example's non-pad tokens, once per epoch), not in a collator: the
trainer's loader workers run the collator in other processes. Wall: from the start of training to the saved
adapter. Peak GB: torch.cuda.max_memory_allocated, and the allocator's reserved peak beside it. MFU: 6 N
FLOPs per token over the GPU's dense bf16 peak. Checks: the adapters of two different splits of one effective
batch agree (on a CPU auto is given a GPU's free memory through train/device.py's seam, so that it chooses a
split other than the written one), and the examples each trained; the memory model's estimate for the split
auto chose against the measured peak. The result carries the commit it was measured at.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from peft import LoraConfig, TaskType, get_peft_model  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    DataCollatorForSeq2Seq,
    Trainer,
    TrainingArguments,
)

from bench.train_throughput import StepTimer, model_flops_utilisation  # noqa: E402
from core.config import DataSpec, ModelSpec, TrainJob  # noqa: E402
from demo.tiny import build_tiny_models  # noqa: E402
from train import data as data_lib  # noqa: E402
from train.device import FAKE_FREE_GPU_GB, Placement, current  # noqa: E402
from train.memory import CUDA_RESERVE_GB  # noqa: E402
from train.model import load_tokenizer  # noqa: E402
from train.recipe import StageRecipe  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# Qwen/Qwen2.5-0.5B's config.json, as published: the shapes are what matter, the weights are random.
QWEN_05B = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
TINY_QWEN = QWEN_05B | {
    "vocab_size": 4096,
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
LORA = {"rank": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear", "max_trainable_percent": 100}
PROMPT_TOKENS = 240
LEARNING_RATE = 2e-4


def data_spec(train: Path) -> DataSpec:
    return DataSpec(
        train=str(train), input_field="question", target_field="sql", prompt_template="{question}\nSQL: "
    )


def build_model(folder: Path, placement: Placement) -> Path:
    """The Qwen2.5-0.5B shape on a GPU (a tiny Qwen2 on a CPU), random weights, the demo tokenizer."""
    tokenizer_dir = build_tiny_models(ROOT / "models")["tiny-llama"]
    tokenizer = load_tokenizer(str(tokenizer_dir), ModelSpec(name_or_path=str(tokenizer_dir), kind="causal"))
    shape = QWEN_05B if placement.cuda else TINY_QWEN
    config = AutoConfig.for_model("qwen2", **shape)
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    with torch.device(placement.device):  # random weights drawn on the GPU: seconds, not a minute
        model = AutoModelForCausalLM.from_config(config, dtype=placement.load_dtype)
    out = folder / "qwen-shaped"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_data(folder: Path, tokenizer, examples: int) -> Path:
    """`examples` rows whose prompt is a schema and demo questions up to ~PROMPT_TOKENS tokens, the target
    one of their SQL queries: the length of prompts users train on, from the demo's own words."""
    rows = [
        json.loads(line) for line in (ROOT / "data/demo/sql/train.jsonl").read_text().splitlines() if line
    ]
    rng = random.Random(0)
    out = folder / "long-prompts.jsonl"
    with out.open("w") as fh:
        for i in range(examples):
            row = rng.choice(rows)
            parts = [row["schema"]]
            while len(tokenizer(" | ".join(parts))["input_ids"]) < rng.randint(
                PROMPT_TOKENS - 40, PROMPT_TOKENS + 40
            ):
                parts.append(rng.choice(rows)["question"])
            parts.append(row["question"])
            fh.write(json.dumps({"id": f"long-{i}", "question": " | ".join(parts), "sql": row["sql"]}) + "\n")
    return out


def measured(run, tokens: int, placement: Placement, params: int) -> dict:
    """Run `run()` (returns (step seconds, extra figures)) and its figures: tokens/s, wall, peak GB, MFU."""
    if placement.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    step_s, extra = run()
    if placement.cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - started
    row = {
        "tokens_per_s": round(tokens / wall, 1),
        "wall_s": round(wall, 2),
        "non_training_fraction": round(max(0.0, 1 - step_s / wall), 4),
        **extra,
    }
    if placement.cuda:
        row["peak_gb"] = round(torch.cuda.max_memory_allocated() / 10**9, 2)
        row["peak_reserved_gb"] = round(torch.cuda.max_memory_reserved() / 10**9, 2)
        row["mfu"] = model_flops_utilisation(row["tokens_per_s"], params, placement.device_name)
    return row


def hf_row(
    model_dir: Path,
    dataset,
    placement: Placement,
    micro: int,
    accum: int,
    liger: bool = False,
    compile_: bool = False,
):
    """A tuned HF Trainer run of one epoch; returns (step seconds, figures)."""
    tokenizer = load_tokenizer(str(model_dir), ModelSpec(name_or_path=str(model_dir), kind="causal"))
    tokenizer.padding_side = "right"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=placement.load_dtype).to(placement.device)
    lora = LoraConfig(
        task_type=TaskType.CAUSAL_LM, r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"
    )
    model = get_peft_model(model, lora)
    timer = StepTimer()
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        num_train_epochs=1,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum,
        learning_rate=LEARNING_RATE,
        report_to="none",
        save_strategy="no",
        logging_steps=50,
        disable_tqdm=True,
        use_cpu=not placement.cuda,
        bf16=placement.bf16,
        tf32=placement.tf32 or None,
        optim="adamw_torch_fused",
        remove_unused_columns=False,
        train_sampling_strategy="group_by_length",
        dataloader_num_workers=placement.workers,
        dataloader_pin_memory=placement.pin_memory,
        use_liger_kernel=liger,
        torch_compile=compile_,
    )
    inner = DataCollatorForSeq2Seq(
        tokenizer, label_pad_token_id=-100, pad_to_multiple_of=placement.pad_to_multiple_of
    )
    keep = ("input_ids", "labels", "attention_mask")
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=lambda f: inner([{k: v for k, v in x.items() if k in keep} for x in f]),
        callbacks=[timer],
    )

    def run():
        trainer.train()
        model.save_pretrained(tempfile.mkdtemp())
        return timer.step_s, {
            "split": f"{micro}x{accum}",
            "train_loss": round(trainer.state.log_history[-1].get("train_loss", float("nan")), 4),
        }

    return run


def ours_row(model_dir: Path, data: Path, run_dir: Path, batch: int, accum: int, micro="auto"):
    """train.recipe as a job runs it (no in-training eval: the work the HF rows do)."""
    job = TrainJob(
        experiment="bench",
        stage="train",
        model={"name_or_path": str(model_dir), "kind": "causal"},
        adapter=LORA,
        data=data_spec(data),
        train={
            "epochs": 1,
            "learning_rate": LEARNING_RATE,
            "batch_size": batch,
            "grad_accum": accum,
            "micro_batch": micro,
            "warmup_ratio": 0,
            "save_every_steps": 10_000,
            "logging_steps": 50,
            "eval_every_epochs": None,
        },
        run_dir=str(run_dir),
    )
    setup_started = time.perf_counter()
    recipe = StageRecipe(job, threading.Event())
    recipe.setup()
    setup_s = time.perf_counter() - setup_started
    timer = StepTimer()
    recipe.trainer.add_callback(timer)

    def run():
        recipe.train()
        recipe.save()
        summary = json.loads((run_dir / "summary.json").read_text())
        split = recipe.split
        return timer.step_s, {
            "split": split.short(),
            "split_reason": split.describe(),
            "split_estimate_gb": None if split.peak_gb is None else round(split.peak_gb - CUDA_RESERVE_GB, 2),
            "setup_s": round(setup_s, 2),
            "train_loss": summary.get("final_train_loss"),
        }

    run.recipe = recipe  # the split it chose, before it runs
    return run


def same_adapter_check(model_dir: Path, data: Path, tmp: Path, placement: Placement, liger: bool) -> dict:
    """The user's 4x8 as written (micro_batch: 4) against auto's split (on a CPU, auto is given an 80 GB GPU's
    free memory through the seam train/device.py FAKE_FREE_GPU_GB, so that it chooses another split and
    still trains here), and (with Liger on a GPU) auto on a 12 GB GPU, where the fused loss buys a larger
    micro-batch; on the first CHECK_EXAMPLES examples: each adapter's relative difference from the auto one,
    the split each ran and the examples each trained."""
    subset = tmp / "check.jsonl"
    subset.write_text("".join(data.read_text().splitlines(keepends=True)[:CHECK_EXAMPLES]))
    runs = {"auto": ("auto", None if placement.cuda else "80"), "written": (4, None)}
    if liger and placement.cuda:
        runs["auto_on_12gb"] = ("auto", "12")
    splits, examples, differences = {}, {}, {}
    for name, (micro, free_gb) in runs.items():
        gc.collect()
        if free_gb:
            os.environ[FAKE_FREE_GPU_GB] = free_gb
        try:
            splits[name] = ours_row(model_dir, subset, tmp / f"check-{name}", 4, 8, micro=micro)()[1]["split"]
            summary = json.loads((tmp / f"check-{name}" / "summary.json").read_text())
            examples[name] = summary["train_examples"]
            if name != "auto":
                differences[name] = adapter_difference(
                    tmp / f"check-{name}" / "adapter", tmp / "check-auto" / "adapter"
                )
        except Exception as exc:  # a failing run is a finding to print, not a reason to lose the rows
            differences[name] = f"failed: {type(exc).__name__}: {exc}"
        finally:
            os.environ.pop(FAKE_FREE_GPU_GB, None)
    different = len(set(splits.values())) == len(splits)
    return {
        "examples": examples,
        "splits": splits,
        "splits_differ": different,
        "relative_difference": differences,
    }


CHECK_EXAMPLES = 160


def adapter_difference(a: Path, b: Path) -> float:
    """||A - B|| / ||B|| over every adapter tensor: two splits of one effective batch train the same adapter
    up to the rounding of their sums (bf16 on a GPU)."""
    first, second = load_file(a / "adapter_model.safetensors"), load_file(b / "adapter_model.safetensors")
    diff = sum(float((first[k].float() - second[k].float()).norm() ** 2) for k in second)
    norm = sum(float(second[k].float().norm() ** 2) for k in second)
    return round((diff / norm) ** 0.5, 5)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--examples", type=int, default=None, help="default: 400 on a GPU, 48 on a CPU")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each row, interleaved")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="instead: tuned HF at 32x1 with and without torch.compile (is train.compile worth adding?)",
    )
    args = parser.parse_args(argv)
    placement = current("auto")
    examples = args.examples or (400 if placement.cuda else 48)
    liger = liger_usable(placement)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = build_model(tmp, placement)
        tokenizer = load_tokenizer(str(model_dir), ModelSpec(name_or_path=str(model_dir), kind="causal"))
        data = build_data(tmp, tokenizer, examples)
        dataset = data_lib.tokenized(str(data), data_spec(data), tokenizer, "causal")
        tokens = sum(data_lib.trained_tokens(dataset, "causal"))
        params = AutoModelForCausalLM.from_pretrained(model_dir).num_parameters()
        if args.compile:
            return compile_rows(model_dir, dataset, placement, tokens, params)
        micro, accum = auto_split(model_dir, data, tmp)
        plan = row_plan(model_dir, data, dataset, tmp, placement, (micro, accum), liger)
        warm_up(model_dir, data, tmp, placement, (micro, accum), liger)
        runs = interleaved(plan, args.repeats, tokens, placement, params)
        checks = {
            "adapter_4x8_auto_vs_as_written": same_adapter_check(model_dir, data, tmp, placement, liger)
        }
    rows = {name: summarised(found) for name, found in runs.items()}
    auto = rows["ours_4x8_auto"]
    if auto.get("peak_gb") and auto.get("split_estimate_gb"):
        checks["memory_estimate_vs_measured_percent"] = round(
            100 * (auto["split_estimate_gb"] / auto["peak_gb"] - 1), 1
        )
    result = {
        "commit": commit(),
        "device_name": placement.device_name,
        "precision": placement.precision,
        "examples": examples,
        "tokens_per_epoch": tokens,
        "params": params,
        "repeats": args.repeats,
        "auto_split": f"{micro}x{accum}",
        "rows": rows,
        "headline": headline(rows),
        "checks": checks,
        "skipped": {} if liger else {"tuned_hf_liger_auto": "liger-kernel not installed, or no CUDA GPU"},
    }
    print_rows(result)
    if args.json:
        print(json.dumps(result))
    return result


def liger_usable(placement: Placement) -> bool:
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return False
    return placement.cuda


def auto_split(model_dir: Path, data: Path, tmp: Path) -> tuple[int, int]:
    """The split our trainer chooses for the user's 4x8 here (its setup, untimed): the HF rows run at it."""
    recipe_run = ours_row(model_dir, data, tmp / "probe", 4, 8)
    split = recipe_run.recipe.split
    del recipe_run
    gc.collect()
    return split.micro_batch, split.grad_accum


def row_plan(model_dir, data, dataset, tmp, placement, split: tuple[int, int], liger: bool) -> dict:
    """Row name → a function that builds the row's run (untimed) and returns it."""
    micro, accum = split
    plan = {
        "tuned_hf_4x8": lambda: hf_row(model_dir, dataset, placement, 4, 8),
        "tuned_hf_auto": lambda: hf_row(model_dir, dataset, placement, micro, accum),
        "ours_4x8_auto": lambda: ours_row(model_dir, data, fresh(tmp, "auto"), 4, 8),
        "tuned_hf_8x1": lambda: hf_row(model_dir, dataset, placement, 8, 1),
        "ours_8x1": lambda: ours_row(model_dir, data, fresh(tmp, "8x1"), 8, 1),
    }
    if liger:
        plan["tuned_hf_liger_auto"] = lambda: hf_row(model_dir, dataset, placement, micro, accum, liger=True)
    return plan


def fresh(tmp: Path, name: str) -> Path:
    """A run folder not used before: a repeat must not resume the last one's checkpoint."""
    index = len(list(tmp.glob(f"{name}-*")))
    return tmp / f"{name}-{index}"


def warm_up(model_dir: Path, data: Path, tmp: Path, placement: Placement, split, liger: bool) -> None:
    """An untimed run of every kernel path (HF plain, HF + Liger, ours) on WARM_UP_STEPS optimizer steps
    at auto's split: Triton compiles Liger's kernels here, not in a timed row."""
    micro, accum = split
    subset = tmp / "warm-up.jsonl"
    lines = data.read_text().splitlines(keepends=True)[: WARM_UP_STEPS * micro * accum]
    subset.write_text("".join(lines))
    tokenizer = load_tokenizer(str(model_dir), ModelSpec(name_or_path=str(model_dir), kind="causal"))
    small = data_lib.tokenized(str(subset), data_spec(subset), tokenizer, "causal")
    hf_row(model_dir, small, placement, micro, accum)()
    if liger:
        hf_row(model_dir, small, placement, micro, accum, liger=True)()
    ours_row(model_dir, subset, tmp / "warm-up-ours", 4, 8)()
    gc.collect()


WARM_UP_STEPS = 2


def interleaved(plan: dict, repeats: int, tokens: int, placement: Placement, params: int) -> dict:
    """Every row `repeats` times, in turn (A B C A B C): a drift of the machine's speed touches all alike."""
    runs: dict[str, list[dict]] = {name: [] for name in plan}
    for repeat in range(repeats):
        for name, make in plan.items():
            gc.collect()  # the last row's model and optimizer: gone before this one measures or chooses
            if placement.cuda:
                torch.cuda.empty_cache()
            runs[name].append(measured(make(), tokens, placement, params))
            print(f"{name:22s} run {repeat + 1}: {json.dumps(runs[name][-1])}", file=sys.stderr, flush=True)
    return runs


def summarised(found: list[dict]) -> dict:
    """A row's runs: median tokens/s with its spread, the median of its other timings, its split."""
    speeds = [run["tokens_per_s"] for run in found]
    row = {
        "tokens_per_s": round(statistics.median(speeds), 1),
        "tokens_per_s_min": min(speeds),
        "tokens_per_s_max": max(speeds),
        "runs": len(found),
        "split": found[0]["split"],
    }
    for key in ("wall_s", "non_training_fraction", "setup_s", "train_loss", "mfu"):
        values = [run[key] for run in found if run.get(key) is not None]
        if values:
            row[key] = round(statistics.median(values), 4)
    for key in ("peak_gb", "peak_reserved_gb"):
        values = [run[key] for run in found if run.get(key) is not None]
        if values:
            row[key] = max(values)
    for key in ("split_reason", "split_estimate_gb"):
        if key in found[0]:
            row[key] = found[0][key]
    return row


def headline(rows: dict) -> dict:
    """The split gain (ours auto / tuned HF at the user's 4x8) and the trainer at equal split (ours auto /
    the best tuned HF row at auto's split, plain or + Liger), each from the rows' medians."""
    ours = rows["ours_4x8_auto"]["tokens_per_s"]
    peers = {
        name: rows[name]["tokens_per_s"] for name in ("tuned_hf_auto", "tuned_hf_liger_auto") if name in rows
    }
    best = max(peers, key=peers.get)
    return {
        "split_gain": round(ours / rows["tuned_hf_4x8"]["tokens_per_s"], 2),
        "trainer_at_equal_split": round(ours / peers[best], 2),
        "best_peer_at_equal_split": best,
        "ours_8x1_vs_tuned_hf_8x1": round(
            rows["ours_8x1"]["tokens_per_s"] / rows["tuned_hf_8x1"]["tokens_per_s"], 2
        ),
    }


def commit() -> str:
    """The commit the figures were measured at (+dirty when the work tree differs from it)."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return done.stdout.strip()

    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def print_rows(result: dict) -> None:
    for name, row in result["rows"].items():
        spread = f"({row['tokens_per_s_min']:.0f}-{row['tokens_per_s_max']:.0f}, {row['runs']} runs)"
        setup = f"  setup {row['setup_s']:.1f} s" if "setup_s" in row else ""
        memory = (
            f"  peak {row['peak_gb']:.1f} GB (reserved {row['peak_reserved_gb']:.1f})"
            if "peak_gb" in row
            else ""
        )
        print(
            f"{name:22s} {row['tokens_per_s']:>10.1f} tokens/s {spread}  split {row['split']:>9s}{setup}{memory}"
            f"  non-training {row['non_training_fraction']:.1%}"
        )
    print("headline:", json.dumps(result["headline"]), " commit:", result["commit"])
    print("checks:", json.dumps(result["checks"]))


def compile_rows(model_dir: Path, dataset, placement: Placement, tokens: int, params: int) -> dict:
    """torch.compile of the adapted model (through the Trainer's torch_compile) at the split auto chooses
    on an H100 (32 x 1), against the same run uncompiled: the ratio, and the losses (they must agree)."""
    rows = {}
    for name, compiled in (("tuned_hf_32x1", False), ("tuned_hf_32x1_compile", True)):
        gc.collect()
        rows[name] = measured(
            hf_row(model_dir, dataset, placement, 32, 1, compile_=compiled), tokens, placement, params
        )
        print(f"{name:22s} {json.dumps(rows[name])}", flush=True)
    ratio = round(rows["tuned_hf_32x1_compile"]["tokens_per_s"] / rows["tuned_hf_32x1"]["tokens_per_s"], 2)
    result = {"rows": rows, "compile_ratio": ratio}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
