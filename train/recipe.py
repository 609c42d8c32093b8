"""The shared LoRA/QLoRA trainer: one stage of one experiment, read top to bottom.

    run_stage(TrainJob, stop) → "completed" | "interrupted"

Feature → config key:
- seq2seq (T5) or causal (Llama/Qwen) base, hub id or folder  → model.kind, model.name_or_path, model.revision
- added special tokens, saved with the adapter                 → model.added_tokens
- LoRA or QLoRA (4-bit NF4, double quantisation)               → adapter.method, rank, alpha, dropout, target_modules
- refuse runs that train too much of the model                 → adapter.max_trainable_percent, modules_to_save
- continue the previous stage's adapter                        → (planned) init_adapter
- JSONL/CSV/Parquet/hf: data, templated prompts, masked prompt → data.train/eval, prompt_template, *_field
- smallest max_length that truncates nothing                   → data.max_length / max_target_length: auto
- length-grouped batches, or file order for curricula          → data.order
- bf16/TF32/fused AdamW/workers on GPU, fp32 on CPU            → train.precision, data.num_workers
- loss-only eval, early stopping, best + latest checkpoints    → train.eval_every_epochs, early_stopping, save_every_steps
- resume after a time limit or preemption                      → (automatic) newest committed checkpoint in checkpoints/
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Literal

import torch
from transformers import (
    DataCollatorForSeq2Seq,
    EarlyStoppingCallback,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    Trainer,
    TrainingArguments,
    set_seed,
)
from transformers.trainer_pt_utils import LengthGroupedSampler

from train import data as data_lib
from train.callbacks import CommitCheckpoints, RunDirectoryLog, StopWhenAsked
from train.checkpoints import latest_valid_checkpoint, step_of
from train.config import TrainJob
from train.model import add_tokens, check_trainable, load_base, load_tokenizer, load_trained, new_adapter

log = logging.getLogger("train.recipe")


def run_stage(job: TrainJob, stop: threading.Event | None = None) -> Literal["completed", "interrupted"]:
    recipe = StageRecipe(job, stop or threading.Event())
    recipe.setup()
    outcome = recipe.train()
    if outcome == "completed":
        recipe.save()
    return outcome


class Collator:
    """Dynamic padding (labels with -100); the `length` column only steers the sampler."""

    def __init__(self, tokenizer, model, pad_to_multiple_of: int | None):
        self.inner = DataCollatorForSeq2Seq(
            tokenizer, model=model, label_pad_token_id=-100, pad_to_multiple_of=pad_to_multiple_of
        )

    def __call__(self, features):
        return self.inner([{k: v for k, v in f.items() if k != "length"} for f in features])


class EpochSeededLengthSampler(LengthGroupedSampler):
    """Length-grouped batches whose shuffle depends only on (seed, epoch). HF's own sampler draws from the
    global RNG when an epoch starts; a run resumed mid-epoch restores a later RNG state, gets another
    order, and its result drifts from the uninterrupted run's."""

    def __init__(self, *args, seed: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        self.generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return super().__iter__()


class ReproducibleSampling:
    """Trainer mixin: use the epoch-seeded length-grouped sampler."""

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if self.args.train_sampling_strategy != "group_by_length":
            return super()._get_train_sampler(train_dataset)
        return EpochSeededLengthSampler(
            self.args.train_batch_size * self.args.gradient_accumulation_steps,
            lengths=dataset["length"],
            seed=self.args.seed,
        )


class CausalTrainer(ReproducibleSampling, Trainer):
    pass


class Seq2SeqStageTrainer(ReproducibleSampling, Seq2SeqTrainer):
    pass


class StageRecipe:
    def __init__(self, job: TrainJob, stop: threading.Event):
        self.job, self.stop = job, stop
        self.run_dir = Path(job.run_dir)
        self.cuda = torch.cuda.is_available()

    # ---- setup ----------------------------------------------------------------------------------
    def setup(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Resume point first: metrics logged after it would otherwise appear twice.
        self.resume_from = latest_valid_checkpoint(self.run_dir / "checkpoints")
        if self.resume_from:
            log.info("resuming from %s", self.resume_from)
            self.forget_metrics_after(step_of(self.resume_from))
        set_seed(self.job.train.seed)  # before the adapter exists: LoRA's initial weights are drawn from it
        self.model, self.tokenizer = self.load_model()
        self.tokenizer.padding_side = "right"  # training pads on the right; generation sets its own side
        self.trainable_percent = check_trainable(self.model, self.job.adapter.max_trainable_percent)
        # Data after the tokenizer: its fingerprint is part of the tokenization cache key.
        self.train_set, self.lengths = self.load_split(self.job.data.train)
        log.info("train data: %s", self.lengths.describe())
        self.eval_set = self.load_split(self.job.data.eval)[0] if self.job.data.eval else None
        self.trainer = self.build_trainer()

    def load_model(self):
        job = self.job
        if job.init_adapter:  # a later stage continues the previous stage's adapter
            return load_trained(job.model, job.init_adapter, quantize=job.adapter, trainable=True)
        tokenizer = load_tokenizer(job.model.name_or_path, job.model)
        model = load_base(job.model, job.adapter)
        add_tokens(model, tokenizer, job.model.added_tokens)
        return new_adapter(model, job.adapter, job.model.kind), tokenizer

    def load_split(self, source: str):
        dataset = data_lib.tokenized(source, self.job.data, self.tokenizer, self.job.model.kind)
        lengths = data_lib.choose_lengths(dataset, self.job.data, self.job.model.kind)
        return data_lib.truncate(dataset, lengths), lengths

    def forget_metrics_after(self, step: int) -> None:
        path = self.run_dir / "metrics.jsonl"
        if path.is_file():
            rows = [line for line in path.read_text().splitlines() if line.strip()]
            kept = [line for line in rows if json.loads(line).get("step", 0) <= step]
            path.write_text("".join(line + "\n" for line in kept))

    def precision(self) -> str:
        wanted = self.job.train.precision
        if wanted == "auto":
            return "bf16" if self.cuda and torch.cuda.is_bf16_supported() else "fp32"
        return wanted

    def steps_per_epoch(self) -> int:
        per_step = self.job.train.batch_size * self.job.train.grad_accum * max(1, torch.cuda.device_count())
        return max(1, math.ceil(len(self.train_set) / per_step))

    def training_arguments(self) -> TrainingArguments:
        train, data = self.job.train, self.job.data
        precision = self.precision()
        workers = (
            data.num_workers
            if data.num_workers != "auto"
            else (min(4, os.cpu_count() or 1) if self.cuda else 0)
        )
        evaluating = self.eval_set is not None and train.eval_every_epochs is not None
        eval_steps = max(1, round(self.steps_per_epoch() * (train.eval_every_epochs or 1)))
        save_steps = (
            eval_steps * max(1, train.save_every_steps // eval_steps)
            if evaluating
            else train.save_every_steps
        )
        args_class = Seq2SeqTrainingArguments if self.job.model.kind == "seq2seq" else TrainingArguments
        return args_class(
            output_dir=str(self.run_dir / "checkpoints"),
            num_train_epochs=train.epochs,
            max_steps=train.max_steps or -1,
            per_device_train_batch_size=train.batch_size,
            per_device_eval_batch_size=train.batch_size * 2,
            gradient_accumulation_steps=train.grad_accum,
            learning_rate=train.learning_rate,
            warmup_steps=train.warmup_ratio,  # a float below 1 is a ratio of the total steps
            weight_decay=train.weight_decay,
            lr_scheduler_type=train.scheduler,
            seed=train.seed,
            bf16=precision == "bf16",
            fp16=precision == "fp16",
            tf32=True if self.cuda and torch.cuda.get_device_capability()[0] >= 8 else None,
            optim="adamw_torch_fused" if self.cuda else "adamw_torch",
            gradient_checkpointing=train.gradient_checkpointing,
            dataloader_num_workers=workers,
            dataloader_pin_memory=self.cuda,
            train_sampling_strategy="sequential" if data.order == "file" else "group_by_length",
            remove_unused_columns=False,
            include_num_input_tokens_seen="non_padding",
            eval_strategy="steps" if evaluating else "no",
            eval_steps=eval_steps if evaluating else None,
            prediction_loss_only=True,  # generation happens once, in the eval job
            save_strategy="steps",
            save_steps=save_steps,
            save_total_limit=2,  # with load_best_model_at_end: the best and the latest
            load_best_model_at_end=evaluating,
            metric_for_best_model=(train.early_stopping.metric if train.early_stopping else "eval_loss")
            if evaluating
            else None,
            greater_is_better=False if evaluating else None,
            logging_steps=train.logging_steps,
            logging_first_step=True,
            report_to="none",
            use_cpu=not self.cuda,
            disable_tqdm=True,
        )

    def build_trainer(self) -> Trainer:
        args = self.training_arguments()
        self.stopper = StopWhenAsked(self.stop)
        callbacks = [RunDirectoryLog(self.run_dir), CommitCheckpoints(), self.stopper]
        early = self.job.train.early_stopping
        if early and args.eval_strategy != "no":
            callbacks.append(EarlyStoppingCallback(early.patience, early.threshold))
        trainer_class = Seq2SeqStageTrainer if self.job.model.kind == "seq2seq" else CausalTrainer
        return trainer_class(
            model=self.model,
            args=args,
            train_dataset=self.train_set,
            eval_dataset=self.eval_set,
            data_collator=Collator(self.tokenizer, self.model, 8 if self.cuda else None),
            processing_class=self.tokenizer,
            callbacks=callbacks,
        )

    # ---- train ----------------------------------------------------------------------------------
    def train(self) -> Literal["completed", "interrupted"]:
        started = time.time()
        result = self.trainer.train(
            resume_from_checkpoint=str(self.resume_from) if self.resume_from else None
        )
        self.train_runtime_s = time.time() - started
        self.train_metrics = result.metrics
        return "interrupted" if self.stopper.stopped_early else "completed"

    # ---- save -----------------------------------------------------------------------------------
    def save(self) -> None:
        adapter_dir = self.run_dir / "adapter"
        tmp = self.run_dir / f".adapter.{os.getpid()}.tmp"
        self.trainer.model.save_pretrained(tmp)  # the best model when eval ran (load_best_model_at_end)
        self.tokenizer.save_pretrained(tmp)  # added tokens travel with the adapter
        if adapter_dir.exists():
            import shutil

            shutil.rmtree(adapter_dir)
        os.replace(tmp, adapter_dir)
        self.write_summary()

    def write_summary(self) -> None:
        history = self.trainer.state.log_history
        eval_losses = [row["eval_loss"] for row in history if "eval_loss" in row]
        summary = {
            "experiment": self.job.experiment,
            "stage": self.job.stage,
            "trainable_percent": round(self.trainable_percent, 4),
            "train_runtime_s": round(self.train_runtime_s, 2),
            "global_step": self.trainer.state.global_step,
            "best_eval_loss": min(eval_losses) if eval_losses else None,
            "max_length": self.lengths.max_length,
            "longest_example": self.lengths.longest,
            "truncated_at": self.lengths.truncated_at,
            "padding_fraction": round(
                data_lib.padding_fraction(
                    self.train_set["length"], self.job.train.batch_size, self.job.data.order == "shuffle"
                ),
                4,
            ),
            "device": "cuda" if self.cuda else "cpu",
            "precision": self.precision(),
            "resumed_from": str(self.resume_from) if self.resume_from else None,
            "num_input_tokens_seen": self.trainer.state.num_input_tokens_seen,
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
