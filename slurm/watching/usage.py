"""What every job of a plan held, as the cluster charges it: elapsed time x GPUs held, over every submission
and requeue. For the report (eval/report.py), which asks no scheduler itself.

SLURM jobs: accounting's own figures, one sacct call for all of them (slurm/watching/status.py query_allocations),
each attempt's ElapsedRaw x its AllocTRES gres/gpu. A packed allocation (job.json `pack`) counts whole,
idle lanes included, shared among the units it ran in proportion to their lane time (lane.json), evenly
where none was timed. Local jobs: from the start of the job's process to its last written file (submitit's
result or log) x the GPUs the local backend gave it (the CUDA_VISIBLE_DEVICES its log names), so none on a
machine without GPUs. sacct is asked only about jobs a SLURM backend submitted. A job with no figure here
(never submitted, run by hand, unknown to sacct) is left out: the report counts its Trainer clock instead
and says so.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from submitit.core.utils import JobPaths, pickle_load

from core.devices import visible_devices
from core.files import read_window
from core.job_records import JobRecord, job_records
from core.rundir import LogRoot, log_folder, read_lane
from core.runs import JobUsage, PackUsage, PlanUsage
from slurm.planning.pack import Unit
from slurm.watching.status import Allocation, file_time, query_allocations, submitted_at

VISIBLE_LINE = re.compile(r"CUDA_VISIBLE_DEVICES=(\(not set\)|\S*)")
LOG_HEAD_BYTES = 64 * 1024  # the line is logged before the work starts


def plan_usage(plan, log_root: str) -> PlanUsage:
    """Every job's usage; sacct is called once, and only when some job was submitted to SLURM."""
    records = {job.id: job_records(Path(job.run_dir)) for job in plan.jobs}
    slurm_ids = sorted({r.job_id for rs in records.values() for r in rs if r.on_slurm})
    return usage_of(plan, records, query_allocations(slurm_ids) or {}, log_root)


def usage_of(
    plan, records: dict[str, list[JobRecord]], accounted: dict[str, list[Allocation]], log_root: str
) -> PlanUsage:
    """PlanUsage from job.json `records` (plan id → its submissions) and sacct's `accounted` attempts."""
    packs = {r.job_id for rs in records.values() for r in rs if r.pack}
    pack_usages = {}
    for pack in sorted(packs & set(accounted)):
        # Its units as the allocation was given them; where that file is gone, those of this plan.
        units = pack_units(pack, log_root) or [
            (job.id, Path(job.run_dir)) for job in plan.jobs if pack in (r.job_id for r in records[job.id])
        ]
        pack_usages[pack] = pack_usage(pack, accounted[pack], units)
    # A shared eval's members (slurm/queueing/jobs.py SharedEvalStage) share its allocation evenly: each
    # charged the whole of it counted it once per point (before).
    sharing: dict[str, int] = {}
    for rs in records.values():
        for job_id in {r.job_id for r in rs if r.shared}:
            sharing[job_id] = sharing.get(job_id, 0) + 1
    jobs, unanswered = {}, set()
    for job in plan.jobs:
        parts = []
        for record in records[job.id]:
            job_id = record.job_id
            if record.local:
                part = local_part(job, record, log_root)
            elif job_id not in accounted:
                unanswered.add(job_id)
                part = None
            elif record.pack:
                part = pack_usages[job_id][1].get(job.id, JobUsage(0, 0, 1, 0, ""))
            elif record.shared:
                part = shared_part(slurm_part(accounted[job_id]), job_id, sharing[job_id])
            else:
                part = slurm_part(accounted[job_id])
            if part is None:  # one submission unknown: a sum without it would pass for the whole
                parts = []
                break
            parts.append(part)
        if parts:
            jobs[job.id] = combined(parts)
    packed = tuple(usage for usage, _ in pack_usages.values())
    return PlanUsage(jobs, packed, tuple(sorted(unanswered)))


def slurm_part(attempts: list[Allocation]) -> JobUsage:
    held = sum(a.elapsed_s for a in attempts)
    gpu_hours = sum(a.elapsed_s * a.gpus for a in attempts) / 3600
    return JobUsage(held, gpu_hours, attempts[-1].gpus, len(attempts), "sacct")


def shared_part(whole: JobUsage, job_id: str, members: int) -> JobUsage:
    """One member's even share of a shared eval's allocation (its `members` in the run root's records)."""
    source = f"sacct: 1/{members} of shared eval {job_id}"
    return JobUsage(whole.held_s / members, whole.gpu_hours / members, whole.gpus, whole.attempts, source)


def combined(parts: list[JobUsage]) -> JobUsage:
    return JobUsage(
        held_s=sum(p.held_s for p in parts),
        gpu_hours=sum(p.gpu_hours for p in parts),
        gpus=parts[-1].gpus,
        attempts=sum(p.attempts for p in parts),
        source=", ".join(dict.fromkeys(p.source for p in parts if p.source)),
    )


def pack_usage(
    pack_id: str, attempts: list[Allocation], units: list[tuple[str, Path]]
) -> tuple[PackUsage, dict[str, JobUsage]]:
    """(the allocation, plan id → its unit's share): the allocation's GPU-hours shared by lane time."""
    lane_s = {unit: lane_seconds(run_dir, pack_id) for unit, run_dir in units}
    whole = slurm_part(attempts)
    busy = sum(lane_s.values())
    shares = {u: s / busy for u, s in lane_s.items()} if busy else {u: 1 / len(units) for u in lane_s}
    source = f"sacct: share of pack {pack_id}"
    usages = {  # a unit that never took a lane (blocked) held none
        u: JobUsage(lane_s[u], whole.gpu_hours * share, int(share > 0), int(share > 0), source)
        for u, share in shares.items()
    }
    allocated_lane_s = whole.held_s * whole.gpus
    usage = PackUsage(
        pack_id, whole.gpus, whole.held_s, whole.gpu_hours, busy / allocated_lane_s if busy else None
    )
    return usage, usages


def pack_units(pack_id: str, log_root: str) -> list[tuple[str, Path]] | None:
    """(plan id, run folder) of every unit the allocation was given, from its own submission (units of
    experiments outside the report's plan take their share too); None when that file is gone."""
    try:
        submission = pickle_load(JobPaths(LogRoot.of(log_root).packs, pack_id).submitted_pickle)
        return [(unit.id, Path(unit.run_dir)) for unit in map(Unit.of, submission.args[0])]
    except (OSError, EOFError, ValueError, ImportError, AttributeError, IndexError, KeyError, TypeError):
        return None


def lane_seconds(run_dir: Path, pack_id: str) -> float:
    """How long the unit held its lane in this allocation (lane.json), 0 when it never started there."""
    lane = read_lane(run_dir)
    started = lane.get("started_s")
    if str(lane.get("pack_job")) != pack_id or not isinstance(started, int | float):
        return 0.0
    ended = lane.get("ended_s")
    return max(0.0, (ended if isinstance(ended, int | float) else time.time()) - started)


def local_part(job, record: JobRecord, log_root: str) -> JobUsage | None:
    """A local job's process: from its submission to its last written file, x the GPUs it was given;
    None when its files are gone."""
    paths = JobPaths(log_folder(log_root, job.id), record.job_id, task_id=0)
    started = file_time(paths.submitted_pickle) or submitted_at(record)
    ended = max(filter(None, (file_time(paths.result_pickle), file_time(paths.stdout))), default=None)
    if started is None or ended is None:
        return None
    held = max(0.0, ended - started)
    given = record.gpus  # what the local backend gave it, in job.json
    gpus = len(given) if given is not None else given_gpus(paths.stdout)
    if gpus is None:  # a log from before the local backend named its GPUs: it gave none
        gpus = 0
    return JobUsage(held, held * gpus / 3600, gpus, 1, "local clock")


def given_gpus(log: Path) -> int | None:
    """The GPUs the job's log says it was given (slurm/queueing/jobs.py logs CUDA_VISIBLE_DEVICES at its start)."""
    try:
        head = read_window(log, 0, LOG_HEAD_BYTES)[0].decode("utf-8", "replace")
    except OSError:  # missing, or not a regular file (a FIFO is never opened to wait on)
        return None
    found = VISIBLE_LINE.search(head)
    if found is None or found.group(1) == "(not set)":
        return None
    return len(visible_devices(found.group(1)))
