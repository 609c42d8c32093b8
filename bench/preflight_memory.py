"""Preflight's memory estimate against the whole step's memory, measured on a CPU.

    python -m bench.preflight_memory [--json] [--quick | --only CASE ...]

For each model and shape, the estimate (train/memory_figures.py measure_memory: fake tensors, no weights) is
set against a real step of the same adapted model with random weights, held as a bf16 GPU holds it (bf16
weights, fp32 trainable parameters, bf16 autocast; QLoRA through bitsandbytes' 4-bit layers):

- train: forward, the trainer's loss, backward, fused AdamW step and zero_grad, after a first step that
  created AdamW's moments (as every step but the first finds them);
- eval: a no-grad forward and loss at the eval batch (twice the training batch, train/recipe.py);
- a DPO stage's train step (PREFERENCE_CASES, reference: base): TRL's own DPOTrainer.training_step, chosen
  and rejected as one batch, the reference forward with adapters disabled, the backward, then fused AdamW;
- a GRPO stage's whole step (GRPO_CASES): TRL's own GRPOTrainer.training_step for each micro-batch, the first
  generating every completion of the step at once through the stage's own generation (train/grpo.py
  sampled_completions, each completion made to run to max_completion_length) and, with beta > 0, the
  reference forward of the adapter's frozen copy (reference: previous); then fused AdamW. Set against the
  larger of the estimate's training step and generation.

Measured peak = what the step finds (weights, trainable parameters, moments, the batch) + the highest the
CPU allocator's live bytes rise above that during the step (torch.profiler's allocation events carry the
allocator's running total: the CPU's torch.cuda.max_memory_allocated). Compared without the estimate's
CUDA reserve, which no CPU has. Target: every row's error within 15 %, none under by more than 5 %.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import threading
from contextlib import nullcontext
from pathlib import Path
from unittest.mock import patch

import torch

from core.config import AdapterSpec, ModelSpec, TrainJob
from train.memory import CUDA_RESERVE_GB, EVAL_BATCH_FACTOR, GB, padded_length
from train.memory_figures import measure_memory, trainer_loss

ROOT = Path(__file__).resolve().parent.parent
QWEN = ROOT / "tests" / "fixtures" / "hub" / "Qwen" / "Qwen2.5-0.5B" / "config.json"
TOKENIZER = ROOT / "models" / "tiny-llama"
ALL_LINEAR = "all-linear"
T5_TARGETS = ["q", "k", "v", "o", "wi_0", "wi_1", "wo"]
MiB = 2**20

# A small model with Qwen2.5's 152k vocabulary, 4 layers deep
VOCAB152K_SMALL = {
    "from": QWEN,
    "num_hidden_layers": 4,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
# name → (kind, config.json changes, adapter changes,
#         [(batch, length, checkpointing[, grad_accum[, answer tokens per example]])])
CASES = {
    "tiny-llama": (
        "causal",
        {"from": ROOT / "models" / "tiny-llama" / "config.json"},
        {"rank": 8, "target_modules": ALL_LINEAR},
        [(4, 64, False), (16, 256, False), (16, 256, True)],
    ),
    "tiny-t5": (
        "seq2seq",
        {"from": ROOT / "models" / "tiny-t5" / "config.json"},
        {"rank": 8, "target_modules": T5_TARGETS},
        [(4, 64, False), (16, 256, False), (16, 256, True)],
    ),
    # Qwen2.5-0.5B as published: the estimate runs 1 and 2 of its 24 layers and extrapolates.
    "qwen0.5b": ("causal", {"from": QWEN}, {"rank": 16, "target_modules": ALL_LINEAR}, [(2, 512, False)]),
    # Qwen2.5-0.5B's layers and 152k vocabulary, 4 layers deep.
    "qwen0.5b-4l": (
        "causal",
        {"from": QWEN, "num_hidden_layers": 4},
        {"rank": 16, "target_modules": ALL_LINEAR},
        [(2, 512, False), (2, 512, True)],
    ),
    # A small model with Qwen's vocabulary: the logits and the loss are most of the step.
    "vocab152k-small": (
        "causal",
        VOCAB152K_SMALL,
        {"rank": 16, "target_modules": ALL_LINEAR},
        [(4, 512, False), (4, 512, False, 1, 64)],  # the second: prompt-heavy, 64 answer tokens of 512
    ),
    "vocab152k-lm_head": (
        "causal",
        VOCAB152K_SMALL | {"tie_word_embeddings": False},
        {
            "rank": 16,
            "target_modules": ALL_LINEAR,
            "modules_to_save": ["lm_head"],
            "allow_full_modules": True,
        },
        [(2, 256, False), (2, 256, False, 2)],  # accumulating: its 39M-row gradient held throughout
    ),
    "qwen0.5b-4l-qlora": (
        "causal",
        {"from": QWEN, "num_hidden_layers": 4},
        {"method": "qlora", "rank": 16, "target_modules": ALL_LINEAR},
        [(2, 512, False), (2, 512, True)],
    ),
    "qwen0.5b-4l-qlora-nodq": (
        "causal",
        {"from": QWEN, "num_hidden_layers": 4},
        {"method": "qlora", "rank": 16, "target_modules": ALL_LINEAR, "double_quant": False},
        [(2, 512, False)],
    ),
}
# DPO stages (TRL's step, reference: base): name → (config.json changes, adapter, [(pairs, length, answer tokens)])
PREFERENCE_CASES = {
    "tiny-llama-dpo": (
        {"from": ROOT / "models" / "tiny-llama" / "config.json"},
        {"rank": 8, "target_modules": ALL_LINEAR},
        [(4, 64, 16), (4, 128, 32), (8, 128, 64)],
    ),
}
# GRPO stages (TRL's step, the generation included): name → (config.json changes, adapter,
#   [(prompts per step, num_generations, micro-batch in completions, prompt tokens, completion tokens, beta)])
GRPO_CASES = {
    "tiny-llama-grpo": (
        {"from": ROOT / "models" / "tiny-llama" / "config.json"},
        {"rank": 8, "target_modules": ALL_LINEAR},
        [(2, 4, 8, 32, 32, 0.0), (4, 8, 8, 64, 64, 0.0), (4, 4, 4, 64, 64, 0.04)],
    ),
    # A deeper, wider model with few KV heads and Qwen's vocabulary: many completions make the KV cache count.
    "vocab152k-small-grpo": (
        VOCAB152K_SMALL,
        {"rank": 16, "target_modules": ALL_LINEAR},
        [(8, 8, 8, 64, 128, 0.0), (2, 4, 8, 64, 64, 0.04)],
    ),
    # Eight layers of full multi-head attention with a small vocabulary: the KV cache is most of a generation.
    "kv-heavy-grpo": (
        {
            "from": ROOT / "models" / "tiny-llama" / "config.json",
            "num_hidden_layers": 8,
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "head_dim": 32,
        },
        {"rank": 8, "target_modules": ALL_LINEAR},
        [(8, 8, 2, 64, 128, 0.0), (4, 8, 4, 64, 128, 0.04)],
    ),
}
QUICK = ("tiny-llama", "tiny-t5", "vocab152k-small", "tiny-llama-dpo", "tiny-llama-grpo")


# ---- the model, as a job holds it ------------------------------------------------------------------------
def model_folder(root: Path, name: str, changes: dict, kind: str) -> Path:
    """A folder with config.json and random bf16 weights (QLoRA quantizes them as it loads)."""
    from train.model import model_class

    config = json.loads(Path(changes["from"]).read_text())
    config |= {key: value for key, value in changes.items() if key != "from"}
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    model_class(kind).from_config(model_config(folder), dtype=torch.bfloat16).save_pretrained(folder)
    return folder


def model_config(folder: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def gpu_like_placement():
    """The CPU placement, holding weights as a bf16 GPU does: bf16 weights, 4-bit layers computing in bf16."""
    from dataclasses import replace

    from train.device import Hardware, decide

    cpu = decide(Hardware(), "bf16")
    return replace(cpu, load_dtype=torch.bfloat16, compute_dtype=torch.bfloat16)


def real_model(job: TrainJob, cuda: bool = False):
    """The trainer's own loading path (train/model.py load_base, new_adapter), on the CPU held as a bf16 GPU
    holds it, or (`cuda`) on this machine's GPU as the job places it (train/device.py)."""
    from train.device import current
    from train.model import load_base, new_adapter

    base = load_base(job.model, job.adapter, current("bf16") if cuda else gpu_like_placement())
    return new_adapter(base, job.adapter, job.model.kind).train()


def bench_job(
    folder: Path, kind: str, adapter: dict, batch: int, checkpointing: bool, grad_accum: int = 1
) -> TrainJob:
    return TrainJob(
        experiment="bench",
        stage="s",
        model=ModelSpec(name_or_path=str(folder), kind=kind),
        adapter=AdapterSpec(**({"alpha": 16, "dropout": 0.0} | adapter)),
        data={"train": "unused.jsonl", "eval": "unused-eval.jsonl"},
        train={
            "batch_size": batch,
            "gradient_checkpointing": checkpointing,
            "grad_accum": grad_accum,
            "precision": "bf16",
            "eval_every_epochs": 1,
        },
        run_dir="unused",
    )


# ---- measuring -----------------------------------------------------------------------------------------
def real_inputs(
    kind: str, vocab: int, batch: int, length: int, targets: int | None = None
) -> tuple[dict, torch.Tensor]:
    """(model inputs, labels): random tokens, one padded position (as dynamic padding leaves in almost
    every batch, so the model builds its full attention mask); `targets`: the answer's tokens at the end of
    each example, the prompt before them masked (None: every token a target)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, -1] = 0
    labels = ids.clone()
    labels[0, -1] = -100
    if targets is not None and kind != "seq2seq":
        labels[:, : length - targets] = -100
    if kind != "seq2seq":
        return {"input_ids": ids, "attention_mask": mask}, labels
    decoder = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1]], 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder}, labels


def train_step(model, optimizer, loss, inputs: dict, labels: torch.Tensor, accumulate: int = 1) -> None:
    """One step as the Trainer takes it: per micro-batch an autocast forward and loss and a backward, then
    fused AdamW and zero_grad."""
    for _ in range(accumulate):
        with torch.autocast("cpu", dtype=torch.bfloat16), loss.output_at_targets(model, labels):
            value = loss(model(**inputs), labels) / accumulate
        value.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def eval_step(model, loss, inputs: dict, labels: torch.Tensor) -> None:
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), loss.output_at_targets(model, labels):
        loss(model(**inputs), labels)
    model.train()


def profiled_rise(step) -> int:
    """The highest the CPU allocator's live bytes rise above their level when `step` starts."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted(
        (
            e
            for e in walk(prof.profiler.kineto_results.experimental_event_tree())
            if e.tag == _EventType.Allocation
        ),
        key=lambda e: e.start_time_ns,
    )
    if not events:
        return 0
    start = events[0].extra_fields.total_allocated - events[0].extra_fields.alloc_size
    return max(0, max(e.extra_fields.total_allocated for e in events) - start)


def walk(nodes):
    for node in nodes:
        yield node
        yield from walk(node.children)


def held_bytes(tensors) -> int:
    """Bytes of the distinct storages among `tensors`."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def weight_tensors(model, trainable: bool) -> list[torch.Tensor]:
    """Parameters (frozen or trainable) with a 4-bit weight's quantization constants, and buffers."""
    found = []
    for param in model.parameters():
        if param.requires_grad != trainable:
            continue
        found.append(param)
        state = getattr(param, "quant_state", None)
        while state is not None:
            found += [t for t in (state.absmax, state.code, state.offset) if isinstance(t, torch.Tensor)]
            state = state.state2
    return found + ([] if trainable else list(model.buffers()))


def measured(job: TrainJob, length: int, targets: int | None = None) -> dict[str, int]:
    """Bytes: the frozen weights as held, and the train and eval steps' peaks. `targets`: real_inputs'."""
    kind, batch = job.model.kind, job.train.batch_size
    model = real_model(job)
    if job.train.gradient_checkpointing:  # as the Trainer enables it
        model.get_base_model().activation_checkpointing_enable()
    vocab = model.get_input_embeddings().weight.shape[0]
    loss = trainer_loss(kind)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, fused=True)  # the Trainer's adamw_torch_fused
    train_step(model, optimizer, loss, *real_inputs(kind, vocab, 1, 8))  # creates the moments
    moments = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    weights = held_bytes(weight_tensors(model, trainable=False))
    held = weights + held_bytes(trainable + moments)
    inputs, labels = real_inputs(kind, vocab, batch, length, targets)
    train = held + held_bytes([*inputs.values(), labels])
    accumulate = job.train.grad_accum
    train += profiled_rise(lambda: train_step(model, optimizer, loss, inputs, labels, accumulate))
    inputs, labels = real_inputs(kind, vocab, EVAL_BATCH_FACTOR * batch, length, targets)
    eval_ = held + held_bytes([*inputs.values(), labels])
    eval_ += profiled_rise(lambda: eval_step(model, loss, inputs, labels))
    return {"weights": weights, "train": train, "eval": eval_}


def preference_job(job: TrainJob) -> TrainJob:
    """The job as a DPO stage (reference: base, no in-training eval): its step is TRL's."""
    written = job.model_dump(exclude_unset=True)
    written["train"] |= {"method": "dpo", "eval_every_epochs": None, "dpo": {"reference": "base"}}
    written["data"] = {"train": "unused.jsonl", "format": "preference"}
    return TrainJob.model_validate(written)


def measured_preference(job: TrainJob, length: int, targets: int) -> dict[str, int]:
    """Bytes: the frozen weights, and TRL's own DPO training step (DPOTrainer.training_step: chosen and
    rejected as one batch, the reference forward with adapters disabled, the backward) on `batch` pairs of
    `length` tokens, `targets` of them each answer's, with the fused AdamW step and zero_grad after it."""
    import datasets
    from transformers import AutoTokenizer
    from trl import DPOConfig
    from trl.trainer import utils as trl_utils

    from train.callbacks import StopWhenAsked
    from train.preference import dpo_trainer_class

    model = real_model(job)
    pairs = [
        {"prompt_ids": [5] * (length - targets), "chosen_ids": [6] * targets, "rejected_ids": [7] * targets}
    ]
    args = DPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=job.train.batch_size,
        bf16=True,
        use_cpu=True,
        max_length=None,
        report_to=[],
        gradient_checkpointing=job.train.gradient_checkpointing,
        disable_dropout=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)  # TRL wants one; the batches are token ids
    train_set = datasets.Dataset.from_list(pairs)
    trainer = dpo_trainer_class()(
        model=model,
        args=args,
        train_dataset=train_set,
        processing_class=tokenizer,
        callbacks=[StopWhenAsked(threading.Event())],  # every stage trainer carries its time-limit stop
    )
    if "ref" in trainer.model.peft_config:
        trainer.model.delete_adapter("ref")  # reference: base
    model, trainer.current_gradient_accumulation_steps = trainer.model, 1  # set by Trainer.train otherwise
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, fused=True)  # the Trainer's adamw_torch_fused
    vocab = model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)

    def batch(size: int) -> dict:
        def ids(n: int) -> list[int]:
            return torch.randint(4, vocab, (n,), generator=generator).tolist()

        rows = [
            {"prompt_ids": ids(length - targets), "chosen_ids": ids(targets), "rejected_ids": ids(targets)}
        ]
        return trainer.data_collator(rows * size)

    def step(inputs: dict) -> None:
        # A GPU's path: the fused LM head at the answer tokens only (TRL scores every position elsewhere),
        # under bf16 autocast, as train_step runs it (the Trainer's CPU autocast leaves LoRA's path in fp32)
        with (
            patch.object(trl_utils, "_use_triton", lambda device: True),
            torch.autocast("cpu", torch.bfloat16),
        ):
            trainer.training_step(model, inputs)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(batch(1))  # creates the moments
    moments = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    weights = held_bytes(weight_tensors(model, trainable=False))
    inputs = batch(job.train.batch_size)
    held = weights + held_bytes(trainable + moments) + held_bytes(list(inputs.values()))
    return {"weights": weights, "train": held + profiled_rise(lambda: step(inputs))}


def grpo_job(
    job: TrainJob, prompts: int, generations: int, micro: int, completion: int, beta: float
) -> TrainJob:
    """The job as a GRPO stage of `prompts` per step, each with `generations` completions of `completion`
    tokens, split into micro-batches of `micro` completions; with beta > 0, after a stage (reference: previous)."""
    written = job.model_dump(exclude_unset=True)
    grpo = {"num_generations": generations, "max_completion_length": completion, "beta": beta}
    written["train"] |= {
        "method": "grpo",
        "batch_size": prompts,
        "micro_batch": micro,
        "eval_every_epochs": None,
        "grpo": grpo | {"rewards": [{"score": "exact_match"}]},
    }
    written["data"] = {"train": "unused.jsonl"}
    job = TrainJob.model_validate(written)
    return job.model_copy(update={"init_adapter": "unused" if beta > 0 else None})


def measured_grpo(job: TrainJob, prompt: int, cuda: bool = False) -> dict[str, int]:
    """Bytes: the frozen weights, and TRL's own GRPO step (GRPOTrainer.training_step per micro-batch: the
    generation of the whole step's completions by train/grpo.py sampled_completions, each `prompt` tokens of
    prompt and max_completion_length of completion; the reference forward when beta > 0; each micro-batch's
    forward and backward), with the fused AdamW step and zero_grad after it. On this CPU (the allocator's
    rise, read by profiled_rise), or `cuda`: on the GPU as the job runs it, its torch.cuda.max_memory_allocated
    (bench/gpu_check.py)."""
    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer import utils as trl_utils

    from train.grpo import sampled_completions

    grpo, train = job.train.reward_objective, job.train
    steps = train.batch_size * grpo.num_generations // train.micro_batch
    model = real_model(job, cuda)
    # A GPU's path: the prefill's output layer runs on its last position, a strided (sequences, 1, hidden)
    # slice, which a CPU's matmul multiplies by a per-sequence copy of the output layer's weight (its bmm
    # makes the broadcast weight contiguous: sequences x vocabulary x hidden bytes), and CUDA's strided
    # batched GEMM does not copy.
    if not cuda:
        model.get_output_embeddings().register_forward_pre_hook(lambda module, args: (args[0].contiguous(),))
    vocab = model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    prompt_ids = {
        f"p{i}": torch.randint(4, vocab, (prompt,), generator=generator).tolist() for i in range(64)
    }
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)  # TRL wants one; the prompts are token ids

    def rollout(prompts: list[str], trainer) -> dict:
        ids = [prompt_ids[p] for p in prompts]
        return {"prompt_ids": ids, "completion_ids": sampled_completions(trainer, ids, []), "logprobs": None}

    def reward(completions, **kwargs) -> list[float]:  # any rewards with variance: the memory is the same
        return torch.rand(len(completions), generator=generator).tolist()

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=train.micro_batch,
        gradient_accumulation_steps=steps,
        steps_per_generation=steps,
        num_generations=grpo.num_generations,
        max_completion_length=grpo.max_completion_length,
        beta=grpo.beta,
        bf16=True,
        use_cpu=not cuda,
        report_to=[],
        gradient_checkpointing=train.gradient_checkpointing,
        disable_dropout=True,
        log_completions=False,
    )
    train_set = datasets.Dataset.from_dict({"prompt": list(prompt_ids)})
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=args,
        train_dataset=train_set,
        processing_class=tokenizer,
        rollout_func=rollout,
    )
    if "ref" in trainer.model.peft_config and grpo.beta == 0:
        trainer.model.delete_adapter("ref")
    # every completion runs to max_completion_length: the longest a step can generate
    trainer.generation_config.min_new_tokens = grpo.max_completion_length
    model, trainer.current_gradient_accumulation_steps = trainer.model, steps
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, fused=True)  # the Trainer's adamw_torch_fused
    rows = [{"prompt": f"p{i}"} for i in range(train.batch_size) for _ in range(grpo.num_generations)]

    def step() -> None:
        # On a CPU, a GPU's path: the fused LM head at the completion's tokens only, under bf16 autocast
        with (
            nullcontext() if cuda else patch.object(trl_utils, "_use_triton", lambda device: True),
            nullcontext() if cuda else torch.autocast("cpu", torch.bfloat16),
        ):
            for _ in range(steps):
                trainer.training_step(model, rows, None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for param in trainable:  # AdamW's moments, as every step but the first finds them
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    moments = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    weights = held_bytes(weight_tensors(model, trainable=False))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        step()
        return {"weights": weights, "train": torch.cuda.max_memory_allocated()}
    held = weights + held_bytes(trainable + moments)
    return {"weights": weights, "train": held + profiled_rise(step)}


def estimated_grpo(job: TrainJob, prompt: int) -> dict[str, float]:
    """Bytes, without the CUDA reserve: the larger of the GRPO step's training and its generation, as
    preflight judges it (train/preflight.py: the stage in completions)."""
    from train.grpo_data import as_completions

    completion = job.train.reward_objective.max_completion_length
    shape = {
        "targets": completion,
        "batch_size": job.train.micro_batch,
        "max_length": prompt + completion,
        "max_target_length": completion,
        "gradient_checkpointing": job.train.gradient_checkpointing,
        "grad_accum": job.train.batch_size
        * job.train.reward_objective.num_generations
        // job.train.micro_batch,
    }
    estimate = measure_memory(as_completions(job), shape, None)
    reserve = CUDA_RESERVE_GB * GB
    peak = "generation" if estimate.generation_gb > estimate.train_gb else "train"
    return {
        "weights": estimate.weights_gb * GB,
        "train": estimate.total_gb * GB - reserve,
        "training_only": estimate.train_gb * GB - reserve,  # as judged before the generation was counted
        "peak": peak,
    }


def estimated(job: TrainJob, length: int, targets: int | None = None) -> dict[str, float]:
    """Bytes, without the CUDA reserve."""
    shape = {
        "targets": targets,
        "batch_size": job.train.batch_size,
        "max_length": length,
        "max_target_length": length,
        "gradient_checkpointing": job.train.gradient_checkpointing,
        "grad_accum": job.train.grad_accum,
    }
    estimate = measure_memory(job, shape, None)
    reserve = CUDA_RESERVE_GB * GB
    return {
        "weights": estimate.weights_gb * GB,
        "train": estimate.train_gb * GB - reserve,
        "eval": None if estimate.eval_gb is None else estimate.eval_gb * GB - reserve,
    }


def rows(names) -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            if name in PREFERENCE_CASES:
                out += preference_rows(Path(tmp), name)
                continue
            if name in GRPO_CASES:
                out += grpo_rows(Path(tmp), name)
                continue
            kind, changes, adapter, shapes = CASES[name]
            folder = model_folder(Path(tmp), name, changes, kind)
            for batch, length, checkpointing, *more in shapes:
                assert padded_length(length, "bf16") == length  # the real batch is as long as the estimate's
                accum, targets = (more + [1, None])[:2]
                job = bench_job(folder, kind, adapter, batch, checkpointing, accum)
                estimate, actual = estimated(job, length, targets), measured(job, length, targets)
                gc.collect()
                steps = ("train",) if job.train.grad_accum > 1 else ("train", "eval")  # the same eval
                out += [row(name, job, length, step, estimate, actual, targets) for step in steps]
    return out


def preference_rows(root: Path, name: str) -> list[dict]:
    changes, adapter, shapes = PREFERENCE_CASES[name]
    folder = model_folder(root, name, changes, "causal")
    out = []
    for batch, length, targets in shapes:
        job = preference_job(bench_job(folder, "causal", adapter, batch, False))
        estimate, actual = estimated(job, length, targets), measured_preference(job, length, targets)
        gc.collect()
        out.append(row(name, job, length, "train", estimate, actual, targets))
    return out


def grpo_rows(root: Path, name: str) -> list[dict]:
    changes, adapter, shapes = GRPO_CASES[name]
    folder = model_folder(root, name, changes, "causal")
    out = []
    for prompts, generations, micro, prompt, completion, beta in shapes:
        job = grpo_job(
            bench_job(folder, "causal", adapter, 1, False), prompts, generations, micro, completion, beta
        )
        estimate, actual = estimated_grpo(job, prompt), measured_grpo(job, prompt)
        gc.collect()
        found = row(name, job, prompt + completion, "train", estimate, actual, completion)
        found |= {
            "batch": micro,
            "grad_accum": prompts * generations // micro,
            "completions": prompts * generations,
        }
        out.append(found | {"beta": beta, "peak": estimate["peak"]})
    return out


def row(name: str, job: TrainJob, length: int, step: str, estimate: dict, actual: dict, targets=None) -> dict:
    above = (estimate[step] - estimate["weights"], actual[step] - actual["weights"])
    return {
        "model": name,
        "step": step,
        "batch": job.train.batch_size * (EVAL_BATCH_FACTOR if step == "eval" else 1),
        "length": length,
        "targets": targets,  # answer tokens per example (None: every token)
        "checkpointing": job.train.gradient_checkpointing,
        "grad_accum": job.train.grad_accum if step == "train" else 1,
        "estimate_mib": round(estimate[step] / MiB, 1),
        "measured_mib": round(actual[step] / MiB, 1),
        "error_percent": round(100 * (estimate[step] - actual[step]) / actual[step], 1),
        "weights_estimate_mib": round(estimate["weights"] / MiB, 1),
        "weights_measured_mib": round(actual["weights"] / MiB, 1),
        "above_weights_error_percent": round(100 * (above[0] - above[1]) / above[1], 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument(
        "--only", nargs="+", choices=sorted([*CASES, *PREFERENCE_CASES, *GRPO_CASES]), help="these cases only"
    )
    args = parser.parse_args()
    table = rows(args.only or (QUICK if args.quick else list(CASES)))
    if args.json:
        print(json.dumps(table, indent=1))
    else:
        print_table(table)
    worst = max(abs(r["error_percent"]) for r in table)
    under = min(r["error_percent"] for r in table)
    print(
        f"worst error {worst}%, most under {min(under, 0)}% (targets: within 15%, never under by more than 5%)"
    )
    return 0 if worst <= 15 and under >= -5 else 1


def print_table(table: list[dict]) -> None:
    head = f"{'model':<22} {'step':<5} {'batch':>5} {'len':>4} {'ckpt':>5} {'accum':>5} {'estimate MiB':>12} "
    print(head + f"{'measured MiB':>12} {'error':>7} {'weights est/meas MiB':>21} {'above weights':>13}")
    for r in table:
        weights = f"{r['weights_estimate_mib']:.0f}/{r['weights_measured_mib']:.0f}"
        print(
            f"{r['model']:<22} {r['step']:<5} {r['batch']:>5} {r['length']:>4} {str(r['checkpointing']):>5} "
            f"{r['grad_accum']:>5} "
            f"{r['estimate_mib']:>12} {r['measured_mib']:>12} {r['error_percent']:>6}% {weights:>21} "
            f"{r['above_weights_error_percent']:>12}%"
        )


if __name__ == "__main__":
    raise SystemExit(main())
