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
  stage, base for a first one;
- the accumulated loss: the mean over the optimizer step's pairs, whatever the split into micro-batches and
  ranks (pair_weight), as an SFT step's is the mean over its target tokens (train/loss.py); and TRL's logged
  per-pair figures (rewards/*, logps/*) the mean over the logged pairs (weigh_by_pairs).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

from transformers import Trainer, TrainerCallback, TrainingArguments

from train import chat
from train.dpo_step import reference_of
from train.model import max_positions, trainable_in_fp32
from train.pairs import encoded_pairs, fitted, lengths_of
from train.recipe import StageRecipe, one_gpu_per_process, stage_trainer
from train.trl_seams import POLICY_ADAPTER, keep_reference

log = logging.getLogger("train.preference")


# ---- the trainer ----------------------------------------------------------------------------------
@functools.cache
def dpo_trainer_class():
    from trl import DPOTrainer  # on the node only: the login node never imports TRL

    class PairMeanDPO:
        """DPOTrainer's pieces of ours: its loss weighed per pair across the accumulation steps (see
        PairMeanLoss); composed with what every stage's trainer needs by train/recipe.py stage_trainer."""

        loss_is_scaled_for_ga = True  # compute_loss divides by the step's pairs (PairMeanLoss)
        step_pairs: int | None = None  # pairs in this optimizer step, all micro-batches and ranks

        def _prepare_dataset(self, dataset, *args, **kwargs):
            return dataset  # tokenized and fitted to max_length by us (module docstring)

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            batches, items = super().get_batch_samples(epoch_iterator, num_batches, device)
            self.step_pairs = pairs_in_step(self.accelerator, batches, device)
            return batches, items

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            weigh_by_pairs(self._metrics["train" if self.model.training else "eval"], pairs_in(inputs))
            if not self.model.training:  # eval: the batch's mean, as TRL gives it
                return result
            loss, outputs = result if return_outputs else (result, None)
            loss = loss * pair_weight(inputs, self.step_pairs, self.accelerator.num_processes)
            return (loss, outputs) if return_outputs else loss

        def _save_checkpoint(self, model, trial):
            Trainer._save_checkpoint(self, model, trial)  # no model card README in checkpoints/

    return stage_trainer("PreferenceTrainer", DPOTrainer, PairMeanDPO)


# TRL's logged figures that are means over a micro-batch's pairs (trl 1.16 DPOTrainer.compute_loss).
PER_PAIR = ("rewards/", "logps/")


def weigh_by_pairs(metrics: dict[str, list[float]], pairs: int) -> None:
    """TRL appends each micro-batch's mean of a per-pair figure once and logs the mean of those means, so a
    short micro-batch (an epoch's last: 2 pairs, then 1) weighed as much as a full one, and the logged
    rewards moved with `train.micro_batch`. The latest mean counted once per pair of its micro-batch makes
    the logged figure the mean over the logged pairs (every rank's micro-batch holds as many)."""
    for key, values in metrics.items():
        if key.startswith(PER_PAIR) and values:
            values.extend([values[-1]] * (pairs - 1))


def pairs_in(batch) -> int:
    return len(batch["input_ids"]) // 2  # TRL's collator stacks the chosen rows, then the rejected


def pairs_in_step(accelerator, batches: list, device) -> int:
    """The pairs of one optimizer step: its micro-batches on this rank, summed over the ranks."""
    import torch

    pairs = sum(pairs_in(batch) for batch in batches)
    if accelerator.num_processes > 1:  # every rank asks at every step: a collective is safe
        pairs = int(accelerator.gather(torch.tensor([pairs], device=device)).sum())
    return pairs


def pair_weight(inputs, step_pairs: int | None, ranks: int) -> float:
    """PairMeanLoss: what a micro-batch's pair-mean loss is multiplied by so that the step's accumulated
    loss and gradient are the mean over all of its pairs.

    TRL's DPO loss is a mean over the micro-batch's pairs (one term per pair), and the Trainer divides it by
    the step's count of micro-batches (loss_is_scaled_for_ga False): a mean of per-micro-batch means. That
    equals the pair mean only when every micro-batch holds as many pairs; in an epoch's short last step
    (7 pairs at micro-batch 2 x 2: micro-batches of 2 and 1) the lone pair weighed as much as two, and
    `train.micro_batch` changed the gradient (9 % on the tiny model, tests/test_preference_split.py). So
    each micro-batch weighs its pairs' share of the step; x ranks undoes DDP's mean of the gradients."""
    if step_pairs is None:  # a step outside the training loop's batch gathering: its own mean
        return 1.0
    return pairs_in(inputs) * ranks / step_pairs


class PreferenceRecipe(StageRecipe):
    """A StageRecipe whose step is TRL's DPO step; see the module docstring."""

    @staticmethod
    def trainer_classes() -> tuple[type, ...]:
        return (dpo_trainer_class(),)

    pairs_prompt_cut = pairs_dropped = 0

    def load_split(self, source: str, split: str):
        dataset = encoded_pairs(source, self.job.data, self.tokenizer)
        lengths = lengths_of(dataset, self.job.data, max_positions(self.model.config))
        kept, cut, dropped = fitted(dataset, lengths.max_length, source)
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
        keep_reference(trainer.model, self.reference)
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
