"""A GRPO stage's data as its job reads it and preflight counts it (train/grpo.py, train/preflight.py): the
SFT data's prompts as the SFT stage trains them, their references, and the sequences a step trains."""

from __future__ import annotations

from core.config import TrainJob
from train import chat
from train.data import LengthReport, prompts_and_targets


def prompts_as_trained(
    source: str, data, tokenizer, kind: str
) -> tuple[list[str], list[str], list[list[int]]]:
    """(prompt texts, references, prompt ids): the eval's prompts and references (train/data.py
    prompts_and_targets), each prompt's ids those the SFT stage trains before its answer (a conversation's
    chat.ChatPrompt ids; a `fields` prompt tokenized as train/data.py encode tokenizes it)."""
    text = chat.text_tokenizer(tokenizer)
    prompts, references = prompts_and_targets(source, data, text, kind)
    ids = [p.ids if isinstance(p, chat.ChatPrompt) else text(p)["input_ids"] for p in prompts]
    return prompts, references, ids


def lengths_of_a_step(prompt_lengths: list[int], max_completion_length: int) -> LengthReport:
    """The sequences a GRPO step trains, as an SFT stage's LengthReport: a prompt (never cut) and a completion
    of at most max_completion_length, its target."""
    longest = max(prompt_lengths, default=0) + max_completion_length
    return LengthReport(longest, None, longest, max_completion_length, 0, 0, {})


def tokens_per_epoch(prompt_lengths: list[int], generations: int, max_completion_length: int) -> int:
    """Prompt and completion tokens an epoch trains at most: each prompt's num_generations sequences."""
    return generations * sum(length + max_completion_length for length in prompt_lengths)


def as_completions(job: TrainJob) -> TrainJob:
    """A GRPO stage as the memory model and the split count it: its batch in completions, batch_size x
    num_generations per rank and accumulation step (micro_batch counts completions already), so a micro-batch
    is a number of sequences of prompt + completion, as TRL's training step takes them (train/memory.py)."""
    train = job.train
    completions = train.batch_size * train.reward_objective.num_generations
    return job.model_copy(update={"train": train.model_copy(update={"batch_size": completions})})
