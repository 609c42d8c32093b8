"""The trainer's entry point for a job (slurm/queueing/jobs.py, `python -m train`): the stage's recipe for its
`train.method`, run through the one life cycle (train/recipe.py run_stage). The methods' table is `recipe_of`:
SFT: StageRecipe; DPO: PreferenceRecipe (train/preference.py); GRPO: GrpoRecipe (train/grpo.py). Those two
import TRL, so only their jobs load it."""

from __future__ import annotations

import threading
from typing import Literal

from core.config import TrainJob
from train import recipe


def recipe_of(method: str) -> type[recipe.StageRecipe]:
    """The recipe of a `train.method` (every value the schema allows has one: tests/test_job_imports.py)."""
    if method == "dpo":
        from train.preference import PreferenceRecipe

        return PreferenceRecipe
    if method == "grpo":
        from train.grpo import GrpoRecipe

        return GrpoRecipe
    if method == "sft":
        return recipe.StageRecipe
    raise ValueError(f"train.method {method!r} has no recipe")


def run_stage(
    job: TrainJob, stop: threading.Event | None = None
) -> Literal["completed", "pruned", "interrupted"]:
    return recipe.run_stage(job, stop, recipe_of(job.train.method))
