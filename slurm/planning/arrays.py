"""Which of a launch's jobs go to SLURM as one job array: pure data, decided from the jobs to submit.

A sweep's trainings of one stage position that ask the same resources and wait on the same jobs are one
array (`sbatch --array=0-N%K`): one submission instead of N, one queue entry until they start. Each task
keeps its point's run folder, spec and job.json record (`ARRAY_TASK` ids, `123_4`), so status, --tail,
--cancel and --retry-failed see one point as before.

- **A later stage** is an array too when its parents are, task for task, an array of this launch: it
  waits with `aftercorr` (task i after task i). Else each of its jobs is submitted on its own, after its
  own parent's task (`afterok:123_4`), as a job that is not in an array always was.
- **Time limits.** An array's tasks share one `--time`. Points whose limit is written share it or go to
  another array; points of `time: auto` share the longest of their estimates' limits.
- **Size.** SLURM's MaxArraySize bounds a task's index: a larger group is split into several arrays of
  even sizes (a later stage is split the same way, so `aftercorr` still pairs task i with task i).
- **At once.** K, the tasks of one array that may run at once: the sweep's `parallel:`, at most the GPUs
  the QOS lets this user hold over the GPUs a task asks; neither: every task. K is per array: a sweep's
  second-stage array, or a relaunch's new points, runs K more beside it.
- Multi-node and elastic points are arrays as any other (each task is a whole allocation of its own);
  evals, exports and packed launches are never arrays (a sweep's evals are one shared eval instead:
  slurm/planning/shared_evals.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from core.config import Resources
from core.durations import slurm_time
from slurm.planning.plan import PlannedJob
from slurm.planning.shared_evals import with_shared_evals

# SLURM's default MaxArraySize (slurm.conf): task indices 0..1000.
DEFAULT_MAX_ARRAY_SIZE = 1001


@dataclass(frozen=True)
class JobArray:
    """Jobs submitted as one array, task i running jobs[i]. `follows`: the array whose task i each task
    waits for (`aftercorr`), or None; `parents`: the jobs outside it that every task waits for, as
    (plan id, dependency kind)."""

    jobs: tuple[PlannedJob, ...]
    resources: Resources
    parallel: int
    follows: JobArray | None = None
    parents: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        """Its SLURM job name: the sweep and its stage (`lr-sweep/train-array`); which point each task
        runs, --status says."""
        first = self.jobs[0]
        return f"{first.sweep}/{first.stage}-array"

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "tasks": [job.id for job in self.jobs],
            "at_once": self.parallel,
            "time": self.resources.time,
            "after_task_of": self.follows.name if self.follows is not None else None,
            "waits_on": [{"job": job_id, "kind": kind} for job_id, kind in self.parents],
        }


Submission = PlannedJob | JobArray


def submissions(
    todo: list[PlannedJob],
    waits_on: set[str],
    parallel_of: dict[str, int],
    max_array_size: int = DEFAULT_MAX_ARRAY_SIZE,
    gpus_per_user: int | None = None,
) -> list[Submission]:
    """`todo` (plan order: parents first) as the submissions that queue it, in an order where each comes
    after what it waits on. `waits_on`: the plan ids a job still waits for when they are its parents (those
    queued by this launch or live from an earlier one; a parent that is done is met). `parallel_of`: each
    sweep's `parallel:`; `gpus_per_user`: the QOS's cap, if known."""
    groups: dict[tuple, list[PlannedJob]] = {}
    key_of: dict[str, tuple] = {}
    for job in todo:
        if job.kind != "train" or job.sweep is None:
            continue
        live = [d for d in job.depends_on if d.job_id in waits_on]
        previous = [d for d in live if d.kind == "afterok" and d.job_id in key_of]
        others = tuple(sorted((d.job_id, d.kind) for d in live if d not in previous))
        parent_key = key_of[previous[0].job_id] if previous else None
        if any(d.kind == "afterok" and d not in previous for d in live):
            continue  # its previous stage is a job of its own, or live from an earlier launch
        key = (job.sweep, job.stage, resources_key(job), others, parent_key)
        groups.setdefault(key, []).append(job)
        key_of[job.id] = key
    arrays: dict[str, JobArray] = {}  # plan id → the array that runs it
    for key, jobs in groups.items():
        parents = groups.get(key[-1]) if key[-1] else None
        if len(jobs) < 2 or (parents is not None and not corresponds(jobs, parents, arrays)):
            continue  # each is a job of its own (after its parent's task)
        for chunk in pieces(jobs, max_array_size):
            follows = arrays[previous_of(chunk[0], arrays)] if parents is not None else None
            array = JobArray(
                chunk, shared_resources(chunk), at_once(chunk, parallel_of, gpus_per_user), follows, key[3]
            )
            arrays.update({j.id: array for j in chunk})
    ordered: list[Submission] = []
    seen: set[int] = set()
    for job in todo:
        array = arrays.get(job.id)
        if array is None:
            ordered.append(job)
        elif id(array) not in seen:
            seen.add(id(array))
            ordered.append(array)
    return ordered


def slurm_submissions(
    todo: list[PlannedJob], waits_on: set[str], parallel_of: dict[str, int], limits, max_time_s=None
) -> list:
    """The sbatch calls that queue `todo` on SLURM, in order: a job, a job array (`submissions`, within
    the cluster's MaxArraySize and QOS GPU cap where its `limits`, a slurm/cluster/limits.py
    ClusterLimits, could be read; None: SLURM's defaults, no cap), or a shared eval
    (slurm/planning/shared_evals.py; `max_time_s`: cluster.yaml's longest limit, lowered to the QOS's
    MaxWall and the partitions' MaxTime). Where sharing evals would make a job come before what it waits
    on, the evals are each a job of their own."""
    if limits is None:
        batches = submissions(todo, waits_on, parallel_of)
    else:
        cap = limits.gpus_per_user.value if limits.gpus_per_user else None
        batches = submissions(todo, waits_on, parallel_of, limits.max_array_size, cap)

    def longest(resources) -> int | None:
        """cluster.yaml's max_time, lowered to the QOS's MaxWall and the partition's MaxTime."""
        if limits is None:
            return max_time_s
        partition = limits.partition_time_s.get(resources.partition or limits.default_partition or "")
        walls = [c.value for c in (limits.max_wall_s, partition) if c is not None]
        return min([t for t in (max_time_s, *walls) if t is not None], default=None)

    shared = in_dependency_order(with_shared_evals(batches, waits_on, longest))
    return shared if shared is not None else in_dependency_order(batches) or list(todo)


def in_dependency_order(batches: list) -> list | None:
    """`batches` reordered so that each comes after every batch it waits on (the one before it in the list
    where possible); None when they wait on each other in a circle."""
    owner = {job.id: index for index, batch in enumerate(batches) for job in jobs_of(batch)}
    needs = [
        {
            owner[d.job_id]
            for job in jobs_of(batch)
            for d in job.depends_on
            if owner.get(d.job_id, index) != index
        }
        for index, batch in enumerate(batches)
    ]
    ordered: list[int] = []
    placed: set[int] = set()
    while len(ordered) < len(batches):
        ready = next((i for i in range(len(batches)) if i not in placed and needs[i] <= placed), None)
        if ready is None:
            return None
        ordered.append(ready)
        placed.add(ready)
    return [batches[i] for i in ordered]


def jobs_of(batch) -> tuple[PlannedJob, ...]:
    return (batch,) if isinstance(batch, PlannedJob) else batch.jobs


def pieces(jobs: list[PlannedJob], most: int) -> list[tuple[PlannedJob, ...]]:
    """`jobs` in as few arrays of at most `most` tasks as there must be, of even sizes: never a piece of one
    (which submitit would queue as a job, not an array; 101 points at most 100 are 51 and 50)."""
    count = -(-len(jobs) // most)
    size, extra = divmod(len(jobs), count)
    found, start = [], 0
    for index in range(count):
        end = start + size + (index < extra)
        found.append(tuple(jobs[start:end]))
        start = end
    return found


def previous_of(job: PlannedJob, arrays: dict[str, JobArray]) -> str:
    """The plan id of the job's previous stage when an array runs it, else ""."""
    return next((d.job_id for d in job.depends_on if d.kind == "afterok" and d.job_id in arrays), "")


def corresponds(jobs: list[PlannedJob], parents: list[PlannedJob], arrays: dict[str, JobArray]) -> bool:
    """Whether `jobs` wait, one for one and in order, on `parents`, and every parent runs in an array whose
    task i is the parent of task i of the same split (aftercorr pairs indices, not names)."""
    if len(jobs) != len(parents) or any(p.id not in arrays for p in parents):
        return False
    return all(previous_of(job, arrays) == parent.id for job, parent in zip(jobs, parents, strict=True))


def resources_key(job: PlannedJob) -> str:
    """What an array's tasks must share: every resource, the time limit too unless `time: auto` set it
    (then the array takes its longest)."""
    shared = job.resources.model_dump(exclude={"time"} if job.time_auto else None)
    return repr(sorted(shared.items())) + ("auto" if job.time_auto else "")


def shared_resources(jobs: tuple[PlannedJob, ...]) -> Resources:
    longest = max(jobs, key=lambda j: j.resources.time_s)
    return jobs[0].resources.model_copy(update={"time": slurm_time(longest.resources.time_s)})


def at_once(jobs: tuple[PlannedJob, ...], parallel_of: dict[str, int], gpus_per_user: int | None) -> int:
    """K of `--array=0-N%K` (module docstring)."""
    k = min(len(jobs), parallel_of.get(jobs[0].sweep or "", len(jobs)))
    gpus = jobs[0].resources.total_gpus
    if gpus_per_user is not None and gpus:
        k = min(k, max(1, gpus_per_user // gpus))
    return k
