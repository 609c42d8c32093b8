"""`--tail EXP[/STAGE] [--rank K]`: follow the log of a job's current scheduler job, through pending and
requeues. A multi-GPU job runs one task per GPU, each with its own log; rank 0's is the default."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from submitit.core.utils import JobPaths

from core.files import read_window, warn_unreadable
from core.problems import ConfigError, Problem, did_you_mean
from core.states import State
from slurm.planning.plan import Plan, PlannedJob
from slurm.watching.status import plan_status

POLL_S = float(os.environ.get("LAUNCH_POLL_S", "5"))


def pick_job(plan: Plan, target: str, log_root: str) -> PlannedJob:
    """EXP/STAGE as given; EXP alone means its job that is running now, else the first not done."""
    ids = [j.id for j in plan.jobs]
    # Where it looked: before, "no experiment 'x'" alone, and a user whose runs are in another run root
    # (another folder's cluster.yaml) could not tell why.
    looked = (
        f" in the run root {plan.run_root}/ (with --config-dir FOLDER: that folder's cluster.yaml's run_dir)"
    )
    if "/" in target:
        if target not in ids:
            message = f"no job '{target}'{looked}" + did_you_mean(target, ids)
            raise ConfigError([Problem("command line", "--tail", message)])
        return plan.job(target)
    rows = [r for r in plan_status(plan, log_root) if r.job.experiment == target]
    if not rows:
        experiments = {j.experiment for j in plan.jobs}
        message = f"no experiment '{target}'{looked}" + did_you_mean(target, experiments)
        raise ConfigError([Problem("command line", "--tail", message)])
    active = [r for r in rows if r.state.live] or [r for r in rows if not r.state.finished] or rows[-1:]
    return active[0].job


def follow(plan: Plan, target: str, log_root: str, console: Console, rank: int = 0) -> int:
    job = pick_job(plan, target, log_root)
    if not 0 <= rank < job.tasks:
        ranks = "0" if job.tasks == 1 else f"0-{job.tasks - 1}"
        message = f"job {job.id} runs {job.tasks} task(s): --rank is one of {ranks}"
        raise ConfigError([Problem("command line", "--rank", message)])
    shown: tuple[str, int] = ("", 0)  # (log path, bytes printed)
    while True:
        row = next(r for r in plan_status(plan, log_root) if r.job.id == job.id)
        row = replace(row, log_path=task_log(row.log_path, row.scheduler_id, rank))
        if row.state in (State.PLANNED, State.PENDING) and not Path(row.log_path or "/nonexistent").exists():
            console.print(f"{job.id}: {row.state.value} {row.reason}".rstrip(), highlight=False)
        else:
            shown = print_new(row.log_path, shown)
        if not row.state.live and row.state is not State.PLANNED:
            shown = print_new(row.log_path, shown)
            console.print(f"{job.id}: {row.state.value} {row.reason}".rstrip(), highlight=False)
            return 0 if row.state.finished else 1
        if row.state is State.PLANNED:
            console.print(f"{job.id} has not been submitted.")
            return 1
        time.sleep(POLL_S)


# The most one poll prints: a log that grows faster (or a huge one met first) is caught up over polls.
CHUNK_BYTES = 4 << 20


def print_new(path: str, shown: tuple[str, int]) -> tuple[str, int]:
    """Print what the log gained since last time; a new file (requeue, retry) or a shorter one restarts.
    Read as a regular file only and at most CHUNK_BYTES a poll (a FIFO or a link to /dev/zero is named
    once and not read: it hung --tail, or grew it without bound)."""
    if not path or not Path(path).exists():
        return shown
    offset = shown[1] if shown[0] == path else 0
    try:
        chunk, size = read_window(Path(path), offset, CHUNK_BYTES)
        if size < offset:  # shorter than what was shown: a new log under the same name, from its start
            offset = 0
            chunk, size = read_window(Path(path), offset, CHUNK_BYTES)
    except OSError as exc:
        warn_unreadable(Path(path), exc.strerror or str(exc), "not shown")
        return shown
    if chunk:
        print(chunk.decode("utf-8", "replace"), end="", flush=True)
    return path, offset + len(chunk)


def task_log(rank0_log: str, scheduler_id: str, rank: int) -> str:
    """Task K's log, beside task 0's in the job's log folder (submitit names them <job>_<K>_log.out)."""
    if not rank0_log or rank == 0:
        return rank0_log
    return str(JobPaths(Path(rank0_log).parent, scheduler_id, task_id=rank).stdout)
