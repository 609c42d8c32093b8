"""How long each planned job will take, and where that number comes from. Torch-free: --dry-run prints it.

Training: tokens to process ÷ tokens/s + start-up + in-training evals + checkpoint saves.
  tokens = prompt + target tokens of the training file x epochs, or, with max_steps, steps x examples per
  step x tokens per example. The training file's tokens are preflight's exact count when a launch's
  preflight counted them (RUN_ROOT/preflight-tokens.json, keyed by `exact_key`: the model, its tokenizer
  files, the data file and keys); else a `TokenCounter`'s, by default a local file's characters
  ÷ CHARS_PER_TOKEN. An `hf:` dataset is not read on the login node: its size comes from preflight or
  from the speed book when a stage trained on it before.
  tokens/s, start-up and eval/save seconds come from the speed book (RUN_ROOT/speeds.jsonl, written by
  every finished stage: core/speeds.py) when it has a row for this model, adapter method, precision
  (`auto`: what the job's device runs) and gradient checkpointing, on the job's kind of device (never a
  CPU row for a GPU job, nor a GPU row for a CPU job), the nearest in batch size and max length, newest
  first ("measured"); else from the model's size on assumed hardware (slurm/planning/guesses.py: "guess").
  Early stopping can only make a stage shorter.
GPU models: a GPU job takes rows measured on its own GPU model (`gpu`: named by resources.constraint or
  the partition, guesses.gpu_model; unknown: the slowest model the rows ran on, where the job may land).
  Without such a row, a row of another model in guesses.GPUS is scaled by the ratio of their peaks (peak
  bf16 FLOP/s for training, memory bandwidth for decoding) and says so: "measured (scaled from H100)".
GRPO stages: their training tokens (each prompt's num_generations sequences of prompt + completion) as
  above, plus their sampling: a generation of every completion of a rank's step at once, max_completion_length
  decoding steps each, at the decoding step of a GRPO stage's speed-book row of this model (its sampling,
  timed apart from its training), else an eval row's (one beam), scaled by the batch, else a guess; so
  `time: auto` counts the generation (Estimator.generation).
Eval jobs: batches of the answers to generate x max_new_tokens decoding steps + start-up + scoring. The
  answers are those of the first eval.limit conversations (the eval's limit counts examples): one each, or
  under `eval.turns: all` one per assistant turn (core/conversations.py scored_turns, as the eval's prompts
  are made; counted in validation's read of a local file, else one per conversation, which the basis says).
  Speeds from the speed book's eval rows, whose batches are batches of answers (every finished eval job
  writes one: "measured") when one has this model and beam count on the job's kind of device, else
  guessed from the model's size.
A row written by `launch.py --calibrate` (a few dozen steps of an experiment's first stage on the real
  hardware: slurm/planning/plan.py calibration_plan) is used the same way and says "calibrated".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from core.config import DataSpec, EvalJob, TrainJob, TrainSpec
from core.examples import TextSize
from core.rundir import RunRoot
from core.speeds import EvalSpeedRecord, SpeedRecord, read_book, read_eval_book
from core.split import Split
from slurm.planning import guesses
from slurm.planning.checks import read_examples
from slurm.planning.preflight_books import DataTokens, exact_key, known_split, read_exact_tokens, read_splits

# The usual rule of thumb for English under BPE or SentencePiece vocabularies; code and SQL run nearer 3,
# so their estimates come out a little short until the speed book or an exact count takes over.
CHARS_PER_TOKEN = 4.0
# time: auto = estimate x MARGIN + the job's signal delay (it checkpoints that long before the limit)
# + SLACK_S, rounded up to ROUND_S. The margin covers a guess that is off by a third and a slower node.
MARGIN = 1.3
# A speed guessed from the model's size on an assumed GPU at an assumed MFU was 7x off for a real 135M
# model (on a CPU): a limit from a guess takes 4x, until a measured row (a finished stage, --calibrate).
GUESS_MARGIN = 4.0
SLACK_S = 300
ROUND_S = 300
# An eval job's guess is mostly start-up (loading the model, the first batch), which a busy machine
# stretches most: a newcomer's evals, guessed at ~49 s, were killed at 15 minutes on a loaded 2-core box.
# A guessed eval limit is at least an hour (EVAL_TIME_WITHOUT_ESTIMATE's), until its speed is measured.
GUESSED_EVAL_FLOOR_S = 3600

# "measured", "calibrated", "guess", "unknown"; a measured or calibrated row from another GPU model adds
# " (scaled from MODEL)".
Source = str


TokenCounter = Callable[[str, DataSpec], DataTokens | None]


def tokens_from_characters(source: str, spec: DataSpec) -> DataTokens | None:
    """A local file's characters ÷ CHARS_PER_TOKEN, from the read that validation made; None for `hf:`."""
    if source.startswith("hf:"):
        return None
    size = read_examples(Path(source), spec)
    if not isinstance(size, TextSize):
        return None
    return DataTokens(size.examples, size.chars / CHARS_PER_TOKEN, size.answers)


@dataclass(frozen=True)
class Estimate:
    seconds: float | None  # None: nothing to count (an `hf:` dataset)
    source: Source
    basis: str  # how it was reached, for people
    tokens: Literal["preflight", "characters", "speed book"] | None = None  # where the data's size came from
    split: str | None = None  # the micro-batch x accumulation it is estimated at (Split.short); None: auto
    startup_s: float = 0.0  # of `seconds`, the job's start-up: what a pruned run pays however early it stops
    # one optimizer step, where one may outlast the signal delay (a GRPO step, its generation included)
    step_s: float | None = None

    def to_json(self) -> dict:
        seconds = round(self.seconds) if self.seconds is not None else None
        return {
            "seconds": seconds,
            "source": self.source,
            "basis": self.basis,
            "tokens": self.tokens,
            "split": self.split,
        }


@dataclass(frozen=True)
class Speed:
    tokens_per_s: float  # the whole job's, all its GPUs together
    startup_s: float
    save_s: float
    eval_s_per_example: float | None  # measured; None: forward passes at EVAL_SPEEDUP x tokens_per_s
    source: Source
    basis: str

    def eval_s(self, data: DataTokens) -> float:
        if self.eval_s_per_example is not None:
            return self.eval_s_per_example * data.examples
        return data.tokens / (guesses.EVAL_SPEEDUP * self.tokens_per_s)


class Estimator:
    """The estimates of one plan: the speed book is read once, each data file counted once."""

    def __init__(
        self,
        book: list[SpeedRecord],
        count: TokenCounter = tokens_from_characters,
        eval_book: list[EvalSpeedRecord] = (),
        exact: Mapping[str, DataTokens] | None = None,
        splits: Mapping[str, Split] | None = None,
    ):
        self.book, self.count, self.eval_book = book, count, list(eval_book)
        self.exact = dict(exact or {})  # exact_key → preflight's count of a training file
        self.splits = dict(splits or {})  # split_key → the split preflight chose

    @classmethod
    def for_run_root(cls, run_root: str | Path) -> Estimator:
        book = RunRoot.of(run_root).speed_book
        return cls(
            read_book(book),
            eval_book=read_eval_book(book),
            exact=read_exact_tokens(run_root),
            splits=read_splits(run_root),
        )

    def __call__(
        self, spec: TrainJob | EvalJob, gpus: int, gpu: str | None = None, gpu_mem_gb: float | None = None
    ) -> Estimate:
        """`gpu`: the GPU model the job will get (guesses.job_gpu of its resources), None: unknown;
        `gpu_mem_gb`: its memory (cluster.yaml gpu_mem_gb), which the batch split depends on."""
        if isinstance(spec, TrainJob):
            return self.training(spec, gpus, gpu, gpu_mem_gb)
        return self.evaluation(spec, gpus, gpu)

    def tokens(self, source: str, spec: DataSpec, model: str) -> DataTokens | None:
        """Counted, or as a stage that trained on this source recorded it (this model's rows first)."""
        return self.sized(source, spec, model)[0]

    def sized(self, source: str, spec: DataSpec, model: str) -> tuple[DataTokens | None, str | None]:
        counted = self.count(source, spec)
        if counted is not None:
            return counted, "characters"
        rows = sorted((r for r in self.book if r.data == source), key=lambda r: (r.model == model, r.time))
        if not rows:
            return None, None
        return DataTokens(rows[-1].examples, rows[-1].examples * rows[-1].tokens_per_example), "speed book"

    def training(
        self, spec: TrainJob, gpus: int, gpu: str | None = None, gpu_mem_gb: float | None = None
    ) -> Estimate:
        split = known_split(spec, self.splits, gpu_mem_gb) if gpus else None
        if split is not None:  # the speed of the micro-batch it will run at; the same steps and tokens
            train = spec.train.model_copy(
                update={
                    "batch_size": split.micro_batch,
                    "grad_accum": split.grad_accum,
                    "gradient_checkpointing": split.gradient_checkpointing,
                }
            )
            spec = spec.model_copy(update={"train": train})
        estimate = self.training_at(spec, gpus, gpu)
        return replace(estimate, split=split.short() if split else None)

    def training_at(self, spec: TrainJob, gpus: int, gpu: str | None = None) -> Estimate:
        data, sized_by = (self.exact.get(exact_key(spec)), "preflight") if self.exact else (None, None)
        if data is None:
            data, sized_by = self.sized(spec.data.train, spec.data, spec.model.name_or_path)
        if data is None:
            return Estimate(None, "unknown", f"{spec.data.train}: not a local file, not in the speed book")
        speed = training_speed(spec, gpus, self.book, gpu)
        steps, tokens = training_work(spec.train, data, max(1, gpus))
        if spec.train.method == "grpo" and sized_by != "preflight":
            # a file's characters count each example once; a GRPO step trains its num_generations
            # completions of it (preflight counts them exactly: train/grpo_data.py tokens_per_epoch)
            tokens *= spec.train.reward_objective.num_generations
        evals, saves = checkpoints(spec, data, steps, max(1, gpus))
        eval_data = self.tokens(spec.data.eval, spec.data, spec.model.name_or_path) if evals else None
        eval_s = evals * speed.eval_s(eval_data) if eval_data else 0.0
        seconds = speed.startup_s + tokens / speed.tokens_per_s + eval_s + saves * speed.save_s
        counted = " (counted by preflight)" if sized_by == "preflight" else ""
        basis = f"{tokens:,.0f} tokens{counted} in {steps} steps, {evals} evals, {saves} saves; {speed.basis}"
        source, step_s = speed.source, None
        if spec.train.method == "grpo":
            generation_s, said, measured = self.generation(spec, steps, gpus, gpu)
            seconds += generation_s
            basis += f"; {said}"
            source = source if measured else "guess"
            step_s = (tokens / speed.tokens_per_s + generation_s) / max(1, steps)
        return Estimate(seconds, source, basis, sized_by, startup_s=speed.startup_s, step_s=step_s)

    def generation(self, spec: TrainJob, steps: int, gpus: int, gpu: str | None) -> tuple[float, str, bool]:
        """(seconds, said, from the speed book) of a GRPO stage's sampling: one generation a step, of every
        completion of the rank's prompts at once, up to max_completion_length decoding steps (the longest
        completion sets them), each a decoding step of a GRPO stage's (else an eval's) speed-book row for this model, scaled by the
        batch as the eval's estimate scales it; else guessed from the model's size."""
        grpo = spec.train.reward_objective
        batch = spec.train.batch_size * spec.train.grad_accum * grpo.num_generations
        decoding = steps * grpo.max_completion_length
        sampled = [r for r in self.book if r.objective == "grpo" and r.decode_step_s and r.decode_batch]
        found = nearest_decoding(spec.model.name_or_path, batch, gpus, sampled, gpu)
        book = "a GRPO stage's row"
        if found is None:
            found, book = (
                nearest_decoding(spec.model.name_or_path, batch, gpus, self.eval_book, gpu),
                "an eval's row",
            )
        if found is not None:
            record, target = found
            scale, scaled = scaling(record.device_name, target, guesses.peak_bandwidth)
            recorded_batch = getattr(record, "decode_batch", None) or record.batch_size
            step_s = record.decode_step_s * batch / recorded_batch / scale
            where = f"{book} in the speed book ({record.device_name}, batch {recorded_batch}{scaled})"
        else:
            parameters, _ = guesses.model_parameters(spec.model.name_or_path)
            step_s, where = guesses.decode_step_s(parameters, gpus, 1, gpu), "guessed from the model's size"
        said = f"generation {steps} x {grpo.max_completion_length} decoding steps of {batch} completions at {step_s:.3f} s ({where})"
        return decoding * step_s, said, found is not None

    def evaluation(self, spec: EvalJob, gpus: int, gpu: str | None = None) -> Estimate:
        data = self.tokens(spec.source, spec.data, spec.model.name_or_path)
        if data is None:
            return Estimate(None, "unknown", f"{spec.source}: not a local file, not in the speed book")
        answers, counted = eval_answers(spec, data)
        batches = math.ceil(answers / spec.eval.batch_size)
        work = f"{counted} in {batches} batches x {spec.eval.max_new_tokens} new tokens"
        found = nearest_eval_record(spec, gpus, self.eval_book, gpu)
        if found is not None:
            record, target = found
            scale, scaled = scaling(record.device_name, target, guesses.peak_bandwidth)
            # Per decoding step of a batch, scaled by the batch size (a decoding step's cost grows with it).
            step_s = record.decode_step_s * spec.eval.batch_size / record.batch_size / scale
            scoring_s = record.scoring_s * answers / (record.batches * record.batch_size)  # per answer
            seconds = record.startup_s + batches * spec.eval.max_new_tokens * step_s + scoring_s
            basis = (
                f"{work} at {step_s:.3f} s/step from the speed book ({record.device_name}, batch "
                f"{record.batch_size}{scaled})"
            )
            return Estimate(seconds, "measured" + source_note(record.device_name, target), basis)
        parameters, where = guesses.model_parameters(spec.model.name_or_path)
        step_s = guesses.decode_step_s(parameters, gpus, spec.eval.num_beams, gpu)
        seconds = guesses.startup_s(parameters) + batches * spec.eval.max_new_tokens * step_s
        basis = (
            f"{work} at {step_s:.3f} s/step; {parameters:.3g} parameters ({where}) on "
            f"{guesses.hardware_name(gpus, gpu)}"
        )
        return Estimate(seconds, "guess", basis)


def eval_answers(spec: EvalJob, data: DataTokens) -> tuple[int, str]:
    """(answers the eval generates, said for the basis), as train/data.py prompts_and_targets makes its
    prompts: the first eval.limit examples (conversations), each its last assistant turn, or under
    `eval.turns: all` each of its assistant turns (data.answers; unknown: one per conversation)."""
    conversations = min(data.examples, spec.eval.limit or data.examples)
    if spec.eval.turns != "all":
        return conversations, f"{conversations} examples"
    if not data.answers:
        return conversations, f"{conversations} conversations (assistant turns unknown: one answer each)"
    answers = sum(data.answers[:conversations])
    return answers, f"{answers} answers (every assistant turn of {conversations} conversations)"


def training_work(train: TrainSpec, data: DataTokens, processes: int) -> tuple[int, float]:
    """(optimizer steps, tokens) as the trainer counts them: a last, shorter accumulation still steps."""
    per_epoch = train.steps_per_epoch(data.examples, processes)
    if train.max_steps:
        examples = train.max_steps * train.batch_size * train.grad_accum * processes
        return train.max_steps, examples * data.tokens / data.examples
    return math.ceil(per_epoch * train.epochs), data.tokens * train.epochs


def checkpoints(spec: TrainJob, data: DataTokens, steps: int, processes: int) -> tuple[int, int]:
    """(in-training evals, checkpoint saves): a save at every eval, and every save_every_steps."""
    train = spec.train
    saves = steps // train.save_every_steps
    if not (spec.data.eval and train.eval_every_epochs):
        return 0, saves
    per_epoch = train.steps_per_epoch(data.examples, processes)
    evals = steps // max(1, round(per_epoch * train.eval_every_epochs))
    return evals, saves + evals


def training_speed(spec: TrainJob, gpus: int, book: list[SpeedRecord], gpu: str | None = None) -> Speed:
    """From the nearest speed-book row that fits this job (nearest_record); else a guess by size."""
    found = nearest_record(spec, gpus, book, gpu)
    if found is not None:
        return measured_speed(*found, gpus)
    parameters, where = guesses.model_parameters(spec.model.name_or_path)
    precision = spec.train.precision
    tokens_per_s = guesses.training_tokens_per_s(
        parameters, gpus, spec.adapter.method, precision, spec.train.gradient_checkpointing, gpu
    )
    basis = (
        f"{tokens_per_s:,.0f} tokens/s guessed for {parameters:.3g} parameters ({where}) on "
        f"{max(1, gpus)} x {guesses.hardware_name(gpus, gpu)}"
    )
    return Speed(tokens_per_s, guesses.startup_s(parameters), guesses.SAVE_S, None, "guess", basis)


def measured_speed(record: SpeedRecord, target: str | None, gpus: int) -> Speed:
    """The row's speed per process, times this job's processes (data parallel scales about linearly), and
    by the peak ratio when it ran on another GPU model than `target` (start-up and saves are not compute)."""
    scale, scaled = scaling(record.device_name, target, guesses.peak_flops)
    tokens_per_s = record.tokens_per_s / record.world_size * max(1, gpus) * scale
    measured_eval = record.eval_s and record.eval_examples
    per_example = record.eval_s / record.eval_examples / scale if measured_eval else None
    save_s = record.save_s if record.save_s is not None else guesses.SAVE_S
    basis = (
        f"{tokens_per_s:,.0f} tokens/s from the speed book ({record.device_name}, batch {record.batch_size}, "
        f"max length {record.max_length}{scaled})"
    )
    source = ("calibrated" if record.calibration else "measured") + source_note(record.device_name, target)
    return Speed(tokens_per_s, record.startup_s, save_s, per_example, source, basis)


def scaling(device_name: str, target: str | None, peak: Callable[[str | None], float]) -> tuple[float, str]:
    """(factor on a row's speed, words for the basis): 1 on the job's own GPU model (or CPU), else the
    job's GPU's peak over the row's."""
    model = scaled_from(device_name, target)
    if model is None:
        return 1.0, ""
    factor = peak(target) / peak(model)
    return factor, f"; x {factor:.2f}: scaled from {model} to {target} by their peaks"


def scaled_from(device_name: str, target: str | None) -> str | None:
    """The row's GPU model when it is not the job's (its speeds get scaled), else None."""
    model = guesses.gpu_model(device_name)
    return model if device_name != "cpu" and model != target else None


def source_note(device_name: str, target: str | None) -> str:
    model = scaled_from(device_name, target)
    return f" (scaled from {model})" if model else ""


def runs_as(precision: str, gpus: int) -> set[str]:
    """What a job runs in: `auto` is fp32 on CPUs and bf16 (fp16 where a GPU lacks it) on GPUs."""
    if precision != "auto":
        return {precision}
    return {"bf16", "fp16"} if gpus else {"fp32"}


def same_device_kind(device_name: str, gpus: int) -> bool:
    """A CPU row is never used for a GPU job (resources.gpus >= 1), nor a GPU row for a CPU job."""
    return (device_name != "cpu") == (gpus > 0)


def by_gpu_model(rows: list, gpus: int, gpu: str | None) -> tuple[list, str | None]:
    """(rows a job may use, the GPU model it is estimated for). A GPU job's own model's rows (`gpu`
    unknown: the slowest model the rows ran on, since the job may land there); else rows of any model in
    guesses.GPUS, to be scaled (a GPU missing from it cannot be scaled: its rows are left out)."""
    if not gpus:
        return rows, None
    models = [guesses.gpu_model(r.device_name) for r in rows]
    target = gpu or min(filter(None, models), key=guesses.peak_flops, default=None)
    same = [r for r, m in zip(rows, models, strict=True) if m == target]
    return same or [r for r, m in zip(rows, models, strict=True) if m], target


def nearest_record(
    spec: TrainJob, gpus: int, book: list[SpeedRecord], gpu: str | None = None
) -> tuple[SpeedRecord, str | None] | None:
    """(row, the GPU model the job is estimated for): a row of the same model, method, objective, precision,
    gradient checkpointing and kind of device, of the job's GPU model first (by_gpu_model); then nearest
    in batch size and max length (by ratio: 8 is as far from 16 as 16 from 32); of the rows as near as that,
    the one of median speed (the slower of two): one noisy row, or a short calibration's, does not swing
    the estimate, as taking the newest did."""
    wanted = runs_as(spec.train.precision, gpus)
    matching = [
        r
        for r in book
        if r.model == spec.model.name_or_path
        and r.method == spec.adapter.method
        and r.objective == spec.train.method
        and r.precision in wanted
        and bool(r.gradient_checkpointing) == spec.train.gradient_checkpointing  # a row without: off
        and same_device_kind(r.device_name, gpus)
        and r.tokens_per_s > 0
    ]
    matching, target = by_gpu_model(matching, gpus, gpu)
    length = spec.data.max_length if isinstance(spec.data.max_length, int) else None

    def distance(record: SpeedRecord) -> float:
        far = abs(math.log(record.batch_size / spec.train.batch_size))
        if length:
            far += abs(math.log(record.max_length / length))
        return round(far, 9)

    if not matching:
        return None
    nearest = min(map(distance, matching))
    tied = sorted((r for r in matching if distance(r) == nearest), key=lambda r: (r.tokens_per_s, r.time))
    return tied[(len(tied) - 1) // 2], target


def nearest_decoding(model: str, batch: int, gpus: int, book: list, gpu: str | None = None) -> tuple | None:
    """A row of `model` that decoded on the job's kind of device: a GRPO stage's own (its decode_batch), or
    an eval's with one beam (a GRPO stage's sampling decodes as the eval does, one token of the whole batch
    a step). Nearest in batch, then newest; (row, the GPU model the job is estimated for)."""

    def batch_of(row) -> int:
        return getattr(row, "decode_batch", None) or row.batch_size

    matching = [
        r
        for r in book
        if r.model == model and getattr(r, "num_beams", 1) == 1 and same_device_kind(r.device_name, gpus)
    ]
    matching, target = by_gpu_model(matching, gpus, gpu)
    if not matching:
        return None
    return min(matching, key=lambda r: (abs(math.log(batch_of(r) / batch)), -r.time)), target


def nearest_eval_record(
    spec: EvalJob, gpus: int, book: list[EvalSpeedRecord], gpu: str | None = None
) -> tuple[EvalSpeedRecord, str | None] | None:
    """(row, the GPU model the job is estimated for): an eval row of this model and beam count on the
    job's kind of device, of its GPU model first (by_gpu_model); nearest in batch size, then newest."""
    matching = [
        r
        for r in book
        if r.model == spec.model.name_or_path
        and r.num_beams == spec.eval.num_beams
        and same_device_kind(r.device_name, gpus)
    ]
    matching, target = by_gpu_model(matching, gpus, gpu)
    if not matching:
        return None
    nearest = min(matching, key=lambda r: (abs(math.log(r.batch_size / spec.eval.batch_size)), -r.time))
    return nearest, target


def auto_time_limit_s(
    estimate_s: float | None, signal_delay_s: int, max_time_s: int, guessed: bool = False, floor_s: int = 0
) -> int:
    """`time: auto`: estimate x MARGIN (GUESS_MARGIN when the speed is a guess) + signal delay + SLACK_S,
    at least `floor_s` (GUESSED_EVAL_FLOOR_S for a guessed eval), rounded up to ROUND_S, at most max_time
    (the cluster's longest; also what a job without an estimate gets)."""
    if estimate_s is None:
        return max_time_s
    wanted = max(floor_s, estimate_s * (GUESS_MARGIN if guessed else MARGIN) + signal_delay_s + SLACK_S)
    return min(max_time_s, math.ceil(wanted / ROUND_S) * ROUND_S)
