"""A GRPO stage (`train.method: grpo`): TRL's GRPOTrainer inside the shared trainer's life cycle.

GrpoRecipe is a StageRecipe (train/recipe.py): the same run folder, checkpoints and exact resume, time-limit
stop, tracking, GPU telemetry and summary.json; its trainer comes from the one factory (stage_trainer), so it
has the checked saves and the time-limit guard. What differs:

- the data: the SFT stage's prompts as ids (a conversation's up to its last assistant turn with the
  generation prompt; a `fields` example's prompt as the SFT stage tokenizes it: train/data.py
  prompts_and_targets, chat.ChatPrompt), each with its target as the reference the rewards see. There is
  no in-training eval (a GRPO step has no eval loss): the eval job scores the stage;
- the units: `train.batch_size` x `grad_accum` counts prompts per rank and step, each with
  `num_generations` completions; `micro_batch` counts completions (a divisor of that product x G). The
  global batch is the written one at any world size (at_world_size), so the groups are too;
- generation: `sampled_completions`, one function (a faster engine goes there), handed to TRL as its
  rollout function. Completions stop at the eval's stop ids (the model's eos, and the chat template's end
  of turn for a conversation), so what is rewarded is what the eval job would have generated;
- the rewards (`rewards` in train.grpo): each score reward is the eval's per-example score of the completion
  cleaned as the eval cleans a prediction (eval/rewards.py, eval/generate.py decode); a user's function
  gets that text too. Each reward's time is logged;
- the reference (`beta` > 0): `previous`, TRL's frozen copy of the adapter the stage starts from (its "ref"
  adapter), or `base` (that copy deleted: TRL then disables the adapters); unset: previous after a stage;
- a stage in which no group of the first K steps had reward variance stops with a message (core/grpo.py
  chooses K); a few completions per logging step are kept in completions.jsonl with their rewards.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path

import datasets
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import ExportableState

from core.conversations import templated
from core.files import append_json_line
from core.grpo import zero_variance_steps
from core.rundir import RunDir
from eval.generate import decode, framing_ids
from eval.rewards import ScoreReward, finite_or_none, user_function
from train import chat, distributed
from train.dpo_step import reference_of
from train.grpo_data import as_completions, lengths_of_a_step, prompts_as_trained, tokens_per_epoch
from train.model import trainable_in_fp32
from train.recipe import StageRecipe, one_gpu_per_process, stage_trainer
from train.trl_seams import POLICY_ADAPTER, imported, keep_reference

log = logging.getLogger("train.grpo")
COMPLETIONS_PER_LOG = 4  # completions.jsonl: the first few of the latest generation, per logging step
COMPLETIONS_MAX_BYTES = 4 * 2**20  # and no more than this in all


class NoRewardVariance(RuntimeError):
    """The stage learned nothing: every group's completions earned equal rewards for its first K steps."""


# ---- the trainer ----------------------------------------------------------------------------------
@functools.cache
def grpo_trainer_class():
    from trl import GRPOTrainer  # on the node only: the login node never imports TRL

    RepeatSampler = imported("trl.trainer.utils", "RepeatSampler")

    class EpochSeededRepeatSampler(RepeatSampler):
        """TRL's sampler (each prompt num_generations times in a row), its shuffle drawn from (seed, epoch)
        alone: TRL's draws each epoch from one generator seeded once, so a run resumed in a later epoch
        replayed the first epoch's order (the SFT stage's EpochSeededLengthSampler, train/recipe.py)."""

        def __init__(self, *args, seed: int, **kwargs):
            super().__init__(*args, seed=seed, **kwargs)
            self.epoch = 0

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __iter__(self):
            if self.shuffle:
                self.generator = torch.Generator().manual_seed(self.seed + self.epoch)
            return super().__iter__()

    class GroupRewards:
        """GRPOTrainer's pieces of ours; composed with what every stage's trainer needs by stage_trainer."""

        watch: ZeroVarianceStop | None = None
        completions_file: Path | None = None

        def _get_train_sampler(self, dataset=None):
            dataset = dataset if dataset is not None else self.train_dataset
            self.epoch_sampler = EpochSeededRepeatSampler(
                dataset,
                mini_repeat_count=self.num_generations,
                batch_size=self.args.generation_batch_size // self.num_generations,
                repeat_count=self.num_iterations * self.args.steps_per_generation,
                shuffle=self.shuffle_dataset,
                seed=self.args.seed,
            )
            return self.epoch_sampler

        def _generate_and_score_completions(self, inputs):
            scored = super()._generate_and_score_completions(inputs)
            if self.watch is not None and self.model.training:
                self.watch.saw(self._metrics["train"]["frac_reward_zero_std"][-1])
            return scored

        def log(self, logs, start_time=None):
            training_row = self.model.training and "loss" in logs  # not the run's closing summary row
            if training_row and self.accelerator.is_main_process and self.completions_file:
                keep_completions(self.completions_file, self.state.global_step, self._logs)
            super().log(logs, start_time)

        def _save_checkpoint(self, model, trial):
            Trainer._save_checkpoint(self, model, trial)  # no model card README in checkpoints/

    return stage_trainer("GroupRewardTrainer", GRPOTrainer, GroupRewards)


def keep_completions(path: Path, step: int, logged) -> None:
    """A few of the latest completions with their rewards and advantage, bounded in all (the run folder is
    read by --tail and the report). `logged` is TRL's table of the latest generation (trainer._logs)."""
    if path.exists() and path.stat().st_size > COMPLETIONS_MAX_BYTES:
        return
    prompts, completions = list(logged["prompt"]), list(logged["completion"])
    advantages, rewards = list(logged["advantages"]), {k: list(v) for k, v in logged["rewards"].items()}
    for i in range(min(COMPLETIONS_PER_LOG, len(completions))):
        row = {
            "step": step,
            "prompt": prompts[i] if isinstance(prompts[i], str) else str(prompts[i]),
            "completion": completions[i] if isinstance(completions[i], str) else str(completions[i]),
            "rewards": {name: values[i] for name, values in rewards.items()},
            "advantage": advantages[i],
        }
        append_json_line(path, row, root=RunDir(path.parent).run_root)


class ZeroVarianceStop(TrainerCallback, ExportableState):
    """Ends the stage's training when no group of its first `steps` steps had reward variance; the recipe
    then fails the stage with `stopped_with` (NoRewardVariance), that last step logged. Whether a group
    varied is kept in each checkpoint (the Trainer's stateful callbacks: trainer_state.json), and read back
    when a resumed run begins."""

    def __init__(self, steps: int, varied: bool = False):
        self.steps, self.varied = steps, varied
        self.stopped_with: str | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        saved = state.stateful_callbacks.get(type(self).__name__) if state.stateful_callbacks else None
        if isinstance(saved, dict):
            self.varied = self.varied or bool(saved.get("args", {}).get("varied"))

    def saw(self, share_without_variance: float) -> None:
        if share_without_variance < 1.0:
            self.varied = True

    def on_step_end(self, args, state, control, **kwargs):
        if not self.varied and state.global_step >= self.steps:
            self.stopped_with = (
                f"no completion group had reward variance in {self.steps} steps: start from an SFT stage or "
                "add a partial-credit reward (e.g. sql_record_f1, sql_executes, rouge_l)"
            )
            control.should_training_stop = True

    def state(self) -> dict:
        return {"args": {"steps": self.steps, "varied": self.varied}, "attributes": {}}


# ---- generation -----------------------------------------------------------------------------------
def sampled_completions(trainer, prompt_ids: list[list[int]], stop_ids: list[int]) -> list[list[int]]:
    """One sampled completion per prompt (the prompts come repeated, num_generations times each), as ids
    up to and with the first stop id, at most max_completion_length. The stage's one generation function:
    plain `generate` on this rank's model, with TRL's generation settings (trainer.generation_config)."""
    unwrap_model_for_generation = imported("trl.models.utils", "unwrap_model_for_generation")
    device = trainer.accelerator.device
    pad = trainer.processing_class.pad_token_id
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompt_ids], device=device)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids], device=device)
    with (
        unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            generation_kwargs=trainer.generation_kwargs,
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        ) as model,
        torch.no_grad(),
    ):
        out = model.generate(
            input_ids=input_ids, attention_mask=mask, generation_config=trainer.generation_config
        )
    completions = []
    for row in out[:, width:].tolist():
        end = next((i for i, token in enumerate(row) if token in stop_ids), None)
        completions.append(row if end is None else row[: end + 1])
    return completions


def stop_ids_of(model, tokenizer, data, kind: str) -> list[int]:
    """Where a completion ends, as the eval's generation ends (eval/generate.py stop_at_end_of_turn): the
    model's own eos ids and the tokenizer's, and for a conversation the chat template's end of turn."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    eos = base.generation_config.eos_token_id
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    ids += [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if templated(data, kind):
        ids += chat.end_of_turn_ids(tokenizer)
    return list(dict.fromkeys(ids))


# ---- the recipe -----------------------------------------------------------------------------------
class GrpoRecipe(StageRecipe):
    """A StageRecipe whose step is TRL's GRPO step; see the module docstring."""

    evaluates_in_training = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generations: list[tuple[int, float, int, int]] = []  # rollout's timings, for write_speed

    @staticmethod
    def trainer_classes() -> tuple[type, ...]:
        return (grpo_trainer_class(),)

    def load_split(self, source: str, split: str):
        prompts, references, ids = prompts_as_trained(
            source, self.job.data, self.tokenizer, self.job.model.kind
        )
        self.prompt_ids: dict[str, list[int]] = {}
        for prompt, prompt_ids in zip(prompts, ids, strict=True):
            if self.prompt_ids.setdefault(str(prompt), prompt_ids) != prompt_ids:
                raise ValueError(f"{source}: one prompt text has two tokenizations: {str(prompt)[:80]!r}")
        dataset = datasets.Dataset.from_dict(
            {
                "prompt": [str(p) for p in prompts],
                "reference": list(references),
                "length": list(map(len, ids)),
            }
        )
        log.info("%s prompts: %d; longest %d tokens", split, len(dataset), max(map(len, ids), default=0))
        return dataset, lengths_of_a_step(
            dataset["length"], self.job.train.reward_objective.max_completion_length
        )

    @property
    def split_job(self):
        """The stage in completions (train/grpo_data.py as_completions): `micro_batch: auto` chooses among the
        micro-batches of completions that divide the step's, with the memory model's GRPO step (its
        generation included) on a GPU; on a CPU the written split, batch_size x num_generations per micro-batch."""
        return as_completions(self.job)

    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch: TRL's sampler takes whole steps of prompts and leaves out the rest."""
        return len(self.train_set) // self.prompts_per_step

    @property
    def prompts_per_step(self) -> int:
        train = self.job.train
        return train.batch_size * train.grad_accum * self.placement.world_size

    def training_arguments(self) -> TrainingArguments:
        from trl import GRPOConfig

        if self.steps_per_epoch() < 1:
            raise ValueError(
                f"{self.job.data.train} has {len(self.train_set)} prompts, fewer than one step's "
                f"{self.prompts_per_step} (batch_size x grad_accum x ranks): lower train.batch_size"
            )
        values = self.argument_values()
        grpo, data = self.job.train.reward_objective, self.job.data
        values |= {
            "include_num_input_tokens_seen": "no",  # TRL counts prompt and completion tokens itself
            "per_device_eval_batch_size": grpo.num_generations,
        }
        return one_gpu_per_process(
            GRPOConfig(
                **values,
                gradient_checkpointing=values["activation_checkpointing"],  # TRL's default is True
                steps_per_generation=self.split.grad_accum,  # one generation per optimizer step
                num_generations=grpo.num_generations,
                max_completion_length=grpo.max_completion_length,
                temperature=grpo.temperature,
                beta=grpo.beta,
                loss_type=grpo.loss_type,
                reward_weights=[reward.weight for reward in grpo.rewards],
                shuffle_dataset=data.order != "file",
                disable_dropout=True,  # policy, old policy and reference agree exactly where their weights do
                log_completions=False,  # completions.jsonl instead (keep_completions)
            )
        )

    def make_trainer(self, args: TrainingArguments, callbacks: list[TrainerCallback]) -> Trainer:
        os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func: our generation, pinned TRL
        grpo = self.job.train.reward_objective
        text = chat.text_tokenizer(self.tokenizer)
        self.stop_ids = stop_ids_of(self.model, text, self.job.data, self.job.model.kind)
        self.strip = framing_ids(self.model, text) | set(self.stop_ids)
        # A step's groups: its prompts, every rank's (the global batch at any world size: at_world_size).
        self.watch = ZeroVarianceStop(zero_variance_steps(grpo.num_generations, self.prompts_per_step))
        trainer = grpo_trainer_class()(
            model=self.model,
            reward_funcs=self.reward_functions(),
            args=args,
            train_dataset=self.train_set,
            processing_class=text,
            callbacks=[*callbacks, self.watch],
            rollout_func=self.rollout,
        )
        trainer.watch = self.watch
        trainer.completions_file = RunDir(self.run_dir).completions if distributed.is_main() else None
        # TRL's completion mask and its clipped share (completions/clipped_ratio) stop at these ids too.
        trainer.eos_token_ids = self.stop_ids
        trainer.generation_config.eos_token_id = self.stop_ids
        trainable_in_fp32(trainer.model)  # as a DPO stage: TRL casts a quantized model's trainable weights
        self.reference = None
        if grpo.beta > 0:
            self.reference = reference_of(self.job)
            keep_reference(trainer.model, self.reference)
        log.info(
            "GRPO: %d prompts x %d completions a step; stop ids %s; reference %s; no-variance stop after %d steps",
            self.prompts_per_step,
            grpo.num_generations,
            self.stop_ids,
            self.reference,
            self.watch.steps,
        )
        return trainer

    def step_logs(self) -> list[Path]:
        return [*super().step_logs(), RunDir(self.run_dir).completions]

    def train(self):
        outcome = super().train()
        if self.watch.stopped_with:  # every rank: the share is of the gathered rewards, the same on each
            raise NoRewardVariance(self.watch.stopped_with)
        return outcome

    # ---- generation and rewards -------------------------------------------------------------------
    def rollout(self, prompts: list[str], trainer) -> dict:
        """TRL's rollout function: the prompts' ids (as the SFT stage renders them) and a completion each;
        each generation timed for the speed book (write_speed): (step, seconds, decoding steps, completions)."""
        prompt_ids = [self.prompt_ids[prompt] for prompt in prompts]
        started = time.perf_counter()
        completions = self.completions_for(prompt_ids)
        longest = max(map(len, completions), default=0)  # the batch decodes until its longest ends
        self.generations.append(
            (trainer.state.global_step, time.perf_counter() - started, longest, len(completions))
        )
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}

    def completions_for(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        """The completions of a step (a test's seam: fixed completions in place of sampled ones)."""
        return sampled_completions(self.trainer, prompt_ids, self.stop_ids)

    def cleaned(self, completion_ids: list[list[int]]) -> list[str]:
        """Completions as the eval reads a prediction: the framing and stop ids left out, decoded, stripped."""
        return decode(chat.text_tokenizer(self.tokenizer), completion_ids, self.strip)

    def reward_functions(self) -> list:
        functions = []
        for spec in self.job.train.reward_objective.rewards:
            if spec.score:
                scorer = ScoreReward(spec, spec.db)  # the plan wrote eval.db where the entry has none
                compute = functools.partial(lambda scorer, texts, refs, **_: scorer.each(texts, refs), scorer)
            else:
                function = user_function(spec, self.job.functions_from or ".")
                compute = functools.partial(
                    lambda f, texts, refs, **kw: f(completions=texts, reference=refs, **kw), function
                )
            functions.append(self.timed_reward(spec.name, compute))
        return functions

    def timed_reward(self, name: str, compute):
        def reward(prompts, completions, completion_ids, reference, log_metric=None, **columns):
            started = time.perf_counter()
            texts = self.cleaned(completion_ids)
            values = compute(texts, reference, prompts=prompts, completion_ids=completion_ids, **columns)
            if log_metric is not None:
                log_metric(f"rewards/{name}/seconds", time.perf_counter() - started)
            return [finite_or_none(value) for value in values]

        reward.__name__ = name
        return reward

    # ---- save -----------------------------------------------------------------------------------
    def save_model(self, folder: Path) -> None:
        self.trainer.model.save_pretrained(folder, selected_adapters=[POLICY_ADAPTER])  # not the frozen copy

    def data_summary(self) -> dict:
        """As an SFT stage's, of the sequences a step trains: prompts (examples), each with a completion of at
        most max_completion_length (the target); tokens per epoch at that most (tokens_per_epoch)."""
        grpo = self.job.train.reward_objective
        return {
            "train_examples": len(self.train_set),
            "train_tokens": tokens_per_epoch(
                self.train_set["length"], grpo.num_generations, grpo.max_completion_length
            ),
            "eval_examples": None,
            "max_length": self.lengths.max_length,
            "max_target_length": self.lengths.max_target_length,
            "longest_example": self.lengths.longest,
            "longest_target": self.lengths.longest_target,
            "longest_prompt": max(self.train_set["length"], default=0),
            "truncated_inputs": 0,
            "truncated_targets": 0,
            "truncated_at": {},
            "dropped_too_long": 0,
        }

    def method_summary(self) -> dict:
        grpo = self.job.train.reward_objective
        return {
            "method": "grpo",
            "reference": self.reference,
            "num_generations": grpo.num_generations,
            "prompts_per_step": self.prompts_per_step,
            "zero_variance_steps": self.watch.steps,
            "rewards": [reward.name for reward in grpo.rewards],
        }

    def measured_speed(self) -> dict | None:
        """Its training and its sampling apart: tokens_per_s of the steps' training alone (their time less
        their generations'), and decode_step_s, a generation's seconds per decoding step of its decode_batch
        completions (slurm/planning/estimate.py Estimator.generation). The first step is start-up, as for
        every stage; None when fewer than two steps ran here."""
        timer, state = self.timer, self.trainer.state
        if timer.first_step is None or timer.steps_timed == 0 or not state.global_step:
            return None
        timed = [g for g in self.generations if g[0] >= timer.first_step]
        generation_s, decoding = sum(g[1] for g in timed), sum(g[2] for g in timed)
        training_s = timer.stepping_s - generation_s
        if training_s <= 0 or decoding == 0:
            return None
        per_step = state.num_input_tokens_seen / state.global_step  # TRL counts prompt + completion tokens
        return {
            "tokens_per_s": round(per_step * timer.steps_timed / training_s, 1),
            "tokens_per_example": round(per_step / self.prompts_per_step, 2),
            "decode_step_s": round(generation_s / decoding, 5),
            "decode_batch": timed[-1][3],
        }
