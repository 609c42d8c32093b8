"""One table from the scheduler's raw states to ours."""

from __future__ import annotations

from enum import Enum


class State(str, Enum):
    PLANNED = "PLANNED"  # in the plan, never submitted
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    CANCELLED = "CANCELLED"
    BLOCKED = "BLOCKED"  # a parent failed: this job will never run
    UNKNOWN = "UNKNOWN"  # submitted, but the scheduler no longer knows it and no DONE was written

    @property
    def live(self) -> bool:
        return self in (State.PENDING, State.RUNNING)

    @property
    def failed(self) -> bool:
        return self in (State.FAILED, State.TIMEOUT, State.CANCELLED, State.BLOCKED)


SLURM_STATES: dict[str, State] = {
    "PENDING": State.PENDING,
    "CONFIGURING": State.PENDING,
    "REQUEUED": State.PENDING,
    "REQUEUE_FED": State.PENDING,
    "REQUEUE_HOLD": State.PENDING,
    "RESV_DEL_HOLD": State.PENDING,
    "SUSPENDED": State.PENDING,
    "RUNNING": State.RUNNING,
    "COMPLETING": State.RUNNING,
    "SIGNALING": State.RUNNING,
    "STAGE_OUT": State.RUNNING,
    "RESIZING": State.RUNNING,
    "STOPPED": State.RUNNING,
    "PREEMPTED": State.PENDING,  # with requeue it comes back; without, sacct then shows it ended
    "COMPLETED": State.COMPLETED,
    "FAILED": State.FAILED,
    "NODE_FAIL": State.FAILED,
    "BOOT_FAIL": State.FAILED,
    "OUT_OF_MEMORY": State.FAILED,
    "DEADLINE": State.TIMEOUT,
    "TIMEOUT": State.TIMEOUT,
    "CANCELLED": State.CANCELLED,
    "REVOKED": State.CANCELLED,
    "SPECIAL_EXIT": State.FAILED,
}


def from_slurm(raw: str) -> State:
    """`CANCELLED by 0` and `PENDING+` style suffixes reduce to their first word."""
    word = raw.strip().split(" ")[0].rstrip("+").upper()
    return SLURM_STATES.get(word, State.UNKNOWN)
