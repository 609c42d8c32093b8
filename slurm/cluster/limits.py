"""What the cluster lets this user do, read once per launch, and the jobs of a plan that could never run.

Some limits make sbatch refuse a job (a user's MaxSubmitJobs: a plan is then refused halfway through
submitting); others let it in and leave it pending forever (more GPUs than the QOS allows a user,
`QOSMaxGRESPerUser`; a time limit above the partition's MaxTime, `PartitionTimeLimit`, under SLURM's
default EnforcePartLimits=NO), and `sbatch --test-only` passes both. So the limits themselves are read
(sacctmgr: the user's association and QOS; scontrol: partitions and nodes), torch-free, and every job is
checked against them before anything is queued. Where they cannot be read, the launch says so and goes on.
"""

from __future__ import annotations

import getpass
import re
from dataclasses import dataclass, field
from functools import cache

from core.config import ascii_int
from core.durations import read_duration, slurm_time
from core.problems import Problem
from slurm.cluster.client import gpu_counts, run_client, tres_counts


@dataclass(frozen=True)
class Cap:
    """One limit and where it comes from, for the message: `QOS limited MaxTRESPerUser gres/gpu=2`."""

    value: int
    source: str
    reason: str  # the pending reason SLURM would give (or the refusal)


@dataclass(frozen=True)
class ClusterLimits:
    qos: str
    gpus_per_user: Cap | None = None
    gpus_per_job: Cap | None = None
    max_submit: Cap | None = None
    max_wall_s: Cap | None = None
    queued: int = 0  # this user's jobs in the queue under that QOS now
    partition_time_s: dict[str, Cap] = field(default_factory=dict)  # partition → MaxTime
    partition_nodes: dict[str, Cap] = field(default_factory=dict)  # partition → TotalNodes
    default_partition: str | None = None
    # SLURM's MaxArraySize: an array task's index is below it (slurm/planning/arrays.py splits larger ones)
    max_array_size: int = 1001


# What read_limits asks sacctmgr for, in this order (parse_limits reads the columns by position).
ASSOC_FIELDS = "Partition,MaxSubmit,MaxJobs,GrpTRES,MaxTRES,MaxWall,DefaultQOS"
QOS_FIELDS = "Name,MaxSubmitPU,MaxTRESPU,MaxTRES,MaxWall"


def read_limits(account: str | None, qos: str | None) -> tuple[ClusterLimits | None, str]:
    """The limits that bind this user (their association under `account`, or their default one; `qos`,
    or the association's default QOS) and every partition's MaxTime; (None, why) when sacctmgr or
    scontrol do not answer (no accounting, another cluster's client)."""
    user = getpass.getuser()
    sacctmgr = ["sacctmgr", "-n", "-P", "show"]
    account = account or first_line(run_client([*sacctmgr, "user", user, "format=DefaultAccount"]))
    which = [f"user={user}", *([f"account={account}"] if account else [])]
    assoc_text = run_client([*sacctmgr, "assoc", "where", *which, f"format={ASSOC_FIELDS}"])
    partitions = run_client(["scontrol", "show", "partition", "-o"])
    if assoc_text is None or partitions is None:
        return None, "sacctmgr or scontrol did not answer"
    qos = qos or default_qos(assoc_text)
    qos_text = run_client([*sacctmgr, "qos", qos, f"format={QOS_FIELDS}"]) or ""
    # -r: a pending array is one line per task, each a job for MaxSubmitJobs
    queued = run_client(["squeue", "-h", "-r", "-u", user, "-q", qos, "-o", "%i"]) or ""
    config = run_client(["scontrol", "show", "config"]) or ""
    where = f"association {user}/{account or 'default'}"
    return parse_limits(qos, qos_text, where, assoc_text, partitions, queued, config), ""


def parse_limits(
    qos: str, qos_text: str, where: str, assoc_text: str, partitions: str, queued: str, config: str = ""
) -> ClusterLimits:
    """The limits read_limits' commands printed: `sacctmgr -n -P show qos QOS format=QOS_FIELDS`, `...
    show assoc ... format=ASSOC_FIELDS` (`where` names that association in messages), `scontrol show
    partition -o`, `squeue -h -r -o %i` (the user's jobs queued under `qos`) and `scontrol show config`
    (its MaxArraySize; SLURM's default where it is not said). Of a limit set both on the
    QOS and on the association, the tighter binds; one set on neither (empty, UNLIMITED, -1) is None."""
    caps: dict[str, Cap] = {}
    for _, submit, per_user, per_job, wall in rows(qos_text, 5)[:1]:
        of = f"QOS {qos}"
        put(caps, "max_submit", number(submit), f"{of} MaxSubmitJobsPerUser", "QOSMaxSubmitJobPerUserLimit")
        put(caps, "gpus_per_user", gpus_of(per_user), f"{of} MaxTRESPerUser gres/gpu", "QOSMaxGRESPerUser")
        put(caps, "gpus_per_job", gpus_of(per_job), f"{of} MaxTRESPerJob gres/gpu", "QOSMaxGRESPerJob")
        put(caps, "max_wall_s", read_duration(wall), f"{of} MaxWall", "QOSMaxWallDurationPerJobLimit")
    if (assoc := association_row(assoc_text)) is not None:
        _, submit, _, group, per_job, wall, _ = assoc
        put(caps, "max_submit", number(submit), f"{where} MaxSubmitJobs", "AssocMaxSubmitJobLimit")
        put(caps, "gpus_per_user", gpus_of(group), f"{where} GrpTRES gres/gpu", "AssocGrpGRES")
        put(caps, "gpus_per_job", gpus_of(per_job), f"{where} MaxTRES gres/gpu", "AssocMaxGRESPerJob")
        put(caps, "max_wall_s", read_duration(wall), f"{where} MaxWall", "AssocMaxWallDurationPerJobLimit")
    times, default = partition_times(partitions)
    return ClusterLimits(
        qos,
        **caps,
        queued=len(queued.split()),
        partition_time_s=times,
        partition_nodes=partition_nodes(partitions),
        default_partition=default,
        **({"max_array_size": size} if (size := max_array_size(config)) else {}),
    )


def max_array_size(config: str) -> int | None:
    """MaxArraySize in `scontrol show config` output (`MaxArraySize = 1001`)."""
    found = re.search(r"^MaxArraySize\s*=\s*(\d+)", config, re.MULTILINE)
    return int(found.group(1)) if found else None


def association_row(text: str) -> list[str] | None:
    """The user's association of no partition in `show assoc` output: the one every job is held to (an
    association of one partition, listed before it, binds only jobs there)."""
    return next((row for row in rows(text, 7) if not row[0]), None)


def default_qos(assoc_text: str) -> str:
    """The association's DefaultQOS; SLURM's own default, `normal`, where it names none."""
    assoc = association_row(assoc_text)
    return assoc[6] if assoc and assoc[6] else "normal"


# Reasons SLURM gives when a job's GPUs plus what the user's (or group's) other jobs hold pass a cap: they
# resolve as those jobs end, unless the job alone asks more than the cap.
UNTIL_OTHERS_END = {"QOSMaxGRESPerUser": "gpus_per_user", "AssocGrpGRES": "gpus_per_user"}


@cache
def limits_of(account: str | None, qos: str | None) -> ClusterLimits | None:
    """read_limits, once per command for each account and qos (--status asks only for jobs that pend
    on such a reason)."""
    return read_limits(account, qos)[0]


def never_starts(reason: str, resources) -> bool:
    """Whether a job pending for `reason` can never start: its own request is over a limit, not only its
    request on top of what other jobs hold (known only if the limits can be read)."""
    if reason not in UNTIL_OTHERS_END:
        return True
    limits = limits_of(resources.account, resources.qos)
    cap = getattr(limits, UNTIL_OTHERS_END[reason], None) if limits is not None else None
    return cap is not None and resources.total_gpus > cap.value


def put(caps: dict[str, Cap], name: str, value: int | None, source: str, reason: str) -> None:
    """Keep the tighter of two limits of the same kind (QOS and association)."""
    if value is not None and (name not in caps or value < caps[name].value):
        caps[name] = Cap(value, source, reason)


def partition_times(text: str) -> tuple[dict[str, Cap], str | None]:
    times, default = {}, None
    for line in text.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        name = fields.get("PartitionName")
        if not name:
            continue
        if fields.get("Default") == "YES":
            default = name
        if (limit := read_duration(fields.get("MaxTime", ""))) is not None:
            times[name] = Cap(limit, f"partition {name} MaxTime", "PartitionTimeLimit")
    return times, default


def partition_nodes(text: str) -> dict[str, Cap]:
    """Each partition's TotalNodes in `scontrol show partition -o`: a job asking more waits forever
    (SLURM queues it as PartitionNodeLimit under EnforcePartLimits=NO)."""
    counts = {}
    for line in text.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        name, total = fields.get("PartitionName"), ascii_int(fields.get("TotalNodes", ""))
        if name and total is not None:
            counts[name] = Cap(total, f"partition {name} TotalNodes", "PartitionNodeLimit")
    return counts


def rows(text: str, width: int) -> list[list[str]]:
    return [(line.split("|") + [""] * width)[:width] for line in text.splitlines() if line.strip()]


def first_line(text: str | None) -> str | None:
    return text.strip().splitlines()[0].strip() or None if text and text.strip() else None


def number(text: str) -> int | None:
    return ascii_int(text)


def gpus_of(tres: str) -> int | None:
    """The GPU cap in a TRES limit: `cpu=16,gres/gpu=2` → 2, a typed `gres/gpu:a100=2` → 2; None without
    a GPU limit. Of several, the smallest: our jobs ask GPUs of no type, and SLURM counts the GPUs it gives
    against the cap of their type as well as the untyped one; where a partition's GPUs are all of the
    capped type (why a QOS caps one type), a job over that cap never starts. (On a partition of mixed types
    this is stricter than SLURM. What a job held is a sum instead: slurm/watching/status.py tres_gpus.)"""
    caps = gpu_counts(tres_counts(tres)).values()
    return min(caps) if caps else None


def never_starting(jobs, limits: ClusterLimits, files: dict[str, str]) -> list[Problem]:
    """Every job SLURM would accept and then leave pending forever, at its file and key, with the limit
    and the fix. `jobs`: planned jobs (or a pack's allocation, as one)."""
    problems = []
    for job in jobs:
        file = files.get(job.experiment, job.experiment)
        section = "resources" if job.kind == "train" else "eval.resources"
        gpus, time_s = job.resources.total_gpus, job.resources.time_s
        for cap in (limits.gpus_per_user, limits.gpus_per_job):
            if cap is not None and gpus > cap.value:
                problems.append(
                    Problem(
                        file,
                        f"{section}.gpus",
                        f"{job.id} asks {gpus} GPU(s), over the {cap.source}={cap.value}: SLURM would accept "
                        f"it and leave it pending forever ({cap.reason}); ask {cap.value} or fewer, or "
                        "another qos in cluster.yaml",
                    )
                )
        partition = job.resources.partition or limits.default_partition
        nodes = limits.partition_nodes.get(partition or "")
        if nodes is not None and job.resources.nodes > nodes.value:
            problems.append(
                Problem(
                    file,
                    f"{section}.nodes",
                    f"{job.id} asks {job.resources.nodes} nodes, over the {nodes.source}={nodes.value}: it "
                    f"would never start ({nodes.reason}); ask {nodes.value} or fewer, or a partition with "
                    "more nodes (resources.partition)",
                )
            )
        for cap, fix in (
            (limits.partition_time_s.get(partition or ""), "or another partition"),
            (limits.max_wall_s, "or another qos"),
        ):
            if cap is not None and time_s > cap.value:
                problems.append(
                    Problem(
                        file,
                        f"{section}.time",
                        f"{job.id} asks {slurm_time(time_s)}, over the {cap.source} {slurm_time(cap.value)}: "
                        f"SLURM would accept it and leave it pending forever ({cap.reason}); set "
                        f"{section}.time to {slurm_time(cap.value)} or less (a stage resumes from its "
                        f"checkpoint when requeued), {fix}",
                    )
                )
    return problems


def over_submit_limit(count: int, limits: ClusterLimits) -> Problem | None:
    """A plan of `count` jobs that the user may not queue whole: refused before the first, never halfway."""
    cap = limits.max_submit
    if cap is None or limits.queued + count <= cap.value:
        return None
    room = max(0, cap.value - limits.queued)
    return Problem(
        "command line",
        "",
        f"this launch queues {count} job(s) and you have {limits.queued} queued under QOS {limits.qos}; "
        f"the {cap.source} is {cap.value}, so SLURM would refuse the rest halfway ({cap.reason}). "
        f"You may queue {room} now: launch fewer experiments (--exp), or run them packed as one job "
        "(--pack G --budget T)",
    )


def pack_never_starting(resources, limits: ClusterLimits) -> list[Problem]:
    """The same for a packed allocation: its GPUs (--pack) and its time limit (--budget)."""
    problems = []
    for cap in (limits.gpus_per_user, limits.gpus_per_job):
        if cap is not None and resources.gpus > cap.value:
            message = f"the allocation asks {resources.gpus} GPU(s), over the {cap.source}={cap.value}"
            problems.append(
                Problem("command line", "--pack", f"{message} ({cap.reason}): --pack {cap.value}")
            )
    partition = resources.partition or limits.default_partition
    for cap in (limits.partition_time_s.get(partition or ""), limits.max_wall_s):
        if cap is not None and resources.time_s > cap.value:
            message = f"{slurm_time(resources.time_s)} is over the {cap.source} {slurm_time(cap.value)}"
            problems.append(
                Problem(
                    "command line",
                    "--budget",
                    f"{message} ({cap.reason}): --budget {slurm_time(cap.value)} or less",
                )
            )
    return problems


def cluster_problems(
    jobs, files: dict[str, str], profile, say, pack=None
) -> tuple[list[Problem], ClusterLimits | None]:
    """What would keep `jobs` (or `pack`, their one allocation) from ever running here, before any is
    queued, and the limits it was judged by; `say(line)` tells that the limits could not be read (then
    none are checked, and they are None). A job array's tasks count as jobs, as SLURM counts them."""
    limits, why = read_limits(profile.account, profile.qos)
    if limits is None:
        say(f"the cluster's limits could not be read ({why}); queueing without checking them")
        return [], None
    problems = pack_never_starting(pack, limits) if pack is not None else never_starting(jobs, limits, files)
    if (over := over_submit_limit(1 if pack is not None else len(jobs), limits)) is not None:
        problems.append(over)
    return problems, limits
