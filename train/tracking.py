"""Where a stage's curves go besides metrics.jsonl: TensorBoard (default) and Weights & Biases (opt-in),
through the HF Trainer's own callbacks, made to survive requeues.

- TensorBoard: event files in RUN_DIR/tb/. A curriculum is one step axis per experiment: a stage's steps
  continue from the stage it starts from (`step_offset` in summary.json), so `tensorboard --logdir runs`
  draws each experiment as one curve whose colours change at the stage boundaries. A resumed run purges
  what the interrupted one logged after its checkpoint (the writer's `purge_step`): no step shows twice.
- W&B: one run per stage, its id derived from the stage's spec, so a requeued job resumes the same run
  (`resume="allow"`), grouped by experiment, files in RUN_DIR/wandb/. WANDB_MODE=offline on nodes without
  network; `python launch.py --sync` uploads the offline runs from the login node. The API key stays in
  the environment (core/redact.py masks its value in every output).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from transformers.integrations import TensorBoardCallback, WandbCallback

from core.config import TrainJob
from core.rundir import RunDir

WANDB_PROJECT = "slurm-lora"  # unless WANDB_PROJECT is set


def step_offset(job: TrainJob) -> int:
    """Where this stage's steps start on its experiment's axis: the end of the stage it continues."""
    if not job.init_adapter:
        return 0
    summary = RunDir.of_adapter(job.init_adapter).read_summary()
    return summary.get("step_offset", 0) + summary.get("global_step", 0)


def tracking_callbacks(job: TrainJob, resume_step: int | None) -> list:
    callbacks = []
    if "tensorboard" in job.tracking:
        callbacks.append(
            StageTensorBoard(RunDir(Path(job.run_dir)).tensorboard, step_offset(job), resume_step)
        )
    if "wandb" in job.tracking:
        callbacks.append(stage_wandb(job))
    return callbacks


class StageTensorBoard(TensorBoardCallback):
    """HF's TensorBoard callback on the experiment's step axis, purging what a resumed run replays."""

    def __init__(self, log_dir: Path, offset: int, resume_step: int | None):
        super().__init__()
        self.logging_dir = str(log_dir)
        self.offset = offset
        # Steps after the checkpoint (after the start, when there is none) may have been logged by an
        # interrupted run; they are logged again now. Hide the old ones (`purge_step` and later).
        self.purge_step = offset + (resume_step or 0) + 1

    def _init_summary_writer(self, args):
        writer = self._SummaryWriter(log_dir=self.logging_dir, purge_step=self.purge_step)
        self.tb_writer = OffsetWriter(writer, self.offset)


class OffsetWriter:
    """A SummaryWriter whose steps are shifted onto the experiment's axis."""

    def __init__(self, writer, offset: int):
        self.writer, self.offset = writer, offset

    def add_scalar(self, tag, value, global_step=None, *args, **kwargs):
        self.writer.add_scalar(tag, value, self._shift(global_step), *args, **kwargs)

    def add_text(self, tag, text, global_step=None, *args, **kwargs):
        self.writer.add_text(tag, text, self._shift(global_step), *args, **kwargs)

    def _shift(self, step):
        return None if step is None else step + self.offset

    def __getattr__(self, name):  # flush, close, ...
        return getattr(self.writer, name)


def wandb_run_id(job: TrainJob) -> str:
    """Stable across requeues of this stage, new when its spec changes (a new run, not a continued one)."""
    spec = job.model_dump_json(exclude={"tracking", "run_dir"})
    name = re.sub(r"[^A-Za-z0-9_-]", "_", f"{job.experiment}-{job.stage}")  # W&B's id alphabet
    return f"{name}-{hashlib.sha256(spec.encode()).hexdigest()[:8]}"


def stage_wandb(job: TrainJob) -> WandbCallback:
    """HF's W&B callback; wandb.init reads these variables, so a requeued job finds its run again."""
    folder = RunDir(Path(job.run_dir)).wandb
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_PROJECT", WANDB_PROJECT)
    os.environ.update(
        WANDB_RUN_ID=wandb_run_id(job),
        WANDB_RESUME="allow",
        WANDB_RUN_GROUP=job.experiment,
        WANDB_NAME=f"{job.experiment}/{job.stage}",
        WANDB_DIR=str(Path(job.run_dir).resolve()),  # wandb adds its own wandb/ folder
    )
    return StageWandb()


class StageWandb(WandbCallback):
    """HF's W&B callback, finishing the run when the stage's training ends (completed or stopped), so its
    files are whole before the process exits or the next stage starts."""

    def on_train_end(self, args, state, control, **kwargs):
        super().on_train_end(args, state, control, **kwargs)
        if self._initialized and self._wandb.run is not None:
            self._wandb.finish()
