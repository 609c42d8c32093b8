"""Trainer callbacks: the run directory's metrics and progress files, checkpoint commits, a clean stop."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import resource
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from transformers import TrainerCallback

from core.config import PruneJob
from core.files import append_json_line, read_json, write_atomic, write_json_atomic
from core.pruning import RungRecord, decided_text, judged, mark_pruned, rung_records
from core.rundir import RunDir
from train import distributed
from train.checkpoints import commit, rotate
from train.gpu_use import JobGpus, summarize_nodes

log = logging.getLogger("train.callbacks")

# What TRL's DPOTrainer logs besides the loss (rewards/chosen, rejected, accuracies, margins; logps/chosen,
# rejected): a preference stage's curves, kept in metrics.jsonl beside the loss.
# What a method's step logs besides the loss, kept in metrics.jsonl: DPO's per-pair rewards and log-probs; GRPO's
# rewards (mean, per reward function, spread, the share of groups without variance), its completions'
# lengths and the share cut at max_completion_length, the KL to its reference, and its step time.
METHOD_METRICS = ("rewards/", "logps/", "reward", "frac_reward_zero_std", "completions/", "kl", "entropy")


class RunDirectoryLog(TrainerCallback):
    """`metrics.jsonl` (one row per log step, eval rows too) and `progress.json` (what --status shows).
    Written by rank 0 only; the loss it logs is already the mean over the ranks (the Trainer gathers it).
    Each row carries the GPU use since the previous row (`job_gpus`: every node's samples; none on a CPU),
    and progress.json the latest."""

    def __init__(self, run_dir: Path, job_gpus: JobGpus | None = None, split: str | None = None):
        self.run_dir = run_dir
        self.split = split  # how the batch is split (core/split.py Split.describe), for --status
        self.job_gpus = job_gpus
        self.gpu_use: dict = {}  # the latest summary: progress.json keeps it between samples
        self.last_time: float | None = None
        self.last_tokens = 0
        self.last_step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.last_time, self.last_tokens, self.last_step = (
            time.time(),
            state.num_input_tokens_seen,
            state.global_step,
        )
        self.started = time.time()
        self.first_step = state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero:
            return
        logs = dict(logs or {})
        now = time.time()
        row = {"step": state.global_step, "epoch": round(state.epoch or 0, 4), "time": round(now, 3)}
        if "loss" in logs:
            elapsed = max(now - self.last_time, 1e-9)
            row |= {k: logs[k] for k in ("loss", "learning_rate", "grad_norm") if k in logs}
            row |= {k: v for k, v in logs.items() if k.startswith(METHOD_METRICS)}  # a DPO or GRPO stage's
            row["tokens_per_s"] = round((state.num_input_tokens_seen - self.last_tokens) / elapsed, 1)
            steps = state.global_step - self.last_step
            row["samples_per_s"] = round(
                steps * args.train_batch_size * args.gradient_accumulation_steps * args.world_size / elapsed,
                2,
            )
            self.last_time, self.last_tokens, self.last_step = (
                now,
                state.num_input_tokens_seen,
                state.global_step,
            )
        row |= {k: v for k, v in logs.items() if k.startswith("eval_")}
        gpu_use = summarize_nodes(self.job_gpus.drain()) if self.job_gpus else {}
        self.gpu_use = gpu_use or self.gpu_use
        if len(row) > 3:
            row |= gpu_use
            append_json_line(RunDir(self.run_dir).metrics, row, root=RunDir(self.run_dir).run_root)
        self.write_progress(state, logs.get("loss"))

    def write_progress(self, state, loss) -> None:
        done = state.global_step - self.first_step
        rate = (time.time() - self.started) / done if done else None
        previous = {}
        if loss is None:
            previous = RunDir(self.run_dir).read_progress()
        write_json_atomic(
            RunDir(self.run_dir).progress,
            {
                "step": state.global_step,
                "total_steps": state.max_steps,
                "epoch": round(state.epoch or 0, 4),
                "last_loss": loss if loss is not None else previous.get("last_loss"),
                "eta_s": round(rate * (state.max_steps - state.global_step), 1) if rate else None,
                "updated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "split": self.split,
                **self.gpu_use,
            },
            root=RunDir(self.run_dir).run_root,
        )


class NonFiniteLoss(FloatingPointError):
    """The training loss became NaN or infinite: every later step is lost, so the job fails here."""


class FailOnNonFiniteLoss(TrainerCallback):
    """Stop a run whose logged training loss, or gradient norm, is not a finite number, failing with the
    step: a diverged run otherwise trains on to its end and is reported as complete (an alpha of 1e30 did:
    every gradient norm inf, clipping then zeroed every update, and nothing was learned). Under fp16 AMP an
    inf gradient norm is the loss scaler's business (it skips that step and lowers its scale): only the
    loss counts there."""

    def __init__(self, fp16: bool):
        self.fp16 = fp16

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        for key in ("loss",) if self.fp16 else ("loss", "grad_norm"):
            value = logs.get(key)
            if isinstance(value, float) and not math.isfinite(value):
                what = "training loss" if key == "loss" else "gradient norm"
                raise NonFiniteLoss(
                    f"the {what} became {value} at step {state.global_step} (epoch {state.epoch or 0:.2f}): "
                    "the run diverged; lower train.learning_rate (or adapter.alpha), or look for a broken "
                    "example"
                )


class CommitCheckpoints(TrainerCallback):
    """Mark each checkpoint complete once the Trainer has written all of it, then drop older ones: the
    newest and the best (for load_best_model_at_end) are kept. With several ranks, rank 0 commits once
    every rank has written its part (each saves its own RNG state), and no rank goes on before the commit:
    a rank that stops here leaves a checkpoint that is whole."""

    def on_save(self, args, state, control, **kwargs):
        distributed.barrier("a checkpoint, written by every rank", distributed.SAVE_WAIT_S)
        if state.is_world_process_zero:
            folder = Path(args.output_dir)
            global_batch = (
                args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
            )
            commit(folder / f"checkpoint-{state.global_step}", args.world_size, global_batch)
            rotate(folder, keep={Path(state.best_model_checkpoint)} if state.best_model_checkpoint else set())
        distributed.barrier("the checkpoint's commit, by rank 0", distributed.SAVE_WAIT_S)


class SaveEvery(TrainerCallback):
    """Save every `steps` steps on top of the saves at eval points (HF has one save_steps; when eval runs
    it must be the eval interval, or the best model would never be saved)."""

    def __init__(self, steps: int):
        self.steps = steps

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.steps == 0:
            control.should_save = True
        return control


class LogTheLastStep(TrainerCallback):
    """A metrics.jsonl row at the last step, whatever `logging_steps`: the Trainer logs the first step and
    every `logging_steps`, so a stage of 8 steps kept only step 1's loss (its loss curve a lone dot,
    `summary.json`'s final_train_loss and --status's loss the first step's). Every rank sets it alike, so
    the loss gather it starts runs on all of them."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:
            control.should_log = True
        return control


class NoCheckpointAtTheEnd(TrainerCallback):
    """No checkpoint at the last step of a run without in-training evals: the Trainer saves one there, and
    the recipe writes the adapter a moment later, so it only cost time (on the CPU bench, most of the gap
    to a plain HF run's non-training share). Were the job killed in between, it resumes from the last
    periodic checkpoint. With evals the end save stays (the best-model bookkeeping counts on it), and so
    does a save for a stop (the stop is not the end)."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:
            control.should_save = False
        return control


class StopWhenAsked(TrainerCallback):
    """When the job is told to stop (time limit, preemption), save at this step's end and stop. The stop is
    collective: SLURM's signal may reach the ranks at different steps, or only one; a rank that left alone
    would hang the others at their next collective. So the ranks agree at every step end (all-reduce MAX of
    the local flag) and all stop at the same step.

    A stop on an in-training eval step saves first: the Trainer evaluates before it saves, and an eval can
    outlast the time the signal leaves before the kill (signal_delay_s less SLURM's 30 s timer), which
    would lose every step since the previous checkpoint. The eval is put off to the epoch end that follows
    the stop (the Trainer's last evaluate-and-save point); when it ends, the checkpoint's trainer state is
    rewritten with it (best metric, log history), so the resumed run picks its best model as an
    uninterrupted one does."""

    def __init__(self, stop: threading.Event):
        self.stop = stop
        self.stopped_early = False
        self.eval_put_off = False
        self.eval_logged: int | None = None  # log_history's length just after the put-off eval

    def on_step_end(self, args, state, control, **kwargs):
        asked = distributed.any_rank(self.stop.is_set())  # on every rank at every step: collectives pair up
        if asked and state.global_step < state.max_steps:
            control.should_save = True
            control.should_training_stop = True
            self.stopped_early = True
            self.eval_put_off, control.should_evaluate = control.should_evaluate, False
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.eval_put_off:
            control.should_evaluate = True
        return control

    def on_evaluate(self, args, state, control, **kwargs):
        if self.eval_put_off:
            self.eval_logged = len(state.log_history)

    def on_train_end(self, args, state, control, **kwargs):
        # After the Trainer weighed the eval against the best so far (which it does after on_evaluate).
        if self.eval_logged is not None and state.is_world_process_zero:
            checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            record_eval(checkpoint, state, self.eval_logged)


def record_eval(checkpoint: Path, state, logged: int) -> None:
    """Rewrite a committed checkpoint's trainer_state.json with an eval that ran after it was saved, as the
    Trainer would have saved it: log history up to that eval, best metric and step, and the checkpoint as
    the best one when the eval is the best so far. Replaced whole: the checkpoint stays valid throughout."""
    saved = copy.copy(state)
    saved.log_history = state.log_history[:logged]
    if state.best_global_step == state.global_step:
        saved.best_model_checkpoint = str(checkpoint)
    text = json.dumps(dataclasses.asdict(saved), indent=2, sort_keys=True) + "\n"
    write_atomic(checkpoint / "trainer_state.json", text, root=RunDir(checkpoint.parent.parent).run_root)


class PruneAtRungs(TrainerCallback):
    """A run of a pruned sweep, at each rung's in-training eval: record its eval_loss, decide (core/pruning.py)
    and stop when it is losing. The stop is collective (rank 0 decides, every rank hears the same answer).
    The Trainer saves after this eval as at every eval point, then loads the best checkpoint: the adapter
    written is the run's best so far. A run requeued after it stopped (its checkpoint at the rung is
    committed) finds its decision recorded and stops at once instead of training on.

    `rung_steps`: the optimizer step of each rung's eval, as the Trainer schedules its evals. `identity`:
    the run's config and its folder's first submission (train/recipe.py pruning): a requeue keeps it, a
    rerun under another config or in a fresh folder decides anew."""

    def __init__(self, run_dir: Path, prune: PruneJob, run: str, identity: str, rung_steps: dict[int, float]):
        self.run_dir, self.prune, self.run, self.identity = run_dir, prune, run, identity
        self.rung_steps = rung_steps
        self.pruned = False

    def on_train_begin(self, args, state, control, **kwargs):
        passed = [rung for step, rung in self.rung_steps.items() if step <= state.global_step]
        if distributed.any_rank(any(self.recorded_stop(rung) for rung in passed)):
            log.info("pruning: this run's stop at a rung it passed is recorded; it stops again")
            control.should_training_stop = self.pruned = True  # after the step under way: the Trainer's rule
        return control

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        rung = self.rung_steps.get(state.global_step)
        if rung is None:
            return control
        stop = False
        if state.is_world_process_zero:
            record = self.judge(rung, float((metrics or {})["eval_loss"]))
            stop = record is not None and record.stop
            if record is not None:
                # The job log says what was decided and from what, go on or stop (before: only a stop
                # showed, in --status, and a run that went on never said it was judged).
                log.info("pruning, %s", decided_text(dataclasses.asdict(record), self.prune.min_points))
            if stop:
                mark_pruned(self.run_dir, record, evaluate=self.prune.eval_pruned)
        if distributed.any_rank(stop):
            control.should_training_stop = self.pruned = True
        return control

    def judge(self, rung: float, loss: float) -> RungRecord | None:
        """The rung's decision; None when the records cannot be kept (a link, a FIFO, a file where a folder
        belongs, all named): the run goes on unjudged, since stopping it on no evidence would lose it."""
        run_root = RunDir(self.run_dir).run_root
        try:
            return judged(run_root, self.prune.sweep, self.run, self.identity, rung, loss, self.prune)
        except OSError as exc:
            log.warning("rung %g not judged, the run goes on: its records cannot be kept (%s)", rung, exc)
            return None

    def recorded_stop(self, rung: float) -> bool:
        records = rung_records(RunDir(self.run_dir).run_root, self.prune.sweep, rung)
        mine = (self.run, self.identity, self.prune.measured_under)
        return any(r.stop for r in records if (r.run, r.config_hash, r.measured_under) == mine)


class RuntimeClock(TrainerCallback):
    """Training time across interruptions: each checkpoint carries the time spent up to it, so a resumed
    stage's summary reports the whole stage, not its last piece."""

    FILE = "runtime.json"

    def __init__(self, resume_from: Path | None):
        self.before_s = 0.0
        if resume_from is not None:
            kept = read_json(resume_from / self.FILE, {}, expected=dict, fields={"train_runtime_s": float})
            self.before_s = kept.get("train_runtime_s", 0.0)
        self.started = time.time()

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.time()

    def total_s(self) -> float:
        return self.before_s + time.time() - self.started

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        write_json_atomic(
            folder / self.FILE,
            {"train_runtime_s": self.total_s()},
            root=RunDir(folder.parent.parent).run_root,
        )


class StageTimer(TrainerCallback):
    """Where a stage's time goes, for the speed book (core/speeds.py): start-up (process start to the end
    of the first optimizer step), each in-training eval, each checkpoint save, and the steps in between.
    A step's time runs from the previous event (step end, log, eval or save) to its own end, so evals and
    saves are never counted as stepping."""

    def __init__(self):
        self.first_step: int | None = None
        self.last_step = 0
        self.startup_s = 0.0
        self.startup_cpu_s: float | None = None  # this process's CPU (user + sys) before its first step
        self.stepping_s = 0.0
        self.eval_s: list[float] = []
        self.save_s: list[float] = []
        self.last_event = time.time()

    def on_step_begin(self, args, state, control, **kwargs):
        if self.startup_cpu_s is None:
            self.startup_cpu_s = process_cpu_s()
            # What every start (and requeue) of a job costs before it trains: imports, loading, tokenizing.
            log.info(
                "first step: %.2f s of CPU (user + sys) spent by this process before it, %.2f s wall",
                self.startup_cpu_s,
                time.time() - process_started_at(),
            )

    def on_step_end(self, args, state, control, **kwargs):
        now = time.time()
        if self.first_step is None:
            self.first_step, self.startup_s = state.global_step, now - process_started_at()
        else:
            self.stepping_s += now - self.last_event
        self.last_step, self.last_event = state.global_step, now

    def on_log(self, args, state, control, **kwargs):
        self.last_event = time.time()

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.eval_s.append((metrics or {}).get("eval_runtime") or time.time() - self.last_event)
        self.last_event = time.time()

    def on_save(self, args, state, control, **kwargs):
        now = time.time()
        self.save_s.append(now - self.last_event)
        self.last_event = now

    @property
    def steps_timed(self) -> int:
        return self.last_step - (self.first_step if self.first_step is not None else self.last_step)


def process_cpu_s() -> float:
    """CPU seconds (user + sys) this process has used so far, all its threads, none of its children."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def process_started_at() -> float:
    """When this process started (Linux: /proc), so start-up counts imports and loading; elsewhere, when
    this module was imported."""
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(line for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime"))
        return int(boot.split()[1]) + int(after_name[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, StopIteration):
        return IMPORTED_AT


IMPORTED_AT = time.time()
