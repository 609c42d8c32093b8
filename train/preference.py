"""A preference stage (`train.method: dpo`): TRL's DPOTrainer inside the shared trainer's life cycle.

PreferenceRecipe is a StageRecipe (train/recipe.py): the same run folder, checkpoints and exact resume,
time-limit stop, early stopping, pruning, tracking, GPU telemetry, summary.json and speed book. What differs:

- the data: {prompt, chosen, rejected} pairs (core/preferences.py), rendered as the SFT stage renders an
  example (string pairs as `fields`: prompt tokens, answer, eos; conversations, or any pair when
  data.chat_template is set, through the chat template, train/chat.py) and tokenized here, so TRL's own
  tokenization and its 1,024-token keep-the-start truncation never apply (`_prepare_dataset` is ours);
- the truncation rule: each answer is kept whole, the prompt loses its start (its end, the question, stays)
  until prompt + longer answer fit max_length; a pair whose longer answer alone does not fit is dropped.
  Both are counted in summary.json (`pairs_prompt_cut`, `pairs_dropped`). `max_length: auto` is the smallest
  multiple of 8 that holds the longest pair, capped at the model's positions;
- the policy: the previous stage's adapter, trainable (StageRecipe.load_model), or a fresh one;
- the reference (`train.dpo.reference`): `previous`, the previous stage's adapter frozen: TRL holds a second
  copy of a PeftModel's adapter as "ref" when given no ref_model (trl 1.16 DPOTrainer.__init__); `base`, the
  base model with adapters disabled: TRL has no switch for it, so its "ref" copy is deleted, and TRL then
  disables the adapters for the reference forward (`use_adapter(model, None)`). Unset: previous after a
  stage, base for a first one.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import datasets
from transformers import Trainer, TrainerCallback, TrainingArguments

from core import preferences
from train import chat
from train import data as data_lib
from train.model import max_positions, trainable_in_fp32
from train.recipe import ReproducibleSampling, StageRecipe, one_gpu_per_process

log = logging.getLogger("train.preference")
REFERENCE_ADAPTER = "ref"  # the name TRL gives its frozen copy of the policy's adapter
POLICY_ADAPTER = "default"


def reference_of(job) -> str:
    """The reference as it runs: the written one, else previous after a stage and base for a first."""
    written = job.train.preference.reference
    return written or ("previous" if job.init_adapter else "base")


# ---- pairs → token ids ----------------------------------------------------------------------------
def encode_pair(tokenizer, row: dict, spec) -> dict[str, list[int]]:
    """{prompt_ids, chosen_ids, rejected_ids}: the prompt shared, each answer as SFT labels it."""
    turns, chosen, rejected = preferences.pair(row)
    if isinstance(row["prompt"], str) and spec.chat_template is None:  # as `fields` are rendered
        encoded = data_lib.encode(tokenizer, [turns[0]["content"]] * 2, [chosen, rejected], "causal")
        sides = list(zip(encoded["input_ids"], encoded["labels"], strict=True))
    else:
        sides = [
            (e.input_ids, e.labels)
            for e in (
                chat.encode(tokenizer, [*turns, {"role": "assistant", "content": answer}])
                for answer in (chosen, rejected)
            )
        ]
    (chosen_prompt, chosen_ids), (rejected_prompt, rejected_ids) = (last_answer(*side) for side in sides)
    shared = common_prefix(chosen_prompt, rejected_prompt)
    return {
        "prompt_ids": chosen_prompt[:shared],
        "chosen_ids": chosen_prompt[shared:] + chosen_ids,
        "rejected_ids": rejected_prompt[shared:] + rejected_ids,
    }


def last_answer(ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
    """(the ids before the last labelled span, that span): the prompt and the answer, as SFT labels them."""
    stop = max(i for i, label in enumerate(labels) if label != -100) + 1
    start = stop
    while start > 0 and labels[start - 1] != -100:
        start -= 1
    return ids[:start], ids[start:stop]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def pair_length(example: dict) -> int:
    """What one side of the pair costs at most: the prompt and the longer answer (the batch pads to it)."""
    return len(example["prompt_ids"]) + max(len(example["chosen_ids"]), len(example["rejected_ids"]))


def encoded_pairs(source: str, spec, tokenizer) -> datasets.Dataset:
    encoded = [encode_pair(tokenizer, row, spec) for row in data_lib.read_rows(source, spec)]
    columns = {key: [e[key] for e in encoded] for key in ("prompt_ids", "chosen_ids", "rejected_ids")}
    return datasets.Dataset.from_dict({**columns, "length": [pair_length(e) for e in encoded]})


def fitted(dataset: datasets.Dataset, limit: int) -> tuple[datasets.Dataset, int, int]:
    """Pairs within `limit` tokens by our rule (module docstring): (the pairs, prompts cut, pairs dropped)."""
    answers = [
        max(len(c), len(r)) for c, r in zip(dataset["chosen_ids"], dataset["rejected_ids"], strict=True)
    ]
    too_long = [n > limit for n in dataset["length"]]
    dropped = sum(1 for long, answer in zip(too_long, answers, strict=True) if long and answer >= limit)
    if not any(too_long):
        return dataset, 0, 0

    def cut(example):
        if example["length"] > limit:
            room = limit - max(len(example["chosen_ids"]), len(example["rejected_ids"]))
            example["prompt_ids"] = example["prompt_ids"][-room:] if room > 0 else []
            example["length"] = pair_length(example)
        return example

    kept = dataset.map(cut, keep_in_memory=True).filter(lambda ids: len(ids) > 0, input_columns="prompt_ids")
    if len(kept) == 0:
        raise ValueError(
            f"max_length {limit} holds not even the answers of any pair: raise data.max_length or use 'auto'"
        )
    cut_prompts = sum(too_long) - dropped
    log.warning(
        "%d of %d pairs are longer than max_length %d: %d kept with the prompt's start cut, %d dropped "
        "(an answer alone does not fit)",
        sum(too_long),
        len(dataset),
        limit,
        cut_prompts,
        dropped,
    )
    return kept, cut_prompts, dropped


def lengths_of(dataset: datasets.Dataset, spec, positions: int | None) -> data_lib.LengthReport:
    lengths = dataset["length"]
    answers = [
        max(len(c), len(r)) for c, r in zip(dataset["chosen_ids"], dataset["rejected_ids"], strict=True)
    ]
    max_length = data_lib.pick_length(spec.max_length, max(lengths), positions, "max_length")
    truncated = {n: sum(1 for x in lengths if x > n) for n in data_lib.FIXED_LENGTHS}
    cut = sum(1 for x in lengths if x > max_length)
    return data_lib.LengthReport(max_length, None, max(lengths), max(answers), cut, 0, truncated)


# ---- the trainer ----------------------------------------------------------------------------------
def dpo_trainer_class():
    from trl import DPOTrainer  # on the node only: the login node never imports TRL

    class PreferenceTrainer(ReproducibleSampling, DPOTrainer):
        def _prepare_dataset(self, dataset, *args, **kwargs):
            return dataset  # tokenized and fitted to max_length by us (module docstring)

        def _save_checkpoint(self, model, trial):
            Trainer._save_checkpoint(self, model, trial)  # no model card README in checkpoints/

    return PreferenceTrainer


class PreferenceRecipe(StageRecipe):
    """A StageRecipe whose step is TRL's DPO step; see the module docstring."""

    pairs_prompt_cut = pairs_dropped = 0

    def load_split(self, source: str, split: str):
        dataset = encoded_pairs(source, self.job.data, self.tokenizer)
        lengths = lengths_of(dataset, self.job.data, max_positions(self.model.config))
        kept, cut, dropped = fitted(dataset, lengths.max_length)
        if split == "train":
            self.pairs_prompt_cut, self.pairs_dropped = cut, dropped
        log.info("%s pairs: %d; %s", split, len(dataset), lengths.describe())
        return kept, lengths

    def training_arguments(self) -> TrainingArguments:
        from trl import DPOConfig

        values = self.argument_values()
        dpo = self.job.train.preference
        return one_gpu_per_process(
            DPOConfig(
                **values,
                gradient_checkpointing=values["activation_checkpointing"],  # TRL's default is True
                beta=dpo.beta,
                loss_type=[dpo.loss_type],
                max_length=None,  # pairs are fitted already: TRL must not truncate again
                disable_dropout=True,  # policy and reference agree exactly where their weights do
            )
        )

    def make_trainer(self, args: TrainingArguments, callbacks: list[TrainerCallback]) -> Trainer:
        os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # TRL pings the hub from its trainers
        trainer = dpo_trainer_class()(
            model=self.model,
            args=args,
            train_dataset=self.train_set,
            eval_dataset=self.eval_set,
            processing_class=chat.text_tokenizer(self.tokenizer),
            callbacks=callbacks,
        )
        # TRL casts a quantized model's trainable weights to bf16 (QLoRA paper), not its frozen "ref" copy:
        # the policy would differ from its reference before any step. Ours stay fp32, as in an SFT stage.
        trainable_in_fp32(trainer.model)
        self.reference = reference_of(self.job)
        adapters = trainer.model.peft_config
        if self.reference == "base" and REFERENCE_ADAPTER in adapters:
            trainer.model.delete_adapter(REFERENCE_ADAPTER)  # TRL then disables the adapters instead
        if self.reference == "previous" and REFERENCE_ADAPTER not in adapters:
            raise RuntimeError(
                "TRL kept no frozen copy of the previous adapter; reference: previous cannot run"
            )
        log.info("DPO: reference %s; adapters %s", self.reference, sorted(trainer.model.peft_config))
        return trainer

    def save_model(self, folder: Path) -> None:
        self.trainer.model.save_pretrained(folder, selected_adapters=[POLICY_ADAPTER])  # not the frozen copy

    def method_summary(self) -> dict:
        return {
            "method": "dpo",
            "reference": self.reference,
            "pairs_prompt_cut": self.pairs_prompt_cut,
            "pairs_dropped": self.pairs_dropped,
        }
