"""Where every job of a plan stands: one `squeue` call and at most one `sacct` call, whatever their number."""

from __future__ import annotations

import getpass
import re
import time
from dataclasses import dataclass, replace
from datetime import datetime
from enum import Enum
from pathlib import Path

from core.config import ascii_int, what_it_computes
from core.durations import read_duration, slurm_time
from core.files import read_window
from core.job_records import JobRecord, current_job
from core.pruning import decided_text
from core.rundir import (
    PROGRESS_FIELDS,
    UNREADABLE,
    RunDir,
    changed_keys,
    done_hash,
    is_done,
    read_lane,
    read_spec,
)
from core.states import NEVER_STARTS, NEVER_STARTS_MARK, State, from_slurm, lane_state, parent_verdict
from slurm.cluster.client import GPUS, gpu_counts, run_client, tres_counts
from slurm.cluster.limits import never_starts
from slurm.planning.plan import Plan, PlannedJob


@dataclass(frozen=True)
class SchedulerInfo:
    state: State
    reason: str = ""
    elapsed: str = ""
    exit_code: str = ""
    nodes: str = ""  # SLURM's NodeList: the nodes the job holds or held (`n[1-2]`); "" before it starts


@dataclass(frozen=True)
class JobStatus:
    job: PlannedJob
    state: State
    scheduler_id: str = ""
    reason: str = ""
    elapsed: str = ""
    step: int | None = None
    total_steps: int | None = None
    last_loss: float | None = None
    eta_s: float | None = None
    gpu_util_percent: float | None = None  # progress.json: the trainer's latest NVML samples
    gpu_mem_gb: float | None = None
    gpu_mem_total_gb: float | None = None
    split: str | None = None  # progress.json: micro-batch x accumulation the trainer chose (core/split.py)
    log_path: str = ""
    backend: str = ""  # "slurm" or "local": what scheduler_id is (a SLURM job id or a local pid)
    nodes: str = ""  # the SLURM nodes it holds or held (`n[1-2]`); "" pending, and for a local job
    stuck: bool = False  # queued in SLURM but waiting on a dependency that can never be satisfied


def query_slurm(job_ids: list[str]) -> dict[str, SchedulerInfo]:
    """States of the given SLURM job ids: live ones from squeue, ended ones from sacct (if it answers)."""
    if not job_ids:
        return {}
    info = _squeue()
    missing = [j for j in job_ids if j not in info]
    if missing:
        info.update(_sacct(missing))
    return {j: info[j] for j in job_ids if j in info}


# The nodes come last (squeue's %N, sacct's NodeList): a line without them reads as before, nodes "".
SQUEUE_FORMAT = "%i|%T|%r|%M|%N"
SACCT_FIELDS = "JobID,State,Elapsed,ExitCode,Reason,NodeList"
# What sacct keeps as the NodeList of a job that never held a node (pending, cancelled while queued).
NO_NODES = ("None assigned", "(null)", "None")
# What a job held: one line per attempt (-D: every requeue), the job's own line only (-X: no steps).
SACCT_USAGE_FIELDS = "JobID,State,ElapsedRaw,AllocTRES"


@dataclass(frozen=True)
class Allocation:
    """One attempt of a SLURM job as accounting keeps it: how long it held how many GPUs."""

    state: State
    elapsed_s: int
    gpus: int


def _squeue() -> dict[str, SchedulerInfo]:
    # -r: one line per array task, pending ones too (else `123_[0-11%4]` on one line)
    return parse_squeue(
        run_client(["squeue", "-h", "-r", "-u", getpass.getuser(), "-o", SQUEUE_FORMAT]) or ""
    )


def _sacct(job_ids: list[str]) -> dict[str, SchedulerInfo]:
    return parse_sacct(
        run_client(["sacct", "-n", "-P", "-X", "-j", ",".join(job_ids), "-o", SACCT_FIELDS]) or ""
    )


def query_allocations(job_ids: list[str]) -> dict[str, list[Allocation]] | None:
    """Every attempt of the given SLURM jobs, in one sacct call; None when sacct does not answer (no
    accounting on this cluster, no sacct here)."""
    if not job_ids:
        return {}
    text = run_client(["sacct", "-n", "-P", "-D", "-X", "-j", ",".join(job_ids), "-o", SACCT_USAGE_FIELDS])
    return None if text is None else parse_sacct_allocations(text)


def parse_sacct_allocations(text: str) -> dict[str, list[Allocation]]:
    """`sacct -n -P -D -X -o SACCT_USAGE_FIELDS` output → job id → its attempts, oldest first. Step lines
    (`123.batch`, when -X is not honoured) and lines without a readable elapsed time are skipped; a job
    that never started has elapsed 0 and no AllocTRES."""
    found: dict[str, list[Allocation]] = {}
    for job_id, state, elapsed, tres in _rows(text, 4):
        seconds = elapsed_seconds(elapsed)
        if "." in job_id or seconds is None:
            continue
        found.setdefault(job_id, []).append(Allocation(from_slurm(state), seconds, tres_gpus(tres)))
    return found


def elapsed_seconds(raw: str) -> int | None:
    """ElapsedRaw is seconds; a site whose sacct prints it as [D-]HH:MM:SS is read too."""
    value = ascii_int(raw)
    return value if value is not None else read_duration(raw)


def tres_gpus(tres: str) -> int:
    """GPUs a job held, from its AllocTRES: `gres/gpu=2`. The untyped count is the total (a cluster that
    accounts types lists it beside `gres/gpu:a100=2`); where only typed counts are kept, the job held
    their sum: GPUs of two types are two sets of GPUs, all of them charged. (A limit of several GPU
    entries binds at its smallest instead: slurm/cluster/limits.py gpus_of.)"""
    gpus = gpu_counts(tres_counts(tres))
    return gpus[GPUS] if GPUS in gpus else sum(gpus.values())


def parse_squeue(text: str) -> dict[str, SchedulerInfo]:
    """`squeue -h -o SQUEUE_FORMAT` output → job id → state, reason, elapsed, nodes (empty while pending).
    Array tasks keep their `ID_TASK`."""
    info = {}
    for job_id, state, reason, elapsed, nodes in _rows(text, 5):
        info[job_id] = SchedulerInfo(from_slurm(state), _reason(reason), elapsed, nodes=_nodes(nodes))
    return info


def parse_sacct(text: str) -> dict[str, SchedulerInfo]:
    """`sacct -n -P -X -o SACCT_FIELDS` output → job id → state, reason, elapsed, exit code, nodes."""
    info = {}
    for job_id, state, elapsed, exit_code, reason, nodes in _rows(text, 6):
        # A requeued job can be listed once per attempt (as `sacct --duplicates` does), oldest first:
        # the last line is the current one.
        ended = from_slurm(state)
        ran = ended in (State.COMPLETED, State.FAILED, State.TIMEOUT)  # a cancel may come while it waits
        why = "" if ran and _reason(reason) in WAITING_REASONS else _reason(reason)
        info[job_id] = SchedulerInfo(ended, why, elapsed, exit_code, _nodes(nodes))
    return info


# Why SLURM kept a job waiting: sacct keeps the last one on a job that has since run and ended, where it
# says nothing of the end (L4: `FAILED (slurm job 9) Dependency; rank 1 on n2: Killed`). A job cancelled
# while it waited keeps it: that is why it never ran.
WAITING_REASONS = {"Dependency", "Priority", "Resources", "BeginTime", "JobHeldUser", "JobHeldAdmin"}


def _rows(text: str, width: int) -> list[list[str]]:
    """`|`-separated lines, each padded or cut to `width` fields; lines without a job id are skipped."""
    rows = [
        ([field.strip() for field in line.split("|")] + [""] * width)[:width] for line in text.splitlines()
    ]
    return [row for row in rows if row[0]]


def _nodes(raw: str) -> str:
    """A NodeList as SLURM writes it (`n[1-2]`, `vm`); `` for sacct's `None assigned` (never started)."""
    return "" if raw in NO_NODES else raw


def _reason(raw: str) -> str:
    """`(DependencyNeverSatisfied)` (squeue's %R style) → `DependencyNeverSatisfied`; `None`/`(null)` → ``."""
    reason = raw.strip().removeprefix("(").removesuffix(")")
    return "" if reason in ("None", "null") else reason


def plan_status(plan: Plan, log_root: str) -> list[JobStatus]:
    records = {job.id: current_job(Path(job.run_dir)) for job in plan.jobs}
    slurm_ids = [r.job_id for r in records.values() if r and r.on_slurm]
    scheduler = query_slurm(slurm_ids)
    statuses: dict[str, JobStatus] = {}
    for job in plan.jobs:
        statuses[job.id] = job_status(job, records[job.id], scheduler, statuses, log_root)
    return list(statuses.values())


class Done(Enum):
    """What a run folder's DONE says of a planned job (core/rundir.py)."""

    UNREADABLE = "cannot be read"
    THIS = "this config"
    OTHER = "another config"  # finished, with a config since edited (or another folder's --force)
    NONE = "none"


class Row(Enum):
    """A row of job_status's table: which answer --status gives."""

    UNREADABLE = "UNKNOWN: DONE cannot be read"
    FINISHED = "COMPLETED (or PRUNED), with the scheduler's elapsed time and nodes"
    ANOTHER_CONFIG = "COMPLETED with another config (changed: ...)"
    PLANNED = "PLANNED, or BLOCKED by a parent that will never finish"
    SCHEDULED = "the scheduler's answer, BLOCKED where a failed parent keeps it"


def status_row(done: Done, queued: bool, live: bool) -> Row:
    """--status's table over what DONE says, whether a job was queued for it (a record in its run folder),
    and whether the scheduler still has it (`live`: pending or running); the first row that matches:

        DONE            queued   live    the job is
        cannot be read  -        -       UNREADABLE
        this config     -        -       FINISHED
        another config  -        no      ANOTHER_CONFIG (before, an edited job's old run read FAILED)
        none / another  no       -       PLANNED
        none / another  yes      -       SCHEDULED

    The one rule of job_status, as parent_verdict is the dependencies'."""
    if done is Done.UNREADABLE:
        return Row.UNREADABLE
    if done is Done.THIS:
        return Row.FINISHED
    if done is Done.OTHER and not live:
        return Row.ANOTHER_CONFIG
    return Row.SCHEDULED if queued else Row.PLANNED


def read_done(run_dir: Path, job) -> Done:
    done = done_hash(run_dir)
    if done == UNREADABLE:
        return Done.UNREADABLE
    if is_done(run_dir, job.config_hash, job.kind):
        return Done.THIS
    return Done.OTHER if done and done != job.config_hash else Done.NONE


@dataclass(frozen=True)
class Seen:
    """What job_status reads of one job before it decides: its record, its submitit job, its progress."""

    job: PlannedJob
    record: JobRecord | None
    submitted: object | None  # submitit's Job, for the log's path and a local job's controller
    progress: dict  # PROGRESS_FIELDS as progress.json has them
    failed_parent: JobStatus | None  # the first parent whose end blocks this job (parent_verdict)

    @property
    def common(self) -> dict:
        """The fields every queued job's row carries."""
        return {
            "scheduler_id": self.record.job_id if self.record else "",
            "log_path": str(self.submitted.paths.stdout) if self.submitted else "",
            "backend": self.record.backend if self.record else "",
            **self.progress,
        }


def job_status(
    job, record: JobRecord | None, scheduler, earlier: dict[str, JobStatus], log_root: str
) -> JobStatus:
    run_dir = Path(job.run_dir)
    progress = RunDir(run_dir).read_progress()
    seen = Seen(
        job,
        record,
        _submitit_job(log_root, job.id, record, run_dir) if record else None,
        {key: progress.get(key) for key in PROGRESS_FIELDS},
        blocking_parent(job, earlier),
    )
    done = read_done(run_dir, job)
    answer = None
    if record is not None and done in (Done.NONE, Done.OTHER):
        answer = scheduler_answer(seen, scheduler)
    row = status_row(done, record is not None, answer is not None and answer.state.live)
    if row is Row.UNREADABLE:
        return JobStatus(job, State.UNKNOWN, reason=f"{RunDir(run_dir).done} cannot be read", **seen.common)
    if row is Row.FINISHED:
        return finished_status(seen, scheduler)
    if row is Row.ANOTHER_CONFIG:
        ended = answer or SchedulerInfo(State.COMPLETED)
        common = seen.common if record else seen.progress
        return JobStatus(
            job,
            State.COMPLETED,
            reason=another_config(job, run_dir),
            elapsed=ended.elapsed,
            nodes=ended.nodes,
            **common,
        )
    if row is Row.PLANNED:
        if seen.failed_parent:
            parent = seen.failed_parent
            return JobStatus(job, State.BLOCKED, reason=f"parent {parent.job.id} {parent.state.value}")
        return JobStatus(job, State.PLANNED, **seen.progress)
    return scheduled_status(seen, answer)


def blocking_parent(job, earlier: dict[str, JobStatus]) -> JobStatus | None:
    """The first parent whose end means this job will never run (parent_verdict); None when none does."""
    for parent in job.depends_on:
        known = earlier.get(parent.job_id)  # a parent left out of the plan (Plan.only) counts as met
        if known is not None and parent_verdict(parent.kind, known.state) is State.BLOCKED:
            return known
    return None


def finished_status(seen: Seen, scheduler: dict[str, SchedulerInfo]) -> JobStatus:
    """A job whose DONE is this config's: COMPLETED, or PRUNED where its sweep stopped it, with the time
    and nodes its scheduler kept (a local job's own clock)."""
    job, record = seen.job, seen.record
    pruned = RunDir(Path(job.run_dir)).read_pruned() if job.kind == "train" else {}
    ended = SchedulerInfo(State.COMPLETED)
    if record and record.backend == "local" and seen.submitted is not None:
        ended = SchedulerInfo(State.COMPLETED, elapsed=local_elapsed(seen.submitted, record, running=False))
    elif record:
        ended = scheduler.get(record.job_id, ended)
    state = State.PRUNED if pruned else State.COMPLETED
    common = seen.common
    return JobStatus(
        job, state, reason=pruned_reason(pruned), elapsed=ended.elapsed, nodes=ended.nodes, **common
    )


def scheduler_answer(seen: Seen, scheduler: dict[str, SchedulerInfo]) -> SchedulerInfo:
    """What the scheduler says of a queued job not DONE: a local job's controller, squeue or sacct, a
    packed unit's lane within its allocation, a member of a shared eval; a failure's reason completed from
    its log, a pending reason that never resolves marked; no nodes while it waits (a requeued job's last
    nodes are not its next)."""
    job, record = seen.job, seen.record
    if record.backend == "local":
        info = local_info(seen.submitted, record, job)
    else:
        info = scheduler.get(record.job_id, unknown_to_slurm(record))
        if record.pack:
            info = packed_unit_info(Path(job.run_dir), record.job_id, info)
        if record.shared:
            info = shared_eval_info(info, record.job_id, seen.failed_parent)
    reason = info.reason
    if info.state is State.FAILED and seen.submitted is not None:
        tail = read_tail(str(seen.submitted.paths.stdout))
        ranks = first_failed_rank(tail) if job.tasks > 1 else ""
        reason = "; ".join(part for part in (reason, stage_stop(tail), ranks) if part)
    if info.state is State.PENDING and reason in NEVER_STARTS and never_starts(reason, job.resources):
        reason = f"{NEVER_STARTS_MARK}: {reason}"  # what it means: a line under the table (render.py)
    nodes = "" if info.state is State.PENDING else info.nodes
    return replace(info, reason=reason, nodes=nodes)


def scheduled_status(seen: Seen, info: SchedulerInfo) -> JobStatus:
    """A queued job not DONE, as its scheduler answers; BLOCKED where it waits on a dependency SLURM will
    never satisfy, or ended CANCELLED or UNKNOWN after a parent failed (SLURM's kill of an orphan)."""
    state, reason = info.state, info.reason
    stuck = state.live and "DependencyNeverSatisfied" in reason
    parent = seen.failed_parent
    if stuck or (parent and state in (State.CANCELLED, State.UNKNOWN)):
        state = State.BLOCKED
        reason = f"parent {parent.job.id} {parent.state.value}" if parent else "a parent failed"
    return JobStatus(
        seen.job, state, reason=reason, elapsed=info.elapsed, stuck=stuck, nodes=info.nodes, **seen.common
    )


def unknown_to_slurm(record: JobRecord) -> SchedulerInfo:
    """A SLURM job neither squeue nor sacct knows: CANCELLED if it is an array task --cancel noted (one
    cancelled before it started never gets an accounting record), else UNKNOWN."""
    if record.array and record.cancelled_at:
        return SchedulerInfo(State.CANCELLED, f"cancelled at {record.cancelled_at.replace('T', ' ')}")
    return SchedulerInfo(State.UNKNOWN, "not known to squeue or sacct")


def shared_eval_info(info: SchedulerInfo, shared_id: str, failed_parent: JobStatus | None) -> SchedulerInfo:
    """An eval not DONE whose record is a shared eval's (slurm/queueing/jobs.py SharedEvalStage), as its
    own state: waiting or scoring in it while it runs; once it ended, not scored because its training did
    not end well (BLOCKED), or FAILED with the shared job (before: COMPLETED, a row without scores)."""
    if info.state.live:
        return replace(info, reason=info.reason or f"in shared eval {shared_id}, one adapter at a time")
    if failed_parent is not None:
        why = f"not scored: its training {failed_parent.job.id} {failed_parent.state.value}"
        return replace(info, state=State.BLOCKED, reason=why)
    if info.state is State.COMPLETED:
        return replace(info, state=State.FAILED, reason=f"shared eval {shared_id} ended without scoring it")
    return info


# srun's own line, in task 0's log (sbatch's output goes there), for each task of a step that ended badly.
SRUN_TASK_ERROR = re.compile(r"^srun: error: (\S+): tasks? ([\d,-]+): (.+)$", re.MULTILINE)


# A stage that ends itself with a reason a user must act on (train/grpo.py NoRewardVariance), as its log's
# last traceback says it; SLURM's own reason for such a job is only its exit code.
STAGE_STOP = re.compile(r"^(?:train\.grpo\.)?NoRewardVariance: (.+)$", re.MULTILINE)


def stage_stop(log: str) -> str:
    """The reason a stage stopped itself, from the last attempt of its log; "" when it did not."""
    found = STAGE_STOP.findall(log.rsplit("Starting with JobEnvironment", 1)[-1])
    return found[-1].strip() if found else ""


def first_failed_rank(log: str) -> str:
    """`rank 1 on n2: Killed`: the first task of the job's last attempt that srun saw end badly (with
    --kill-on-bad-exit srun then ends the others, which it lists after it); "" when srun named none."""
    last_attempt = log.rsplit("Starting with JobEnvironment", 1)[-1]
    found = SRUN_TASK_ERROR.search(last_attempt)
    if not found:
        return ""
    node, tasks, what = found.groups()
    return f"rank {tasks} on {node}: {what.strip()} (srun then stopped the other ranks)"


def read_tail(path: str, size: int = 64_000) -> str:
    """The last `size` bytes of a job's log, bounded and never waiting on a FIFO (core/files.py read_window)."""
    try:
        return read_window(Path(path), None, size)[0].decode(errors="replace")
    except OSError:
        return ""


def pruned_reason(pruned: dict) -> str:
    """Where a pruned run stopped and why: `at rung 1: eval_loss 3.21 > cutoff 1.15 of 4 runs`."""
    return "at " + decided_text(pruned).removesuffix(": stop") if pruned else ""


def another_config(job, run_dir: Path) -> str:
    """`with another config (changed: train.epochs)`, as the relaunch words it: before, --status called
    such a job FAILED and suggested --retry-failed (after an edit, or another folder's --force)."""
    return f"with another config (changed: {', '.join(named_changes(job, config_changes(job) or []))})"


def config_changes(job) -> list[str] | None:
    """The dotted keys of what the job computes that differ between its run folder's config.yaml and the
    plan; None when that file is missing or unreadable (named in a warning)."""
    old = read_spec(Path(job.run_dir))
    if old is None:
        return None
    return changed_keys(what_it_computes(old), what_it_computes(job.spec.model_dump()))


def named_changes(job, keys: list[str]) -> list[str]:
    """`keys`, or when none differ, what else changes a job's identity: a stage it starts from, or the
    number of ranks. The relaunch's refusal and --status say it alike."""
    parents = any(d.kind == "afterok" for d in job.depends_on)
    return keys or ["(a stage it starts from)" if parents else "resources.gpus (the number of ranks)"]


def packed_unit_info(run_dir: Path, pack_id: str, pack: SchedulerInfo) -> SchedulerInfo:
    """A unit of a packed allocation: what its lane wrote (lane.json), within the allocation's state; the
    allocation's nodes once a lane of it took the unit (before, it holds none of its own)."""
    lane = read_lane(run_dir)
    if str(lane.get("pack_job")) != pack_id:
        lane = {}  # written by an earlier allocation
    where, held = f"packed job {pack_id}", ""
    if lane.get("lane") is not None:
        where, held = f"lane {lane['lane']} (GPU {lane.get('gpu')}) of {where}", pack.nodes
    said = lane_state(lane.get("state"))  # None: the lane wrote nothing (yet), or a word unknown
    if said is State.FAILED:
        return SchedulerInfo(State.FAILED, f"{lane.get('reason', '')} ({where})", nodes=held)
    if said is State.BLOCKED:
        return SchedulerInfo(State.BLOCKED, lane.get("reason", "a parent failed"))
    if pack.state is State.RUNNING:
        if said is State.RUNNING:
            return SchedulerInfo(State.RUNNING, where, nodes=held)
        return SchedulerInfo(State.PENDING, f"waiting for a lane of packed job {pack_id}")
    if pack.state.live:
        return SchedulerInfo(State.PENDING, f"{pack.reason or 'queued'} ({where})")
    if pack.state is State.COMPLETED:
        return SchedulerInfo(State.FAILED, f"{where} ended without running it")
    reason = f"{pack.reason or pack.state.value} ({where})"
    return SchedulerInfo(pack.state, reason, exit_code=pack.exit_code, nodes=held)


def _submitit_job(log_root: str, plan_id: str, record: JobRecord, run_dir: Path):
    from slurm.cluster.scheduler import (
        scheduler_job,  # submitit: only once a job was submitted (not for dry runs)
    )

    return scheduler_job(log_root, plan_id, record, run_dir)


def local_info(submitted, record: JobRecord, job: PlannedJob) -> SchedulerInfo:
    """A local job runs while its submitit controller does, or while a task of it holds its run folder
    with the controller gone (killed); once ended without DONE, why: cancelled, its time limit reached, or
    failed. Its elapsed time is its own clock's (local_elapsed): no scheduler keeps one."""
    from slurm.cluster.scheduler import controller_alive, local_failure, orphaned_task, reached_time_limit

    if controller_alive(submitted):
        return SchedulerInfo(State.RUNNING, elapsed=local_elapsed(submitted, record, running=True))
    if (orphan := orphaned_task(submitted)) is not None:
        return SchedulerInfo(
            State.RUNNING,
            f"controller {record.job_id} gone; its task pid {orphan} still holds the folder",
            elapsed=local_elapsed(submitted, record, running=True),
        )
    elapsed = local_elapsed(submitted, record, running=False)
    if record.cancelled_at:
        return SchedulerInfo(State.CANCELLED, f"cancelled at {record.cancelled_at}", elapsed)
    if reached_time_limit(submitted):
        return SchedulerInfo(State.TIMEOUT, timed_out_text(job), elapsed)
    return SchedulerInfo(State.FAILED, local_failure(submitted), elapsed)


def timed_out_text(job: PlannedJob) -> str:
    """Why a job ended at its limit, which limit, where it came from, and that its work is kept."""
    kept = "checkpoints" if job.kind == "train" else "predictions (one per example)"
    return (
        f"reached its time limit ({job.limit_origin}); its {kept} are kept: the same launch (or "
        "--retry-failed) goes on from them; a longer limit: set it in the experiment"
    )


def local_elapsed(submitted, record: JobRecord, running: bool) -> str:
    """A local job's elapsed time as squeue writes a SLURM job's (`01:02:03`): from its submission (its
    submitted pickle, else job.json's submitted_at) to now while it runs, else to the last file it wrote
    (its result, its log); "" when its files are gone. Before: blank for every local job."""
    paths = submitted.paths
    started = file_time(paths.submitted_pickle) or submitted_at(record)
    ended = (
        time.time()
        if running
        else max(filter(None, (file_time(paths.result_pickle), file_time(paths.stdout))), default=None)
    )
    return slurm_time(max(0, round(ended - started))) if started and ended else ""


def file_time(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def submitted_at(record: JobRecord) -> float | None:
    try:
        return datetime.strptime(record.submitted_at, "%Y-%m-%dT%H:%M:%S").timestamp()
    except (TypeError, ValueError):
        return None
