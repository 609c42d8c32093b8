"""The shared LoRA/QLoRA trainer: one stage of one experiment, read top to bottom.

    run_stage(TrainJob, stop) → "completed" | "pruned" | "interrupted"   (python -m train JOB.yaml too)

StageRecipe: setup() → train() → save(). The job wrapper sets `stop` on SLURM's time-limit or preemption
signal; the recipe then checkpoints at the next step end and returns "interrupted". The next start resumes
from the newest committed checkpoint. The wrapper, not the trainer, writes DONE after "completed".

Feature → config key:
- seq2seq (T5, Seq2SeqTrainer) or causal (Llama/Qwen, Trainer) → model.kind
- hub id or local folder, pinned revision (offline: HF_HUB_OFFLINE) → model.name_or_path, model.revision
- added special tokens: embeddings resized, only their rows trained,
  tokenizer saved with the adapter                              → model.added_tokens
- LoRA, or QLoRA on a 4-bit base (CPU: bitsandbytes repack fix)   → adapter.method, rank, alpha, dropout,
                                                                   target_modules, quant_type, double_quant
- refuse runs that train too much of the model, naming modules    → adapter.max_trainable_percent,
                                                                   adapter.modules_to_save
- continue the previous stage's adapter instead of a fresh one    → init_adapter
- JSONL/CSV/Parquet by extension or hf:NAME:SPLIT                 → data.train, data.eval
- prompts from a template, prompt masked out of a causal loss     → data.prompt_template, input_field, target_field
- smallest max_length that truncates nothing (multiple of 8),
  capped at the model's positions; examples cut are counted      → data.max_length / max_target_length: auto
- vision-language (Qwen2.5-VL, Qwen3-VL): image + question → answer,
  chat template, loss on the answer only, LoRA on the language
  model (vision tower on request, never 4-bit), over-long
  examples dropped and counted, never cut (train/vl.py)          → model.kind: image-text, data.image_field,
                                                                   data.min_pixels/max_pixels,
                                                                   adapter.train_vision
- length-grouped batches, or file order for curricula             → data.order: shuffle | file
- device cuda:LOCAL_RANK or cpu; bf16 (fp16 AMP on GPUs without
  bf16), TF32, workers, pinned memory: one table, train/device.py → train.precision, data.num_workers
- data parallelism: DDP over WORLD_SIZE processes, nccl (gloo on
  CPU); each example once per epoch across the ranks; rank 0
  writes the run directory; a stop is agreed by all ranks; never
  nn.DataParallel (train/distributed.py)                          → resources.gpus (the wrapper starts a
                                                                   task per GPU and exports RANK,
                                                                   LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
                                                                   MASTER_PORT)
- GPU utilisation and memory every few seconds (NVML, rank 0 for
  all ranks' GPUs) into metrics.jsonl and progress.json; nothing
  without a GPU or without NVML (train/gpu_use.py)                → (always)
- fused AdamW                                                     → (always)
- the loss (logged, trained on, evaluated) is the mean over the
  target tokens of the global batch, whatever its split into
  accumulation steps and ranks; eval's over the whole eval set     → (always)
- the effective batch (batch_size x grad_accum per rank) is the
  contract; on a GPU it is split into the largest micro-batch that
  fits without checkpointing, checkpointing only when not even 1
  fits, chosen from the memory model and the GPU's free memory
  (the smallest of all ranks); a resumed run keeps its split      → train.micro_batch: auto | N
- the output layer fused into the loss (Liger Kernel, CUDA, the
  [gpu] extra) only where that lets a larger micro-batch fit, or
  fit at all; the same loss and gradients                         → (automatic, with micro_batch: auto)
- activation (gradient) checkpointing: when asked, or when
  micro_batch: auto finds nothing fits without it                 → train.gradient_checkpointing
- loss-only eval every N epochs, no generation, on the Trainer's
  epoch ends (a last short accumulation still steps)             → train.eval_every_epochs, data.eval
- early stopping, best model loaded at the end                    → train.early_stopping.{metric,patience,threshold}
- checkpoints: every N steps and at each eval, best + newest kept → train.save_every_steps
- a pruned sweep's run stops at a rung when its eval_loss is above
  the keep quantile of the losses recorded there (core/pruning.py);
  it ends "pruned", its best model saved as at a normal end        → job.prune (the sweep's prune:)
- epochs, or a fixed number of steps that overrides them          → train.epochs, train.max_steps
- resume after a time limit or preemption                         → (automatic) checkpoints/ in run_dir
- tokenization cache                                              → env LORA_CACHE_DIR (~/.cache/lora-pipeline)

Run directory (job.run_dir): metrics.jsonl, progress.json, summary.json (with the device and precision
that ran, the world size and each rank's device, and how many examples max_length cut),
checkpoints/checkpoint-N/, adapter/ (adapter + tokenizer). With several ranks only rank 0 writes them.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Literal

import torch
from transformers import (
    DataCollatorForSeq2Seq,
    EarlyStoppingCallback,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)
from transformers.trainer_pt_utils import LengthGroupedSampler

from core import below, speeds
from core.config import TrainJob, what_it_computes
from core.files import json_line, read_json, read_jsonl, write_atomic, write_json_atomic
from core.hashing import content_hash
from core.job_records import job_records
from core.preflight import trained_share
from core.rundir import RunDir
from core.split import Split, elastic_accumulation, kept_on_resume, refuse_unless_fits, resolve
from train import data as data_lib
from train import distributed, vl
from train.callbacks import (
    CommitCheckpoints,
    FailOnNonFiniteLoss,
    LogTheLastStep,
    NoCheckpointAtTheEnd,
    PruneAtRungs,
    RunDirectoryLog,
    RuntimeClock,
    SaveEvery,
    StageTimer,
    StopWhenAsked,
)
from train.chat import text_tokenizer
from train.checkpoints import (
    CheckedSaves,
    discard_incomplete,
    latest_valid_checkpoint,
    set_aside_unresumable,
    step_of,
)
from train.device import current as current_placement
from train.device import free_gpu_gb, fused_loss_possible, gpu_uuid, split_memory_gb
from train.gpu_use import GpuSampler, JobGpus, encode, watch_plan
from train.loss import TargetTokenLoss, liger_installed, liger_linear_cross_entropy
from train.memory import EVAL_BATCH_FACTOR
from train.model import (
    adapter_differences,
    add_tokens,
    check_trainable,
    load_base,
    load_tokenizer,
    load_trained,
    max_positions,
    new_adapter,
)
from train.tracking import step_offset, tracking_callbacks

log = logging.getLogger("train.recipe")


def run_stage(
    job: TrainJob, stop: threading.Event | None = None, recipe_class: type[StageRecipe] | None = None
) -> Literal["completed", "pruned", "interrupted"]:
    """The stage's life cycle with `recipe_class` (a preference stage's, train/preference.py, comes through
    train/stage.py, the jobs' entry point; this SFT recipe refuses to train one as SFT)."""
    if recipe_class is None and job.train.method != "sft":
        raise ValueError(
            f"train.method {job.train.method} runs through train.stage.run_stage, not the SFT recipe"
        )
    recipe = (recipe_class or StageRecipe)(job, stop or threading.Event())
    recipe.setup()
    outcome = recipe.train()
    if outcome != "interrupted":  # a pruned run ends as a completed one does, with its best model
        recipe.save()
    distributed.leave()  # not after an error: the other ranks are not coming
    return outcome


def one_gpu_per_process(args: TrainingArguments) -> TrainingArguments:
    """One process never splits its batch over GPUs: with several visible, the Trainer would wrap the model
    in nn.DataParallel and multiply the batch by their count (issue 11). It uses its own GPU; the placement
    warned how to use them all."""
    if args.n_gpu > 1:
        args._n_gpu = 1
    return args


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
    order, and its result drifts from the uninterrupted run's. Under DDP every rank draws this same order
    and accelerate deals its batches out round-robin (batch i to rank i mod N): each example of the epoch
    goes to one rank. When the epoch does not divide by the global batch, the last round is filled up
    with the epoch's first examples (accelerate's even_batches, as DistributedSampler does).

    `batch_size` is the global batch (micro-batch x accumulation steps x ranks), which alone sets the
    mega-batches the lengths are grouped in. The order then depends on the global batch only, not on its
    split: optimizer step k takes micro-batches kNA..kNA+NA-1 of it, whether N ranks with A accumulation
    steps each deal them out round-robin or one rank with NA steps takes them in turn, so both train on
    the same examples (issue 39), all but a last round that the epoch does not fill: the ranks fill it up
    as above, one rank takes the shorter one."""

    def __init__(self, *args, seed: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        self.generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return super().__iter__()


class ReproducibleSampling:
    """Trainer mixin: use the epoch-seeded length-grouped sampler, and tell it each epoch as it begins."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.epoch_sampler: EpochSeededLengthSampler | None = None
        self.add_callback(SamplerEpoch(self))

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if self.args.train_sampling_strategy != "group_by_length":
            return super()._get_train_sampler(train_dataset)
        self.epoch_sampler = EpochSeededLengthSampler(
            self.args.train_batch_size * self.args.gradient_accumulation_steps * self.args.world_size,
            lengths=dataset["length"],
            seed=self.args.seed,
        )
        return self.epoch_sampler


class SamplerEpoch(TrainerCallback):
    """Sets the sampler's epoch before the epoch's batches are drawn. The Trainer's own set_epoch does not
    reach it in a run resumed mid-epoch under DDP: accelerate's skip wrapper hides it (SkipBatchSampler →
    BatchSamplerShard → BatchSampler → sampler), and the rest of that epoch replayed epoch 0's order."""

    def __init__(self, trainer: ReproducibleSampling):
        self.trainer = trainer

    def on_epoch_begin(self, args, state, control, **kwargs):
        if self.trainer.epoch_sampler is not None:
            # state.epoch: the epochs done so far (a resumed run: 1.07 one step into the second epoch).
            self.trainer.epoch_sampler.set_epoch(math.floor(state.epoch or 0))


class TokenMeanEval:
    """Trainer mixin: eval_loss is the token mean over the whole eval set. The Trainer's own is a mean of
    per-batch losses: it depends on the eval batch (2x the train batch, on each rank), and under DDP it
    counts the examples a short last round repeats; gather_for_metrics leaves those out here."""

    eval_tally: torch.Tensor | None = None  # (summed loss, target tokens) while an evaluation runs

    def evaluation_loop(self, *args, metric_key_prefix: str = "eval", **kwargs):
        self.eval_tally = torch.zeros(2, dtype=torch.float64, device=self.args.device)
        try:
            output = super().evaluation_loop(*args, metric_key_prefix=metric_key_prefix, **kwargs)
            summed, tokens = self.eval_tally.tolist()
        finally:
            self.eval_tally = None
        output.metrics[f"{metric_key_prefix}_loss"] = summed / tokens if tokens else float("nan")
        return output

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        self.compute_loss_func.rows = None  # a batch without labels computes no loss
        result = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if self.eval_tally is not None and self.compute_loss_func.rows is not None:
            # Every rank is here at every eval step, with labels or not alike: a collective is safe.
            rows = self.accelerator.gather_for_metrics(self.compute_loss_func.rows)
            self.eval_tally += rows.sum(0).to(self.eval_tally)
        return result


class OutputAtTargets:
    """Trainer mixin: every step's output layer (training and eval) runs only at the positions that carry a
    target, or with a fused loss hands the loss the hidden states there (TargetTokenLoss.output_at_targets)."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        with self.compute_loss_func.output_at_targets(model, inputs.get("labels")):
            return super().compute_loss(model, inputs, *args, **kwargs)


class StopsAtTheTimeLimit:
    """A stage trainer refuses to exist without the time-limit stop among its callbacks (StopWhenAsked, which
    StageRecipe.build_trainer adds for every method): without it a job at its limit is killed, not saved,
    and its requeue starts from its last checkpoint instead of the step it reached."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not any(isinstance(c, StopWhenAsked) for c in self.callback_handler.callbacks):
            raise TypeError(f"{type(self).__name__} was built without the time-limit stop (StopWhenAsked)")


def stage_trainer(name: str, library_trainer: type, *method_pieces: type) -> type:
    """A method's trainer class, composed here so that no method can miss a piece every stage needs (issue
    48): the checked saves outermost, so that a method's own `_save_checkpoint` (DPO's skips TRL's model card)
    runs inside the check, never around it; the time-limit stop's guard; the method's own pieces; then
    reproducible sampling over the library's trainer."""
    pieces = (CheckedSaves, StopsAtTheTimeLimit, *method_pieces, ReproducibleSampling, library_trainer)
    return type(name, pieces, {})


CausalTrainer = stage_trainer("CausalTrainer", Trainer, OutputAtTargets, TokenMeanEval)
Seq2SeqStageTrainer = stage_trainer("Seq2SeqStageTrainer", Seq2SeqTrainer, OutputAtTargets, TokenMeanEval)


def at_world_size(job: TrainJob, world_size: int) -> TrainJob:
    """The job as this run takes it on `world_size` ranks. An elastic job (`nodes: min-max`) keeps the
    global batch of its largest size: each rank accumulates grad_accum x global_ranks / world_size steps
    (core/split.py elastic_accumulation), so that the steps, the schedule and the examples in each step (the
    sampler groups by the global batch) are the same whatever SLURM gave it. Any other job: as it is. Either
    way the job now knows its ranks: its fewest (what preflight judged it at) no longer apply."""
    if job.fewest_ranks is not None:
        job = job.model_copy(update={"fewest_ranks": None})
    if job.global_ranks is None or job.global_ranks == world_size:
        return job
    accum = elastic_accumulation(job.train.grad_accum, job.global_ranks, world_size)
    if accum is None:  # validation refuses such a range; a job run by hand may still get here
        raise ValueError(
            f"this elastic job's global batch is set at {job.global_ranks} ranks, and {world_size} ranks "
            f"cannot share grad_accum {job.train.grad_accum} x {job.global_ranks} in whole steps"
        )
    log.info(
        "elastic: %d of %d ranks, so each rank accumulates %d x %d / %d = %d steps (global batch %d)",
        world_size,
        job.global_ranks,
        job.train.grad_accum,
        job.global_ranks,
        world_size,
        accum,
        job.train.batch_size * job.train.grad_accum * job.global_ranks,
    )
    return job.model_copy(update={"train": job.train.model_copy(update={"grad_accum": accum})})


class StageRecipe:
    """One stage: setup() builds model, data and Trainer; train() runs or resumes; save() writes the adapter
    and summary. The module docstring maps each feature to its config key."""

    evaluates_in_training = True  # a loss-only eval on data.eval (a GRPO step has no such loss)

    def __init__(self, job: TrainJob, stop: threading.Event):
        self.job, self.stop = job, stop
        self.run_dir = Path(job.run_dir)
        # Device and precision first: every later step (loading, batching, the Trainer) follows them.
        self.placement = current_placement(job.train.precision)
        for warning in self.placement.warnings:
            log.warning("%s", warning)
        distributed.join(self.placement)  # before setup: preparing the run directory needs a barrier
        self.job = at_world_size(job, self.placement.world_size)
        log.info(
            "rank %d of %d on %s (%s)",
            distributed.rank(),
            self.placement.world_size,
            self.placement.device,
            self.placement.backend if self.placement.world_size > 1 else "one process",
        )

    # ---- setup ----------------------------------------------------------------------------------
    def setup(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Resume point first: metrics logged after it would otherwise appear twice. Rank 0 tidies the run
        # directory; the others wait, then all resume from the same checkpoint.
        if distributed.is_main():
            discard_incomplete(RunDir(self.run_dir).checkpoints)
            elastic_batch = self.global_batch if self.job.global_ranks else None
            if set_aside_unresumable(
                RunDir(self.run_dir).checkpoints, self.placement.world_size, elastic_batch
            ):
                self.forget_metrics_after(0)  # the old run's curve is not this one's
        distributed.barrier("the run folder, tidied by rank 0")
        self.resume_from = latest_valid_checkpoint(RunDir(self.run_dir).checkpoints)
        if self.resume_from:
            log.info("resuming from %s", self.resume_from)
            if distributed.is_main():
                self.forget_metrics_after(step_of(self.resume_from))
        set_seed(self.job.train.seed)  # before the adapter exists: LoRA's initial weights are drawn from it
        # The processor of an image-text model stands where a text model's tokenizer does: it is what the
        # collator encodes with and what is saved with the adapter.
        distributed.doing(f"loading {self.job.model.name_or_path}")
        self.model, self.tokenizer = self.load_model()
        # Training pads on the right (labels line up with inputs); the saved tokenizer keeps its own side.
        text = text_tokenizer(self.tokenizer)
        self.saved_padding_side, text.padding_side = text.padding_side, "right"
        self.params = check_trainable(self.model, self.job.adapter.max_trainable_percent)
        # Data after the tokenizer: its fingerprint is part of the tokenization cache key.
        distributed.doing(f"reading and tokenizing {self.job.data.train}")
        self.train_set, self.lengths = self.load_split(self.job.data.train, "train")
        self.eval_set = self.eval_lengths = None
        if (
            self.job.data.eval and self.evaluates_in_training
        ):  # sorted: similar lengths pad little, and a loss-only eval has no order
            distributed.doing(f"reading and tokenizing {self.job.data.eval}")
            self.eval_set, self.eval_lengths = self.load_split(self.job.data.eval, "eval")
            self.eval_set = self.eval_set.sort("length")
        # The split after the lengths (the memory model needs them) and before the Trainer (it runs it).
        self.split = self.choose_split()
        log.info("batch split: %s", self.split.describe())
        # Every rank's node and GPU: each node's first rank watches its node's GPUs (NVML sees only those).
        self.gpus_where = distributed.gather(
            (socket.gethostname(), gpu_uuid(self.placement)), "the ranks' GPUs"
        )
        self.trainer = self.build_trainer()

    def choose_split(self) -> Split:
        """How this rank splits its effective batch (core/split.py): a resumed run keeps the split it started
        with (split.json) where that still makes this rank's effective batch at this world size
        (kept_on_resume; else it chooses again, with a warning); a fresh one chooses with the smallest free
        GPU memory of all ranks, so that every rank makes the same choice, and rank 0 records it with the
        world size it was chosen for."""
        recorded = RunDir(self.run_dir).split
        if self.resume_from:
            train, world = self.split_job.train, self.placement.world_size
            kept, why_not = kept_on_resume(
                read_json(recorded, expected=dict),
                train.batch_size * train.grad_accum,
                world,
                fused_loss_possible(self.placement, liger_installed()),
            )
            if kept is not None:
                return kept
            log.warning("resuming, the split is chosen again: %s", why_not)
        # A split that fits nowhere fails here, with its figures, not at the first step or eval's OOM.
        split = refuse_unless_fits(replace(self.fresh_split(), world_size=self.placement.world_size))
        if distributed.is_main():
            write_json_atomic(recorded, split.as_json(), indent=1)
        return split

    @property
    def split_job(self) -> TrainJob:
        """The job as its split counts it: a micro-batch of its examples (a GRPO stage's: of completions)."""
        return self.job

    def fresh_split(self) -> Split:
        job = self.split_job
        train = job.train
        memory_gb = split_memory_gb(distributed.gather(free_gpu_gb(self.placement), "the ranks' free memory"))
        if memory_gb is None:
            return resolve(train, None, None, "on a CPU the split is the one written")
        if train.micro_batch != "auto":
            return resolve(train, None, None)
        try:
            from train.memory_figures import fused_possible, split_figures
            from train.preflight import step_lengths, tokenizer_or_reason

            tokenizer = tokenizer_or_reason(job)[0]
            # the eval step at the eval set's own lengths: a dev set longer than the training set's
            lengths = step_lengths(
                job.model.kind, self.lengths, self.eval_lengths if self.evaluating() else None
            )
            figures = split_figures(job, lengths, tokenizer)
            installed = fused_loss_possible(self.placement, liger_installed())
            fused = None
            if fused_possible(job, tokenizer, installed):
                fused = split_figures(job, lengths, tokenizer, fused=True)
        except Exception as exc:  # the memory model fails on an unusual model: the written split still runs
            log.warning("memory model failed (%s: %s); keeping the written split", type(exc).__name__, exc)
            return resolve(train, None, None, "the memory model failed on this model")
        return resolve(train, figures, memory_gb, fused=fused)

    def load_model(self):
        job, placement = self.job, self.placement
        if job.init_adapter:  # a later stage continues the previous stage's adapter, weights and tokens
            model, tokenizer = load_trained(
                job.model, job.init_adapter, job.adapter, trainable=True, placement=placement, data=job.data
            )
            for difference in adapter_differences(model, job.adapter):
                log.warning("init_adapter %s keeps its own settings: %s", job.init_adapter, difference)
            missing = [t for t in job.model.added_tokens if t not in text_tokenizer(tokenizer).get_vocab()]
            if missing:  # embeddings cannot grow under a loaded adapter; the first stage must add them
                raise ValueError(f"model.added_tokens {missing} are not in {job.init_adapter}'s tokenizer")
            return model, tokenizer
        tokenizer = load_tokenizer(job.model.name_or_path, job.model, job.data)
        model = load_base(job.model, job.adapter, placement)
        new_ids = add_tokens(model, tokenizer, job.model.added_tokens)
        return new_adapter(model, job.adapter, job.model.kind, new_ids), tokenizer

    def load_split(self, source: str, split: str):
        kind = self.job.model.kind
        if kind == "image-text":  # images are never cut: over-long examples are dropped, and counted
            dataset = vl.examples(source, self.job.data, self.tokenizer)
            lengths = vl.choose_length(dataset, self.job.data, max_positions(self.model.config))
            log.info("%s data: %d examples; %s", split, len(dataset), lengths.describe())
            return logged_share(split, vl.drop_too_long(dataset, lengths), kind), lengths
        dataset = data_lib.tokenized(source, self.job.data, self.tokenizer, kind)
        lengths = data_lib.choose_lengths(dataset, self.job.data, kind, max_positions(self.model.config))
        log.info("%s data: %d examples; %s", split, len(dataset), lengths.describe())
        return logged_share(split, data_lib.truncate(dataset, lengths, kind), kind), lengths

    def forget_metrics_after(self, step: int) -> None:
        """The rows each step log holds past `step` (a resumed run logs those steps again)."""
        for path in self.step_logs():
            if not path.is_file():
                continue
            rows = read_jsonl(path, {"step": int})  # a row cut by a kill, or unreadable, is left out
            kept = [row for row in rows if isinstance(row.get("step"), int) and row["step"] <= step]
            write_atomic(path, "".join(map(json_line, kept)), root=RunDir(self.run_dir).run_root)

    def step_logs(self) -> list[Path]:
        """The run folder's files of rows by step: metrics.jsonl (a GRPO stage's completions.jsonl too)."""
        return [RunDir(self.run_dir).metrics]

    def workers(self) -> int:
        wanted = self.job.data.num_workers
        return self.placement.workers if wanted == "auto" else wanted

    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch, as the Trainer counts them: a last, shorter accumulation still steps."""
        return self.job.train.steps_per_epoch(len(self.train_set), self.placement.world_size)

    @property
    def global_batch(self) -> int:
        """Examples per optimizer step, every rank's: the job's, at any world size it runs on."""
        return self.job.train.batch_size * self.job.train.grad_accum * self.placement.world_size

    def evaluating(self) -> bool:
        return self.eval_set is not None and self.job.train.eval_every_epochs is not None

    def training_arguments(self) -> TrainingArguments:
        args_class = Seq2SeqTrainingArguments if self.job.model.kind == "seq2seq" else TrainingArguments
        return one_gpu_per_process(args_class(**self.argument_values()))

    def argument_values(self) -> dict:
        """The Trainer's arguments from the job (a preference stage adds its objective's to them)."""
        train, data, placement = self.job.train, self.job.data, self.placement
        evaluating = self.evaluating()
        eval_steps = max(1, round(self.steps_per_epoch() * (train.eval_every_epochs or 1)))
        return dict(
            output_dir=str(RunDir(self.run_dir).checkpoints),
            num_train_epochs=train.epochs,
            max_steps=train.max_steps or -1,  # when set, overrides epochs
            per_device_train_batch_size=self.split.micro_batch,
            # No gradients: a larger batch fits; preflight estimates the eval step at this size.
            per_device_eval_batch_size=self.split.micro_batch * EVAL_BATCH_FACTOR,
            gradient_accumulation_steps=self.split.grad_accum,
            learning_rate=train.learning_rate,
            warmup_steps=train.warmup_ratio,  # a float below 1 is a ratio of the total steps
            weight_decay=train.weight_decay,
            lr_scheduler_type=train.scheduler,
            seed=train.seed,
            bf16=placement.bf16,
            fp16=placement.fp16,
            tf32=placement.tf32 or None,  # None leaves torch's default alone
            optim="adamw_torch_fused",  # one kernel for all parameters, on CPU as on CUDA
            activation_checkpointing=self.split.gradient_checkpointing,
            dataloader_num_workers=self.workers(),
            dataloader_pin_memory=placement.pin_memory,
            train_sampling_strategy="sequential" if data.order == "file" else "group_by_length",
            remove_unused_columns=False,  # the collator drops `length`; the sampler needs it
            include_num_input_tokens_seen="non_padding",
            eval_strategy="steps" if evaluating else "no",
            eval_steps=eval_steps if evaluating else None,
            prediction_loss_only=True,  # generation happens once, in the eval job
            save_strategy="steps",
            # With eval, every eval point is saved (else the best model could be one never saved);
            # SaveEvery adds save_every_steps on top. The best and the newest are kept (CommitCheckpoints).
            save_steps=eval_steps if evaluating else train.save_every_steps,
            save_total_limit=None,
            load_best_model_at_end=evaluating,
            metric_for_best_model=(train.early_stopping.metric if train.early_stopping else "eval_loss")
            if evaluating
            else None,
            logging_steps=train.logging_steps,
            logging_first_step=True,
            report_to="none",
            use_cpu=not placement.cuda,
            ddp_backend=placement.backend if placement.world_size > 1 else None,  # a backend means DDP
            ddp_find_unused_parameters=False,  # LoRA: the frozen base has no gradients, nothing is unused
            disable_tqdm=True,
        )

    def build_trainer(self) -> Trainer:
        args = self.training_arguments()
        self.stopper = StopWhenAsked(self.stop)
        self.clock = RuntimeClock(self.resume_from)
        watched, posting = watch_plan(self.gpus_where, distributed.rank())
        node = self.gpus_where[distributed.rank()][0]
        post = None if distributed.is_main() else lambda sample: distributed.post("gpu_use", encode(sample))
        self.gpu_sampler = GpuSampler.for_gpus(watched, keep=post)
        job_gpus = JobGpus(
            node, self.gpu_sampler, posting, lambda ranks: distributed.collect("gpu_use", ranks)
        )
        # Order matters: the clock writes into a checkpoint before CommitCheckpoints seals it.
        callbacks = [
            RunDirectoryLog(self.run_dir, job_gpus, self.split.short()),
            self.clock,
            CommitCheckpoints(),
            self.stopper,
            FailOnNonFiniteLoss(self.placement.fp16),
            LogTheLastStep(),
        ]
        if self.evaluating() and self.job.train.save_every_steps != args.save_steps:
            callbacks.append(SaveEvery(self.job.train.save_every_steps))
        if not self.evaluating():
            callbacks.insert(callbacks.index(self.stopper), NoCheckpointAtTheEnd())  # before: a stop saves
        early = self.job.train.early_stopping
        if early and self.evaluating():
            callbacks.append(EarlyStoppingCallback(early.patience, early.threshold))
        self.pruner = self.pruning(args.eval_steps) if self.job.prune and self.evaluating() else None
        if self.pruner:
            callbacks.append(self.pruner)
        callbacks += tracking_callbacks(self.job, step_of(self.resume_from) if self.resume_from else None)
        self.timer = StageTimer()  # last: a save's time includes committing the checkpoint
        callbacks.append(self.timer)
        return self.make_trainer(args, callbacks)

    @staticmethod
    def trainer_classes() -> tuple[type, ...]:
        """Every trainer class this recipe may build (tests/test_trainers.py holds each to its pieces)."""
        return CausalTrainer, Seq2SeqStageTrainer

    def make_trainer(self, args: TrainingArguments, callbacks: list[TrainerCallback]) -> Trainer:
        trainer_class = Seq2SeqStageTrainer if self.job.model.kind == "seq2seq" else CausalTrainer
        if self.job.model.kind == "image-text":
            collator = vl.Collator(self.tokenizer, self.placement.pad_to_multiple_of)
        else:
            collator = Collator(self.tokenizer, self.model, self.placement.pad_to_multiple_of)
        return trainer_class(
            model=self.model,
            args=args,
            train_dataset=self.train_set,
            eval_dataset=self.eval_set,
            data_collator=collator,
            processing_class=self.tokenizer,
            callbacks=callbacks,
            compute_loss_func=TargetTokenLoss(
                shifted=self.job.model.kind != "seq2seq",
                fused=liger_linear_cross_entropy if self.split.fused_loss else None,
            ),
        )

    def pruning(self, eval_steps: int) -> PruneAtRungs:
        """Each rung's eval step as the Trainer schedules evals (every eval_steps), and the run's identity
        in the rung records: its spec as it computes and its run folder's first submission (job.json). A
        requeue or a retry keeps both, and takes its decision back; a rerun under another config, or in a
        fresh folder (--force archives the old one), decides anew."""
        per_rung = {
            rung: round(rung / self.job.train.eval_every_epochs) * eval_steps for rung in self.job.prune.rungs
        }
        first = job_records(self.run_dir)[:1]
        folder = f"{first[0].job_id}@{first[0].submitted_at}" if first else ""
        identity = content_hash({"spec": what_it_computes(self.job.model_dump()), "folder": folder})
        steps = {step: rung for rung, step in per_rung.items()}
        return PruneAtRungs(self.run_dir, self.job.prune, self.job.experiment, identity, steps)

    # ---- train ----------------------------------------------------------------------------------
    def train(self) -> Literal["completed", "pruned", "interrupted"]:
        if self.gpu_sampler:
            self.gpu_sampler.start()
        try:
            result = self.trainer.train(
                resume_from_checkpoint=str(self.resume_from) if self.resume_from else None
            )
        finally:
            if self.gpu_sampler:
                self.gpu_sampler.stop()
        self.train_metrics = result.metrics
        if self.stopper.stopped_early:
            return "interrupted"
        return "pruned" if self.pruner and self.pruner.pruned else "completed"

    # ---- save -----------------------------------------------------------------------------------
    def save(self) -> None:
        """adapter/ (the best model when eval ran: load_best_model_at_end) with its tokenizer, swapped in
        whole so a reader never sees half an adapter; then summary.json and a row in the speed book.
        Rank 0 writes; every rank joins the summary's gather of devices."""
        devices = distributed.gather(self.placement.device)
        if distributed.is_main():
            distributed.doing("writing the adapter and summary.json")
            self.write_adapter()
            origin = self.adapter_origin()
            log.info("adapter/ holds step %s of %s: %s", origin["step"], origin["of_steps"], origin["why"])
            self.write_summary(devices)
            self.write_speed()
        # No rank reports "completed" before the adapter is there; a rank 0 slow to write it is no failure.
        distributed.barrier("the adapter, written by rank 0", distributed.SAVE_WAIT_S)

    def write_adapter(self) -> None:
        adapter_dir = RunDir(self.run_dir).adapter
        tmp = RunDir(self.run_dir).adapter_staging(os.getpid())
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            self.save_model(tmp)
            text_tokenizer(self.tokenizer).padding_side = self.saved_padding_side
            self.tokenizer.save_pretrained(tmp)  # added tokens (image-text: the processor) go with it
            # A link planted at adapter/ while the job trained: refused naming it, never followed (L9:
            # before, a bare "Cannot call rmtree on a symbolic link", and the staging folder left behind).
            below.check(RunDir(self.run_dir).run_root, adapter_dir)
            if adapter_dir.exists():
                shutil.rmtree(adapter_dir)
            os.replace(tmp, adapter_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def save_model(self, folder: Path) -> None:
        self.trainer.model.save_pretrained(folder)

    def batch_order(self) -> list[int]:
        """The first epoch's example order, as the train sampler gives it."""
        sampler = self.trainer._get_train_sampler(self.train_set)
        return list(iter(sampler)) if sampler is not None else list(range(len(self.train_set)))

    def write_summary(self, devices: list[str]) -> None:
        state = self.trainer.state
        eval_losses = [row["eval_loss"] for row in state.log_history if "eval_loss" in row]
        summary = {
            "experiment": self.job.experiment,
            "stage": self.job.stage,
            "trainable_params": self.params.trainable,
            "total_params": self.params.total,
            "trainable_percent": round(self.params.percent, 4),
            "trainable_by_module": self.params.by_module,
            "train_runtime_s": round(self.clock.total_s(), 2),
            "global_step": state.global_step,
            "epochs_done": round(state.epoch or 0, 4),
            "best_eval_loss": min(eval_losses) if eval_losses else None,
            # the last logged step's loss; the run's mean is another figure (before: the mean, so named)
            "final_train_loss": next((r["loss"] for r in reversed(state.log_history) if "loss" in r), None),
            "mean_train_loss": self.train_metrics.get("train_loss"),
            "adapter_from": self.adapter_origin(),
            **self.data_summary(),
            "device": self.placement.device,
            "device_name": self.placement.device_name,
            "precision": self.placement.precision,
            "step_offset": step_offset(self.job),  # where this stage starts on its experiment's step axis
            "world_size": self.placement.world_size,
            "rank_devices": devices,  # rank K's device at index K
            "init_adapter": self.job.init_adapter,
            "resumed_from": str(self.resume_from) if self.resume_from else None,
            "num_input_tokens_seen": state.num_input_tokens_seen,
            # this process's start-up (the last one's, after a requeue): wall and CPU to its first step
            "startup_s": round(self.timer.startup_s, 2),
            "startup_cpu_s": None if self.timer.startup_cpu_s is None else round(self.timer.startup_cpu_s, 2),
            "split": self.split.as_json(),  # the micro-batch, accumulation and checkpointing that ran, and why
            **self.method_summary(),
        }
        write_json_atomic(RunDir(self.run_dir).summary, summary, indent=1, root=RunDir(self.run_dir).run_root)

    def adapter_origin(self) -> dict:
        """Which weights adapter/ holds: the best checkpoint by the eval (load_best_model_at_end), which the
        next stage starts from, or the last step's (before: said nowhere, and read as "the final adapter")."""
        state, args = self.trainer.state, self.trainer.args
        if args.load_best_model_at_end and state.best_model_checkpoint:
            step = int(Path(state.best_model_checkpoint).name.rsplit("-", 1)[-1])
            epoch = next((r.get("epoch") for r in state.log_history if r.get("step") == step), None)
            metric = args.metric_for_best_model
            last = "the last step's too" if step == state.global_step else "not the last step's"
            why = f"the best {metric} ({state.best_metric:.6g}) of the evals, {last}"
            return {"step": step, "epoch": epoch, "of_steps": state.global_step, "why": why}
        return {
            "step": state.global_step,
            "epoch": state.epoch,
            "of_steps": state.global_step,
            "why": "the last step",
        }

    def data_summary(self) -> dict:
        """summary.json's figures of the training data as it was trained: sizes, lengths, what was cut."""
        padding = data_lib.padding_fraction(
            self.train_set["length"],
            self.batch_order(),
            self.split.micro_batch,
            self.placement.pad_to_multiple_of or 1,
        )
        return {
            "train_examples": len(self.train_set),
            "train_tokens": sum(data_lib.trained_tokens(self.train_set, self.job.model.kind)),  # per epoch
            "eval_examples": len(self.eval_set) if self.eval_set is not None else None,
            "max_length": self.lengths.max_length,
            "max_target_length": self.lengths.max_target_length,
            "longest_example": self.lengths.longest,
            "longest_target": self.lengths.longest_target,
            "truncated_inputs": self.lengths.inputs_truncated,
            "truncated_targets": self.lengths.targets_truncated,
            "truncated_at": self.lengths.truncated_at,
            # image-text examples are never truncated: those longer than max_length are left out
            "dropped_too_long": self.lengths.inputs_truncated if self.job.model.kind == "image-text" else 0,
            "padding_fraction": round(padding, 4),
        }

    def method_summary(self) -> dict:
        """What summary.json adds for the stage's training method (a preference stage's reference and pairs)."""
        return {}

    def write_speed(self) -> None:
        """This stage's row in the speed book (core/speeds.py), from which the launcher estimates the next
        jobs on this model. Nothing when fewer than two steps ran in this process (no speed to measure)."""
        book = speeds.book_of(self.job)
        measured = self.measured_speed() if book is not None else None
        if measured is not None:
            speeds.append(book, self.speed_record(**measured))

    def measured_speed(self) -> dict | None:
        """What this run's timed steps measured (tokens_per_s, tokens_per_example; a GRPO stage adds its
        sampling's); None when fewer than two steps ran in this process."""
        timer, train = self.timer, self.job.train
        if timer.steps_timed == 0 or timer.stepping_s <= 0:
            return None
        examples = timer.steps_timed * train.batch_size * train.grad_accum * self.placement.world_size
        per_example = self.tokens_per_example()
        return {
            "tokens_per_s": round(examples * per_example / timer.stepping_s, 1),
            "tokens_per_example": round(per_example, 2),
        }

    def speed_record(self, **measured) -> speeds.SpeedRecord:
        """The row: what this stage is (model, method, device, split, data) and what it `measured`."""
        timer = self.timer
        return speeds.SpeedRecord(
            model=self.job.model.name_or_path,
            method=self.job.adapter.method,
            precision=self.placement.precision,
            device_name=self.placement.device_name,
            world_size=self.placement.world_size,
            batch_size=self.split.micro_batch,
            grad_accum=self.split.grad_accum,
            max_length=self.lengths.max_length,
            startup_s=round(timer.startup_s, 2),
            eval_s=round(sum(timer.eval_s) / len(timer.eval_s), 3) if timer.eval_s else None,
            eval_examples=len(self.eval_set) if self.eval_set is not None else None,
            save_s=round(sum(timer.save_s) / len(timer.save_s), 3) if timer.save_s else None,
            data=self.job.data.train,
            examples=len(self.train_set),
            time=round(time.time(), 3),
            calibration=self.job.calibration,
            gradient_checkpointing=self.split.gradient_checkpointing,
            objective=self.job.train.method,
            **measured,
        )

    def tokens_per_example(self) -> float:
        """Prompt + target tokens of an average training example as trained (data.trained_tokens)."""
        lengths = data_lib.trained_tokens(self.train_set, self.job.model.kind)
        return sum(lengths) / len(lengths)


def logged_share(split: str, dataset, kind: str):
    """The dataset, after its share of tokens the loss sees is logged (preflight's table shows the same)."""
    total = sum(data_lib.trained_tokens(dataset, kind))
    log.info("%s data: %s", split, trained_share(data_lib.labelled_tokens(dataset), total))
    return dataset
