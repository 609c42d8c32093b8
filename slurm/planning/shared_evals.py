"""Which of a launch's eval jobs go to SLURM as one shared eval: pure data, decided from the jobs to submit.

A sweep's evals that would load the same base model the same way, on the same examples with the same
settings (EvalJob.sharing_key), are one job: it imports and loads the base once and scores each adapter in
turn into that point's own eval folder (slurm/queueing/jobs.py SharedEvalStage, eval/shared.py). The base
model's own eval (the report's base row) joins it when it is the same eval. Each member keeps its plan
row, its hash and its DONE.

- **When it starts.** After every member's training has ended, however it ended (`afterany`): it never
  holds a GPU while a training runs, and a point whose training failed or was cancelled is left
  unscored (its row says why) while the others are scored.
- **Time limit.** The sum of its members' limits, split into several shared evals where that would pass
  the longest a job may ask (cluster.yaml's `max_time`, the partition's MaxTime and the QOS's MaxWall, where
  they could be read); a requeue goes on at the first adapter not scored.
- Only on SLURM, only evals of sweep points (and their base row), never a point whose `eval.shared` is
  false; a group of one is a job of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.config import Resources
from core.durations import slurm_time
from slurm.planning.plan import PlannedJob


@dataclass(frozen=True)
class SharedEval:
    """Eval jobs scored by one job, in order. `parents`: the plan ids of the trainings it waits for."""

    jobs: tuple[PlannedJob, ...]
    resources: Resources
    parents: tuple[str, ...]

    @property
    def name(self) -> str:
        """Its SLURM job name: the sweep of its first point (`lr-sweep/eval-shared`)."""
        sweep = next(j.sweep for j in self.jobs if j.sweep is not None)
        return f"{sweep}/eval-shared"

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "scores": [job.id for job in self.jobs],
            "time": self.resources.time,
            "after_any_of": list(self.parents),
        }


def shared(job: PlannedJob) -> bool:
    """Whether the eval may be scored by a shared eval: a sweep point's (or a base row's) that allows it."""
    return (
        job.kind == "eval"
        and job.spec.eval.shared
        and (job.sweep is not None or job.spec.adapter_dir is None)
    )


def with_shared_evals(batches: list, waits_on: set[str], longest=None) -> list:
    """`batches` (slurm/planning/arrays.py submissions, in their order) with every group of two or more
    shareable evals of one sweep replaced by its SharedEval(s), each where its last member was: after the
    trainings its members wait for (slurm/planning/arrays.py in_dependency_order then checks that every
    job still comes after what it waits on). A base row joins the first sweep whose evals are its eval.
    `waits_on`: plan ids still to end (queued by this launch or an earlier one); `longest(resources)`: the
    longest time limit a job of those resources may ask, in seconds (None: no bound known)."""
    groups: dict[tuple, list[PlannedJob]] = {}
    bases: dict[tuple, list[PlannedJob]] = {}
    for batch in batches:
        if isinstance(batch, PlannedJob) and shared(batch):
            key = (batch.spec.sharing_key, repr(batch.resources.model_dump(exclude={"time"})))
            if batch.sweep is None:
                bases.setdefault(key, []).append(batch)
            else:  # one sweep's: evals of another may be waited on by its trainings (`after:`)
                groups.setdefault((*key, batch.sweep), []).append(batch)
    for key, jobs in groups.items():
        for base in bases.pop(key[:2], []):
            jobs.insert(0, base)
    last_of: dict[str, list[SharedEval]] = {}  # the id of a group's last member → its shared evals
    members: set[str] = set()
    position = {id(batch): index for index, batch in enumerate(batches)}
    for jobs in groups.values():
        if len(jobs) < 2:
            continue
        chunks = by_time(jobs, longest(jobs[0].resources) if longest else None)
        last = max(jobs, key=lambda job: position[id(job)])  # a base row may come after a point's eval
        last_of[last.id] = [  # a piece of one is its own job
            SharedEval(chunk, summed_resources(chunk), parents_of(chunk, waits_on))
            if len(chunk) > 1
            else chunk[0]
            for chunk in chunks
        ]
        members.update(j.id for j in jobs)
    placed: list = []
    for batch in batches:
        if isinstance(batch, PlannedJob) and batch.id in members:
            placed += last_of.get(batch.id, [])
        else:
            placed.append(batch)
    return placed


def by_time(jobs: list[PlannedJob], max_time_s: int | None) -> list[tuple[PlannedJob, ...]]:
    """The members in order, cut where their summed limits would pass `max_time_s`."""
    chunks: list[list[PlannedJob]] = [[]]
    for job in jobs:
        total = sum(j.resources.time_s for j in chunks[-1]) + job.resources.time_s
        if chunks[-1] and max_time_s is not None and total > max_time_s:
            chunks.append([])
        chunks[-1].append(job)
    return [tuple(chunk) for chunk in chunks]


def summed_resources(jobs: tuple[PlannedJob, ...]) -> Resources:
    total = sum(j.resources.time_s for j in jobs)
    return jobs[0].resources.model_copy(update={"time": slurm_time(total)})


def parents_of(jobs: tuple[PlannedJob, ...], waits_on: set[str]) -> tuple[str, ...]:
    """The trainings still to end that the members score (each member's parents that are not met)."""
    found = (d.job_id for job in jobs for d in job.depends_on if d.job_id in waits_on)
    return tuple(dict.fromkeys(found))
