"""The trainer's entry point for a job (slurm/queueing/jobs.py, `python -m train`): the stage's recipe for its
`train.method`, run through the one life cycle (train/recipe.py run_stage). SFT: StageRecipe; DPO:
PreferenceRecipe (train/preference.py, which imports TRL, so only a DPO job loads it)."""

from __future__ import annotations

import threading
from typing import Literal

from core.config import TrainJob
from train import recipe


def run_stage(
    job: TrainJob, stop: threading.Event | None = None
) -> Literal["completed", "pruned", "interrupted"]:
    if job.train.method == "dpo":
        from train.preference import PreferenceRecipe

        return recipe.run_stage(job, stop, PreferenceRecipe)
    return recipe.run_stage(job, stop)
