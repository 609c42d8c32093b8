"""One table from the scheduler's raw states to ours."""

from __future__ import annotations

from enum import Enum


class State(str, Enum):
    PLANNED = "PLANNED"  # in the plan, never submitted
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    PRUNED = "PRUNED"  # a pruned sweep's run stopped at a rung (core/pruning.py): ended, not failed
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

    @property
    def ended(self) -> bool:
        return self.finished or self.failed

    @property
    def finished(self) -> bool:
        """Ended as it should: its DONE is written, and what depends on its results may start."""
        return self in (State.COMPLETED, State.PRUNED)


def parent_verdict(kind: str, parent: State | None) -> State | None:
    """What one parent lets a job do, as SLURM decides for the dependency's kind: None (wait: the parent
    has not ended, or is not known), State.PENDING (may start as far as this parent goes), State.BLOCKED
    (`afterok` on a parent that did not finish: it will never run; `afterany` only waits for the end). A
    pruned parent finished: its eval runs on its best checkpoint.
    The one rule of the local backend, a pack's lanes and --status."""
    if parent is None or not parent.ended:
        return None
    return State.PENDING if parent.finished or kind == "afterany" else State.BLOCKED


def jobs_verdict(verdicts: list[State | None]) -> State | None:
    """A job's, from each parent's: blocked by any, else waiting on any, else free to start."""
    if State.BLOCKED in verdicts:
        return State.BLOCKED
    return None if None in verdicts else State.PENDING


# The words a packed unit's lane.json held before lanes wrote State's own (slurm/queueing/lanes.py): still read, so
# a pack queued by an earlier version is shown as it runs.
LANE_STATES: dict[str, State] = {
    "waiting": State.PENDING,
    "interrupted": State.PENDING,  # resumes when the allocation is requeued
    "running": State.RUNNING,
    "done": State.COMPLETED,
    "failed": State.FAILED,
    "blocked": State.BLOCKED,
}


def lane_state(word: object) -> State | None:
    """A packed unit's state as its lane.json says it; None when it says nothing known."""
    if not isinstance(word, str):
        return None
    return LANE_STATES.get(word) or State.__members__.get(word)


# Pending reasons that never resolve by waiting, with what they mean (--status shows them as such).
NEVER_STARTS_MARK = "will never start"  # --status: the reason column of such a job starts with it
NEVER_STARTS = {
    "PartitionTimeLimit": "its time limit is above the partition's MaxTime",
    "QOSMaxGRESPerUser": "it asks more GPUs than the QOS lets a user hold at once",
    "QOSMaxGRESPerJob": "it asks more GPUs than the QOS allows one job",
    "AssocMaxGRESPerJob": "it asks more GPUs than your association allows one job",
    "AssocGrpGRES": "it asks more GPUs than your association's group limit",
    "QOSMaxWallDurationPerJobLimit": "its time limit is above the QOS's MaxWall",
    "AssocMaxWallDurationPerJobLimit": "its time limit is above your association's MaxWall",
    "QOSMaxCpuPerJobLimit": "it asks more CPUs than the QOS allows one job",
    "QOSMaxNodePerJobLimit": "it asks more nodes than the QOS allows one job",
    "PartitionNodeLimit": "it asks more nodes than the partition allows",
}


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
