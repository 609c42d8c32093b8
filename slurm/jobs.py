"""What runs on the compute node: thin callables that submitit pickles, one per job kind.

They turn the scheduler's world (signals, requeue, DONE) into plain calls of the trainer and the
evaluator, which never talk to the scheduler themselves.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

from slurm.rundir import mark_done

log = logging.getLogger("slurm.jobs")


class TrainStage:
    """Train one stage. On SLURM's time-limit or preemption signal (USR2), the trainer saves a checkpoint
    at the next step end and returns; then submitit requeues this same call, which resumes from it."""

    def __call__(self, spec: dict, config_hash: str, workdir: str) -> str:
        os.chdir(workdir)
        _configure_logging()
        _use_allocated_cpus()  # before torch is imported
        from train.config import TrainJob
        from train.recipe import run_stage

        job = TrainJob.model_validate(spec)
        stop = threading.Event()
        requeue = _route_signal_to(stop)
        outcome = run_stage(job, stop)
        if outcome == "interrupted" and requeue is not None:
            requeue(signal.SIGUSR2, None)  # submitit: checkpoint() → scontrol requeue → exit
        if outcome == "interrupted":
            raise RuntimeError(f"{job.experiment}/{job.stage} was interrupted and cannot be requeued here")
        mark_done(Path(job.run_dir), config_hash)
        return job.run_dir

    def checkpoint(self, *args, **kwargs):
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


class EvalStage:
    """Generate with a saved adapter and score it; reads only the run directory."""

    def __call__(self, spec: dict, config_hash: str, workdir: str) -> str:
        os.chdir(workdir)
        _configure_logging()
        _use_allocated_cpus()
        from eval.job import run_eval
        from train.config import EvalJob

        job = EvalJob.model_validate(spec)
        run_eval(job)
        mark_done(Path(job.out_dir), config_hash)
        return job.out_dir

    def checkpoint(self, *args, **kwargs):
        # Evaluation is short and restartable from scratch: requeue it as it was.
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


def _route_signal_to(stop: threading.Event):
    """Replace submitit's USR2 handler by one that only asks the trainer to stop; return submitit's."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGUSR2)

    def ask_to_stop(signum, frame):
        log.warning(
            "received %s: checkpointing at the next step, then requeueing", signal.Signals(signum).name
        )
        stop.set()

    signal.signal(signal.SIGUSR2, ask_to_stop)
    return previous if callable(previous) else None


def _use_allocated_cpus() -> None:
    """Math threads = the CPUs SLURM gave this job. More threads than cores (torch defaults to every core
    of the node) makes OpenMP threads of neighbouring jobs spin against each other: 10x slower steps."""
    cpus = os.environ.get("SLURM_CPUS_PER_TASK") or os.environ.get("SLURM_CPUS_ON_NODE")
    if cpus:
        os.environ.setdefault("OMP_NUM_THREADS", cpus)
        os.environ.setdefault("MKL_NUM_THREADS", cpus)


def _configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
