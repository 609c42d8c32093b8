"""Preflight: what each training job will find when it starts, worked out on the login node before queueing.

    preflight_job(TrainJob, gpu_mem_gb) → JobPreflight    (trainable %, token lengths, GPU memory)

Nothing here reads weights or needs a GPU. The model is built on the meta device from its config and the
adapter applied by train/model.py's own `new_adapter`; the share is counted by the trainer's own
`trainable_report`; token lengths come from train/data.py's cached tokenization and `choose_lengths`, so the
job later finds the cache ready and picks the same max_length. Torch is imported here, and only on a cache
miss (slurm/planning/preflight.py): the dry run and the status commands never import this module.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from functools import lru_cache

import numpy

from core.config import TrainJob
from core.preflight import JobPreflight
from core.split import Split, resolve
from train import chat, memory, pairs, vl
from train import data as data_lib
from train.chat import ChatTemplateError
from train.grpo_data import as_completions, lengths_of_a_step, prompts_as_trained, tokens_per_epoch
from train.hub_cache import first_line
from train.loss import liger_installed
from train.memory_figures import (
    LENGTH_KEYS,
    estimate_for,
    evaluates,
    fused_possible,
    meta_model,
    split_figures,
    tokenizer_size,
)
from train.model import load_tokenizer, max_positions, trainable_report

log = logging.getLogger("train.preflight")


# ---- token lengths ----------------------------------------------------------------------------------
@lru_cache(maxsize=32)
def cached_tokenizer(
    name_or_path: str, revision: str | None, kind: str, pixels: tuple = (None, None), chat: tuple = ()
):
    """The tokenizer (image-text: the processor, with its pixel bounds) once per process; `chat`: the
    data's (format, chat_template, model.added_tokens), whose template the job sets on it (train/chat.py)."""
    from core.config import DataSpec, ModelSpec

    rendering = dict(zip(("format", "chat_template"), chat[:2], strict=False))
    bounds = DataSpec(train="-", min_pixels=pixels[0], max_pixels=pixels[1], **rendering)
    added = list(chat[2]) if len(chat) > 2 else []
    model = ModelSpec(name_or_path=name_or_path, kind=kind, revision=revision, added_tokens=added)
    return load_tokenizer(name_or_path, model, bounds)


def tokenizer_or_reason(job: TrainJob):
    """(tokenizer, None), or (None, why it is skipped): a hub tokenizer not in the cache while offline
    (load_tokenizer refuses a tokenizer without files, which would count a model with almost no vocabulary)."""
    try:  # fetched into the Hugging Face cache where this machine has network and HF_HUB_OFFLINE is unset
        pixels = (job.data.min_pixels, job.data.max_pixels)
        chat = (
            (job.data.format, job.data.chat_template, tuple(job.model.added_tokens))
            if job.data.format != "fields"
            else ()
        )
        return cached_tokenizer(
            job.model.name_or_path, job.model.revision, job.model.kind, pixels, chat
        ), None
    except ChatTemplateError:  # a hub model without a template, known now: the job would refuse it
        raise
    except (OSError, ValueError) as exc:
        return None, f"tokenizer of {job.model.name_or_path} not available here ({first_line(exc)})"


def token_lengths(job: TrainJob, tokenizer, config) -> dict:
    """max_length as the job will choose it (same cache, same choose_lengths), cuts and tokens per epoch.
    `tokenizer` is meta_model's, holding model.added_tokens as the job's does: a chat template's markers
    among them are one token each, not a dozen characters."""
    kind = job.model.kind
    if job.train.method == "grpo":
        return grpo_token_lengths(job, tokenizer)
    dataset, kept, lengths = lengths_of(job, job.data.train, tokenizer, config)
    eval_lengths = lengths_of(job, job.data.eval, tokenizer, config)[2] if evaluates(job) else None
    spread = {"inputs": percentiles(dataset["length"])}
    if kind == "seq2seq":
        spread["targets"] = percentiles(data_lib.target_lengths(dataset))
    return {
        "length_percentiles": spread,
        "max_length": lengths.max_length,
        "max_target_length": lengths.max_target_length,
        "tokens_per_epoch": sum(data_lib.trained_tokens(kept, kind)),
        # A pair has no labels: DPO sums log-probabilities over both answers (tokens_per_epoch: the longer)
        "labelled_tokens": None if job.train.method == "dpo" else data_lib.labelled_tokens(kept),
        "marker_text_conversations": data_lib.marker_text_in(job.data.train, job.data, tokenizer, kind),
        "examples": len(kept),
        "longest_example": lengths.longest,
        "truncated_inputs": lengths.inputs_truncated,
        "dropped_examples": lengths.dropped,
        "truncated_at": {str(k): v for k, v in lengths.truncated_at.items()},
        "step_lengths": step_lengths(kind, lengths, eval_lengths),
    }


def grpo_token_lengths(job: TrainJob, tokenizer) -> dict:
    """token_lengths of a GRPO stage, as its job counts them (train/grpo.py): prompts, each with
    num_generations completions of at most max_completion_length; refused (ValueError) when that cannot hold
    the longest training reference."""
    grpo = job.train.reward_objective
    _, references, ids = prompts_as_trained(job.data.train, job.data, tokenizer, job.model.kind)
    completions_hold_references(job, tokenizer, references)
    prompt_lengths = [len(i) for i in ids]
    lengths = lengths_of_a_step(prompt_lengths, grpo.max_completion_length)
    sequences = [length + grpo.max_completion_length for length in prompt_lengths]
    return {
        "length_percentiles": {"inputs": percentiles(sequences)},
        "max_length": lengths.max_length,
        "max_target_length": lengths.max_target_length,
        "tokens_per_epoch": tokens_per_epoch(
            prompt_lengths, grpo.num_generations, grpo.max_completion_length
        ),
        "labelled_tokens": len(ids) * grpo.num_generations * grpo.max_completion_length,
        "marker_text_conversations": None,
        "examples": len(ids),
        "longest_example": lengths.longest,
        "truncated_inputs": 0,
        "dropped_examples": 0,
        "truncated_at": {},
        "step_lengths": step_lengths(job.model.kind, lengths, None),
    }


def completions_hold_references(job: TrainJob, tokenizer, references: list[str]) -> None:
    """A GRPO stage's max_completion_length holds its longest training reference and the end of turn after
    it: a completion cut shorter could never equal the reference, and no reward could say it is right."""
    text = chat.text_tokenizer(tokenizer)
    lengths = [len(ids) + 1 for ids in text(list(references), add_special_tokens=False)["input_ids"]]
    longest, limit = max(lengths, default=0), job.train.reward_objective.max_completion_length
    if longest > limit:
        longer = sum(length > limit for length in lengths)
        raise ValueError(
            f"train.grpo.max_completion_length {limit} cannot hold the longest training reference: raise it "
            f"to at least {longest} (its tokens with the end of turn; {longer} of {len(lengths)} references of "
            f"{job.data.train} are longer, and a completion cut short can never be right)"
        )


def lengths_of(job: TrainJob, source: str, tokenizer, config):
    """(dataset, dataset as trained, LengthReport) of one data file, as the job's load_split reads it."""
    kind = job.model.kind
    if job.train.method == "dpo":  # the job's own pairs: prompt + the longer answer, fitted by its rule
        dataset = pairs.encoded_pairs(source, job.data, tokenizer)
        lengths = pairs.lengths_of(dataset, job.data, max_positions(config))
        kept, cut, dropped = pairs.fitted(dataset, lengths.max_length, source)
        # A too-long pair keeps its answers and loses its prompt's start, or is dropped when an answer alone
        # does not fit: counted apart (L12: before, every long pair read as "cut").
        return dataset, kept, replace(lengths, inputs_truncated=cut, dropped=dropped)
    if kind == "image-text":  # the job's own count: prompt + image tokens + answer; over-long ones dropped
        dataset = vl.examples(source, job.data, tokenizer)
        lengths = vl.choose_length(dataset, job.data, max_positions(config))
        return dataset, vl.drop_too_long(dataset, lengths), lengths
    dataset = data_lib.tokenized(source, job.data, tokenizer, kind)
    lengths = data_lib.choose_lengths(dataset, job.data, kind, max_positions(config))
    return dataset, data_lib.truncate(dataset, lengths, kind), lengths


def step_lengths(kind: str, train: data_lib.LengthReport, eval_: data_lib.LengthReport | None) -> dict:
    """The lengths the memory model judges the steps at (train/memory.py estimate): the training set's, the
    most target tokens one of its examples has (the loss's logits are at those only; seq2seq: every
    decoder position), and the eval set's own, whose batches the in-training eval step runs on."""
    found = {
        "max_length": train.max_length,
        "max_target_length": train.max_target_length or train.max_length,
        "targets": None if kind == "seq2seq" else train.longest_target,
    }
    if eval_ is not None:
        found |= {
            "eval_max_length": eval_.max_length,
            "eval_max_target_length": eval_.max_target_length or eval_.max_length,
            "eval_targets": None if kind == "seq2seq" else eval_.longest_target,
        }
    return found


def percentiles(lengths: list[int]) -> list[int]:
    """p50, p90, p99 and the longest, each a length some example has (not interpolated)."""
    return [int(v) for v in numpy.percentile(lengths, PERCENTILES, method="higher")]


PERCENTILES = (50, 90, 99, 100)


# ---- one job ------------------------------------------------------------------------------------------
def preflight_job(job: TrainJob, gpu_mem_gb: float | None) -> JobPreflight:
    base_tokenizer, skipped = tokenizer_or_reason(job)
    report, config, tokenizer = trainable_of(job, base_tokenizer)
    result = JobPreflight(
        job=f"{job.experiment}/{job.stage}",
        trainable_percent=round(report.percent, 4),
        trainable_params=report.trainable,
        total_params=report.total,
        trainable_by_module=report.by_module,
        max_trainable_percent=job.adapter.max_trainable_percent,
        gpu_mem_gb=gpu_mem_gb,
        tokens_skipped=skipped,
    )
    if tokenizer is not None:
        vars(result).update(token_report(job, tokenizer, config))
    judge_memory(result, as_completions(job) if job.train.method == "grpo" else job, base_tokenizer)
    return result


def token_report(job: TrainJob, tokenizer, config) -> dict:
    """`token_lengths`, or why there are none: `data_refused` (the job would fail on it at its start) or
    `tokens_skipped` (an `hf:` dataset not in the cache while offline)."""
    try:
        return token_lengths(job, tokenizer, config)
    except (OSError, ValueError, ConnectionError) as exc:
        if refused_at_start(exc, job.data.train):
            return {"data_refused": first_line(exc)}
        return {"tokens_skipped": f"data {job.data.train} not available here ({first_line(exc)})"}


def refused_at_start(exc: Exception, source: str) -> bool:
    """Would the job fail on this at its start, whatever the machine? A template that cannot render a
    conversation, a max_length no answer fits, an image-text conversation without a user turn: yes. A file
    or dataset this machine cannot read (an `hf:` dataset offline): no, the node may have it."""
    if isinstance(exc, ChatTemplateError):
        return True
    return isinstance(exc, ValueError) and not source.startswith("hf:")


def trainable_of(job: TrainJob, tokenizer):
    """(trainable report, model config, tokenizer with the added tokens); once per model and adapter in a
    process: the stages of a curriculum and experiments that differ in data share it."""
    key = json.dumps(
        [job.model.model_dump(), job.adapter.model_dump(), tokenizer_size(tokenizer)], sort_keys=True
    )
    if key not in REPORTS:
        model, with_tokens = meta_model(job, tokenizer=tokenizer)
        REPORTS[key] = trainable_report(model), model.config, with_tokens
    return REPORTS[key]


REPORTS: dict[str, tuple] = {}


def memory_shape(job: TrainJob, result: JobPreflight) -> dict | None:
    """The padded batch shape a step can reach: batch_size × max_length, the target tokens and the eval
    set's lengths (step_lengths); without the data, the written lengths (None: none written)."""
    split = {
        "batch_size": job.train.batch_size,
        "gradient_checkpointing": job.train.gradient_checkpointing,
        "grad_accum": job.train.grad_accum,
    }
    if result.step_lengths:
        return split | result.step_lengths
    length = result.max_length or (job.data.max_length if job.data.max_length != "auto" else None)
    if length is None:
        return None
    target = result.max_target_length
    if target is None and job.data.max_target_length != "auto":
        target = job.data.max_target_length
    return split | {"max_length": length, "max_target_length": target or length}


def judge_memory(result: JobPreflight, job: TrainJob, tokenizer) -> None:
    """The larger of the training step and the in-training eval step, at the split the job will run with
    on this partition's GPU (core/split.py), against the GPU's memory. `micro_batch: auto` is refused only
    when a micro-batch of 1 with checkpointing does not fit; an explicit split when it does not fit."""
    shape = memory_shape(job, result)
    if shape is None:
        return
    split = split_on(job, shape, tokenizer, result.gpu_mem_gb)
    result.split = split.as_json()
    shape = shape | {
        "batch_size": split.micro_batch,
        "grad_accum": split.grad_accum,
        "gradient_checkpointing": split.gradient_checkpointing,
    }
    estimate = estimate_for(job, shape, tokenizer, split.fused_loss)
    result.memory, result.memory_gb = estimate.as_dict(), round(estimate.total_gb, 3)
    if result.gpu_mem_gb is None:
        return
    result.fits = estimate.total_gb <= result.gpu_mem_gb
    result.largest_batch = memory.largest_batch(estimate, result.gpu_mem_gb)
    if not result.fits:
        result.alternatives = alternatives(job, shape, tokenizer, result.gpu_mem_gb)


def split_on(job: TrainJob, shape: dict, tokenizer, gpu_mem_gb: float | None) -> Split:
    """The split the job will choose at its start on a GPU of `gpu_mem_gb` (None: unknown), with the fused
    loss among its choices where the job's environment has it (the same environment as this one)."""
    if job.train.micro_batch != "auto" or gpu_mem_gb is None:
        return resolve(job.train, None, None, "no gpu_mem_gb for this partition in cluster.yaml")
    lengths = {key: value for key, value in shape.items() if key in LENGTH_KEYS}
    figures = split_figures(job, lengths, tokenizer)
    fused = (
        split_figures(job, lengths, tokenizer, fused=True)
        if fused_possible(job, tokenizer, liger_installed())
        else None
    )
    return resolve(job.train, figures, gpu_mem_gb, fused=fused)


def alternatives(job: TrainJob, shape: dict, tokenizer, gpu_mem_gb: float) -> list[str]:
    """What else would fit: checkpointing, the same effective batch through grad_accum, or QLoRA."""
    found = []
    effective = job.train.batch_size * job.train.grad_accum
    if not job.train.gradient_checkpointing:
        checkpointed = estimate_for(job, shape | {"gradient_checkpointing": True}, tokenizer)
        batch = memory.largest_batch(checkpointed, gpu_mem_gb)
        if batch >= 1:
            found.append(f"train.gradient_checkpointing: true fits batch_size {batch}")
    if job.adapter.method == "lora":
        qlora = job.model_copy(update={"adapter": job.adapter.model_copy(update={"method": "qlora"})})
        batch = memory.largest_batch(estimate_for(qlora, shape, tokenizer), gpu_mem_gb)
        if batch >= 1:
            found.append(f"adapter.method: qlora fits batch_size {batch}")
    return found + accumulation_hint(job, shape, tokenizer, gpu_mem_gb, effective)


def accumulation_hint(job, shape, tokenizer, gpu_mem_gb: float, effective: int) -> list[str]:
    # Accumulating, every gradient is held through the step: judged as such, whatever the number of steps.
    accumulating = shape | {"grad_accum": max(2, shape["grad_accum"])}
    batch = memory.largest_batch(estimate_for(job, accumulating, tokenizer), gpu_mem_gb)
    if batch < 1:
        return []
    accum = -(-effective // batch)
    return [
        f"train.batch_size: {batch} with train.grad_accum: {accum} keeps the effective batch {batch * accum}"
    ]
