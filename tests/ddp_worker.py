"""One rank of a data-parallel test run (tests/test_train_ddp.py starts one such process per rank, with
the distributed environment the SLURM wrapper exports).

    python -m tests.ddp_worker JOB.json OUT.json [STOP_AFTER]

Runs the stage exactly as run_stage does, recording which training examples this rank's batches held
(the examples carry their index through a wrapped collator), and writes {"outcome", "seen"} to OUT.json.
STOP_AFTER sets this rank's stop flag after that many step ends, as SLURM's signal reaching only it would.
DDP_WORKER_SLOW_TOKENIZING_S (env) makes rank 1 wait that long before it reads and tokenizes its data;
DDP_WORKER_SLOW_SAVE_S makes rank 0 take that long to write the final adapter. DDP_WORKER_RECIPE=fixed-completions
runs a GRPO stage with the tests' fixed completions (tests/grpo_helpers.py).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

from core.config import TrainJob
from tests.train_helpers import StopAfter
from train import distributed
from train.recipe import StageRecipe


def record_examples(recipe: StageRecipe, seen: list[int]) -> None:
    """Give every training example an `index` column and note the indices each batch holds."""
    trainer = recipe.trainer
    trainer.train_dataset = recipe.train_set.add_column("index", list(range(len(recipe.train_set))))
    inner = trainer.data_collator

    def collate(features):
        seen.extend(f["index"] for f in features if "index" in f)  # eval batches carry none
        return inner([{k: v for k, v in f.items() if k != "index"} for f in features])

    trainer.data_collator = collate


def main(job_path: str, out_path: str, stop_after: str | None = None) -> None:
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=f"rank {rank} %(levelname)s %(name)s: %(message)s")
    job = TrainJob.model_validate(json.loads(Path(job_path).read_text()))
    stop = StopAfter(int(stop_after)) if stop_after else threading.Event()
    slow_s = float(os.environ.get("DDP_WORKER_SLOW_TOKENIZING_S", "0"))
    if slow_s and rank == "1":  # the seam of a rank slow to prepare: a first tokenization on a slow disk
        load_split = StageRecipe.load_split

        def slowly(self, source, split):
            time.sleep(slow_s)
            return load_split(self, source, split)

        StageRecipe.load_split = slowly
    slow_save_s = float(os.environ.get("DDP_WORKER_SLOW_SAVE_S", "0"))
    if slow_save_s and rank == "0":  # the seam of a slow shared disk under the final adapter
        write_adapter = StageRecipe.write_adapter

        def slow_write(self):
            time.sleep(slow_save_s)
            return write_adapter(self)

        StageRecipe.write_adapter = slow_write
    if job.train.method in ("dpo", "grpo"):  # as train/stage.py picks it; its examples are not recorded
        from train.stage import recipe_of

        chosen = recipe_of(job.train.method)
        if os.environ.get("DDP_WORKER_RECIPE") == "fixed-completions":  # the GRPO tests' seam
            from tests.grpo_helpers import FixedCompletions as chosen
        recipe, seen = chosen(job, stop), []
        recipe.setup()
    else:
        recipe, seen = StageRecipe(job, stop), []
        recipe.setup()
        record_examples(recipe, seen)
    outcome = recipe.train()
    if outcome == "completed":
        recipe.save()
    distributed.leave()
    Path(out_path).write_text(json.dumps({"outcome": outcome, "seen": seen}))


if __name__ == "__main__":
    main(*sys.argv[1:])
