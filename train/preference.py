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

from transformers import Trainer, TrainerCallback, TrainingArguments

from train import chat
from train.dpo_step import reference_of
from train.model import max_positions, trainable_in_fp32
from train.pairs import encoded_pairs, fitted, lengths_of
from train.recipe import ReproducibleSampling, StageRecipe, one_gpu_per_process

log = logging.getLogger("train.preference")
REFERENCE_ADAPTER = "ref"  # the name TRL gives its frozen copy of the policy's adapter
POLICY_ADAPTER = "default"


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
