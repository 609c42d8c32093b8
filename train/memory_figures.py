"""The memory model's figures for one training job: the adapted model built on the meta device (no weights),
and train/memory.py's estimate of a step on it, at any micro-batch, with or without checkpointing and the
fused loss, for SFT, DPO and GRPO steps. Preflight (train/preflight.py) judges a job with them on the login node,
and the job itself (train/recipe.py) chooses its split with the same figures at its start."""

from __future__ import annotations

import copy
import json
import logging
from functools import partial

import torch
from transformers import AutoConfig

from core.config import TrainJob
from core.split import MemoryFigures, StepLine, elastic_accumulation
from train import memory
from train.chat import text_tokenizer
from train.loss import TargetTokenLoss, fusable
from train.model import add_tokens, model_class, new_adapter

log = logging.getLogger("train.preflight")


def model_config(name_or_path: str, revision: str | None):
    """config.json from a local folder or the Hugging Face cache (HF_HUB_OFFLINE honoured); a fresh object
    each time, since building a model writes into its config."""
    return AutoConfig.from_pretrained(name_or_path, revision=revision)


def meta_model(job: TrainJob, dtype: torch.dtype = torch.float32, tokenizer=None, layers: int | None = None):
    """(model, tokenizer): the adapted model as the job builds it (train/model.py load_base, then
    new_adapter), with shapes but no weights, and a copy of the tokenizer holding model.added_tokens, as the
    job's tokenizer does.
    `layers`: keep at most this many layers per stack (train/memory.py extrapolates from one and two)."""
    config = model_config(job.model.name_or_path, job.model.revision)
    if layers is not None:
        config = memory.shallow(config, layers)
    tokenizer = copy.deepcopy(tokenizer)
    with torch.device("meta"):
        model = model_class(job.model.kind).from_config(config, dtype=dtype)
        # New rows start at the mean of the old ones in the job; a meta tensor has no mean to take.
        model.resize_token_embeddings = partial(model.resize_token_embeddings, mean_resizing=False)
        new_ids = add_tokens(model, tokenizer, job.model.added_tokens) if tokenizer is not None else []
        return new_adapter(model, job.adapter, job.model.kind, new_ids), tokenizer


def fused_possible(job: TrainJob, tokenizer, installed: bool) -> bool:
    """A fused loss can run for this job: the extra is `installed` and the model's output layer is plain."""
    if not installed or job.train.method != "sft":  # TRL's DPO and GRPO steps fuse their own output layer
        return False
    reason = fusable(meta_model(job, tokenizer=tokenizer, layers=1)[0])
    if reason:
        log.info("%s/%s: no fused loss: %s", job.experiment, job.stage, reason)
    return reason is None


# step_lengths' keys: what a step's shape takes from the data
LENGTH_KEYS = (
    "max_length",
    "max_target_length",
    "targets",
    "eval_max_length",
    "eval_max_target_length",
    "eval_targets",
)


def split_figures(job: TrainJob, lengths: dict, tokenizer, fused: bool = False) -> MemoryFigures:
    """The memory model's lines for any micro-batch up to the effective batch (measured out to it: a line
    is exact at its two ends and above the step between them), without and with checkpointing, with the
    plain or the `fused` loss. Judged as accumulating, every gradient held through the step: for a
    micro-batch of the whole effective batch that overstates the peak by at most the trainable weights'
    gradients. `lengths`: step_lengths (max_length, max_target_length, targets and the eval set's)."""
    shape = lengths | {
        "batch_size": job.train.batch_size * job.train.grad_accum,
        "max_target_length": lengths.get("max_target_length") or lengths["max_length"],
        "gradient_checkpointing": False,
        "grad_accum": 2,
    }
    lines = {}
    for checkpointing in (False, True):
        step = shape | {"gradient_checkpointing": checkpointing}
        found = estimate_for(job, step, tokenizer, fused).lines()
        lines[checkpointing] = tuple(StepLine(fixed, per_example) for fixed, per_example in found)
    return MemoryFigures(plain=lines[False], checkpointed=lines[True])


def estimate_for(job: TrainJob, shape: dict, tokenizer, fused: bool = False) -> memory.MemoryEstimate:
    """Once per model, adapter, precision and shape in a process: the stages of a curriculum, and
    experiments that differ in data only, share it."""
    key = json.dumps(
        [
            job.model.model_dump(),
            job.adapter.model_dump(),
            job.train.precision,
            job.train.method,
            job.train.preference.reference if job.train.method == "dpo" else None,
            job.init_adapter is not None,
            shape,
            evaluates(job),
            tokenizer_size(tokenizer),
            fused,
        ],
        sort_keys=True,
    )
    if key not in ESTIMATES:
        ESTIMATES[key] = measure_memory(job, shape, tokenizer, fused)
    return ESTIMATES[key]


ESTIMATES: dict[str, memory.MemoryEstimate] = {}


def tokenizer_size(tokenizer) -> int | None:
    return len(text_tokenizer(tokenizer)) if tokenizer is not None else None


def measure_memory(job: TrainJob, shape: dict, tokenizer, fused: bool = False) -> memory.MemoryEstimate:
    """QLoRA is built as LoRA over an unquantized base (meta tensors cannot be 4-bit); train/memory.py gives
    it QLoRA's dtypes and counts its 4-bit weights."""
    as_lora = job.model_copy(update={"adapter": job.adapter.model_copy(update={"method": "lora"})})
    dtype = memory.weight_dtype(job.train.precision)

    def build(layers: int | None):
        return meta_model(as_lora, dtype, tokenizer, layers)[0]

    kind = job.model.kind
    loss = trainer_loss(kind, fused)
    if job.train.method in ("dpo", "grpo"):  # TRL's steps, their LM head always fused (train/memory.py)
        from train.dpo_step import fused_log_prob_loss

        loss = TargetTokenLoss(shifted=True, fused=fused_log_prob_loss)
        shape = shape | (preference_step(job) if job.train.method == "dpo" else grpo_step(job, shape))
    return memory.estimate(build, kind, job.adapter, job.train.precision, shape, evaluates(job), loss)


def preference_step(job: TrainJob) -> dict:
    """What a DPO step adds to the shape (train/memory.py): chosen and rejected as 2 sequences per example,
    the reference forward, and under reference: previous the adapter's frozen copy."""
    from train.dpo_step import reference_of

    return {"sequences": 2, "reference_forward": True, "reference_copy": reference_of(job) == "previous"}


def grpo_step(job: TrainJob, shape: dict) -> dict:
    """What a GRPO step adds to the shape (train/memory.py): its generation, this rank's completions of a whole
    step at once (`job` counts completions: train/grpo_data.py as_completions), from the longest prompt (the
    shape's max_length less max_completion_length); and with beta > 0 under reference: previous, the adapter's
    frozen copy. An elastic job is judged on its fewest ranks, where each rank accumulates, and so generates,
    the most (core/split.py elastic_accumulation)."""
    from train.dpo_step import reference_of

    grpo, accum = job.train.reward_objective, job.train.grad_accum
    if job.global_ranks is not None and job.fewest_ranks is not None:
        accum = elastic_accumulation(accum, job.global_ranks, job.fewest_ranks) or accum
    generation = {
        "sequences": job.train.batch_size * accum,
        "prompt_length": shape["max_length"] - grpo.max_completion_length,
        "completion_length": grpo.max_completion_length,
        "temperature": grpo.temperature,
    }
    return {"generation": generation, "reference_copy": grpo.beta > 0 and reference_of(job) == "previous"}


def evaluates(job: TrainJob) -> bool:
    """Whether the job runs in-training evals (train/recipe.py StageRecipe.evaluating; a GRPO step has no eval
    loss: train/grpo.py GrpoRecipe.evaluates_in_training)."""
    in_training = job.train.method != "grpo"
    return in_training and job.data.eval is not None and job.train.eval_every_epochs is not None


def trainer_loss(kind: str, fused: bool = False):
    """The trainer's own loss (its compute_loss_func), so the estimate computes the loss as the job does;
    `fused`: with the output layer fused in, as torch's chunked equivalent of Liger's kernel."""
    from train.loss import TargetTokenLoss, chunked_linear_cross_entropy

    return TargetTokenLoss(shifted=kind != "seq2seq", fused=chunked_linear_cross_entropy if fused else None)
