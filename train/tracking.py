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
import itertools
import os
import re
import socket
import time
from pathlib import Path

from transformers.integrations import TensorBoardCallback, WandbCallback

from core import below
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
    run_dir = RunDir(Path(job.run_dir))
    if "tensorboard" in job.tracking:
        callbacks.append(
            StageTensorBoard(run_dir.tensorboard, step_offset(job), resume_step, root=run_dir.run_root)
        )
    if "wandb" in job.tracking:
        callbacks.append(stage_wandb(job))
    return callbacks


class StageTensorBoard(TensorBoardCallback):
    """HF's TensorBoard callback on the experiment's step axis, purging what a resumed run replays, writing
    through EventFile (below `root`: the run root; the folder above `log_dir` when not given)."""

    def __init__(self, log_dir: Path, offset: int, resume_step: int | None, root: Path | None = None):
        super().__init__()
        self.logging_dir = str(log_dir)
        self.root = Path(root) if root is not None else Path(log_dir).parent
        self.offset = offset
        # Steps after the checkpoint (after the start, when there is none) may have been logged by an
        # interrupted run; they are logged again now. Hide the old ones (`purge_step` and later).
        self.purge_step = offset + (resume_step or 0) + 1

    def _init_summary_writer(self, args):
        self.tb_writer = EventFile(self.root, Path(self.logging_dir), self.offset, self.purge_step)


_event_files = itertools.count()  # two writers of one process in one second get two files


class EventFile:
    """A TensorBoard event file written through one descriptor, opened once below the run root without
    following a link (core/below.py open_file), never reopened by path: TensorBoard's own writer reopens
    its file by path at every flush, so a `tb/` link planted while the job trains took the writes out of the
    run root (H3). What HF's callback calls of a SummaryWriter (add_scalar, add_text, flush, close), each
    step shifted onto the experiment's axis by `offset`; `purge_step`: TensorBoard hides what an earlier
    file logged from that step on (a SessionLog START, as SummaryWriter's purge_step writes)."""

    def __init__(self, root: Path, folder: Path, offset: int, purge_step: int | None):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.summary.writer.record_writer import RecordWriter

        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_event_files)}"
        fd = below.open_file(root, folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        self.file = os.fdopen(fd, "wb")
        self.records, self.offset, self.Event = RecordWriter(self.file), offset, Event
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:
            self._write(
                Event(wall_time=time.time(), step=purge_step, session_log=SessionLog(status=SessionLog.START))
            )

    def add_scalar(self, tag, value, global_step=None, *args, **kwargs):
        from torch.utils.tensorboard.summary import scalar

        self._write(self._event(scalar(tag, value), global_step))

    def add_text(self, tag, text, global_step=None, *args, **kwargs):
        from torch.utils.tensorboard.summary import text as text_summary

        self._write(self._event(text_summary(tag, text), global_step))

    def _event(self, summary, step):
        return self.Event(wall_time=time.time(), step=(step or 0) + self.offset, summary=summary)

    def _write(self, event) -> None:
        self.records.write(event.SerializeToString())

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        if not self.file.closed:
            self.file.close()


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
    return StageWandb(RunDir(Path(job.run_dir)).run_root, folder)


class StageWandb(WandbCallback):
    """HF's W&B callback, finishing the run when the stage's training ends (completed or stopped), so its
    files are whole before the process exits or the next stage starts. Its folder is checked for a link
    below the run root (core/below.py) at the start and at each checkpoint: a link there fails the job,
    naming it. W&B's own writer (a separate process) opens its files by path, so a link planted between two
    checks is followed until the next one: that window, a checkpoint interval wide, is W&B's (README)."""

    def __init__(self, root: Path, folder: Path):
        super().__init__()
        self.root, self.folder = root, folder

    def on_train_begin(self, args, state, control, **kwargs):
        below.check(self.root, self.folder)
        super().on_train_begin(args, state, control, **kwargs)

    def on_save(self, args, state, control, **kwargs):
        below.check(self.root, self.folder)
        return super().on_save(args, state, control, **kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        super().on_train_end(args, state, control, **kwargs)
        if self._initialized and self._wandb.run is not None:
            self._wandb.finish()
