"""Every name of TRL's that this project touches beyond TRL's documented trainer API, in one place.

The DPO and GRPO recipes (train/preference.py, train/grpo.py) override some of TRL's trainer methods, read
some attributes its trainers set in their __init__, and import a few of its helpers. None of these is a
promise of TRL's: each can move in a minor release, and an override whose base method was renamed is never
called again, silently. So TRL is pinned to the minor these were read from (pyproject.toml), and
tests/test_trl_seams.py fails, naming the name, when one is gone: upgrading TRL starts there.
"""

from __future__ import annotations

TESTED_TRL = "1.16"  # the minor every name below was read from (trl 1.16.0)

# Methods of TRL's trainers that our trainer pieces override (each calls the base method, or replaces it
# where said): the base method must exist, or ours is dead code.
OVERRIDDEN = {
    "DPOTrainer": (
        "_prepare_dataset",  # replaced: pairs come tokenized and fitted (train/pairs.py)
        "get_batch_samples",
        "compute_loss",
        "_save_checkpoint",  # replaced by Trainer's: no model card in checkpoints/
    ),
    "GRPOTrainer": (
        "_get_train_sampler",  # replaced: TRL's RepeatSampler, shuffled per (seed, epoch)
        "_generate_and_score_completions",  # the share of groups without reward variance, read after it
        "log",  # completions.jsonl, before TRL's log clears its tables
        "_save_checkpoint",  # replaced by Trainer's: no model card in checkpoints/
    ),
}
# Attributes TRL's trainers set in __init__ that we read or set.
SET_IN_INIT = {
    "DPOTrainer": ("_metrics",),
    "GRPOTrainer": (
        "_metrics",  # frac_reward_zero_std, appended per generation
        "_logs",  # the latest generation's prompts, completions, rewards, advantages
        "eos_token_ids",  # set to the eval's stop ids: TRL's completion mask and clipped ratio
        "generation_config",  # its eos set to the same ids
        "generation_kwargs",
        "num_generations",
        "num_iterations",
        "shuffle_dataset",
    ),
}
# Helpers imported from TRL's modules: (module, name).
IMPORTED = (
    ("trl.trainer.utils", "_ChunkedLogProbFunction"),  # the DPO step's fused LM head, for the memory model
    ("trl.trainer.utils", "_CHUNKED_LOGPROB_CHUNK_SIZE"),
    ("trl.trainer.utils", "RepeatSampler"),  # each prompt num_generations times in a row
    ("trl.models.utils", "unwrap_model_for_generation"),
)
# Arguments of TRL's trainers that are marked experimental.
# Our generation function (train/grpo.py sampled_completions) goes through TRL's rollout_func.
EXPERIMENTAL = {"GRPOTrainer": ("rollout_func",)}


# The name TRL gives its frozen copy of a PeftModel's adapter when a DPO or GRPO trainer is handed one with
# beta > 0 and no reference model (trl 1.16 DPOTrainer and GRPOTrainer __init__); its policy's is "default".
REFERENCE_ADAPTER = "ref"
POLICY_ADAPTER = "default"


def keep_reference(model, reference: str) -> None:
    """The reference of a DPO or GRPO stage as written: `previous`, TRL's frozen copy of the adapter the stage
    started from (it must be there); `base`, that copy deleted, so TRL disables the adapters for the
    reference's forward instead (`use_adapter(model, None)`)."""
    adapters = model.peft_config
    if reference == "base" and REFERENCE_ADAPTER in adapters:
        model.delete_adapter(REFERENCE_ADAPTER)
    if reference == "previous" and REFERENCE_ADAPTER not in adapters:
        raise RuntimeError("TRL kept no frozen copy of the previous adapter; reference: previous cannot run")


def imported(module: str, name: str):
    """A TRL helper listed in IMPORTED, imported (on the node only)."""
    import importlib

    if (module, name) not in IMPORTED:
        raise KeyError(f"{module}.{name} is not listed in train/trl_seams.py IMPORTED")
    return getattr(importlib.import_module(module), name)
