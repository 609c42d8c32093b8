"""Packing: a plan's jobs run as units on G lanes (one GPU each) inside one SLURM allocation. Pure data.

`--pack G --budget HH:MM:SS` asks for one job with G GPUs on one node and the budget as its time limit;
inside it, a lane that frees claims the next ready unit, longest estimate first (slurm/queueing/lanes.py). Here the
same rule is simulated with the plan's estimates, before anything is queued: the lanes it gives are what
`--dry-run` prints, and a makespan over the budget is refused with the GPU count that would fit.

A unit's duration is its estimate; a unit without one counts as its whole time limit (pessimistic: the
packing then fits for sure or is refused). A pruned sweep's training units count whole (no run stopped),
unless `--budget-basis expected` counts them at the epochs pruning is expected to leave them (slurm/planning/plan.py
PlannedJob.seconds); a pruned unit that ends at its rung frees its lane at once (slurm/queueing/lanes.py). The makespan must end before SLURM's stop signal (the budget
less the units' signal_delay_s and SLURM's 30 s timer). Units needing several GPUs (DDP) are refused: a
lane is one GPU. A lane gets the CPUs (capped at the node's) and memory (refused beyond it) of the
hungriest unit.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

from pydantic import ValidationError

from core.config import SLURM_TIMER_S, Resources
from core.durations import slurm_seconds, slurm_time
from core.problems import ConfigError, Problem
from core.rundir import log_folder
from slurm.cluster.profile import ClusterProfile
from slurm.planning.plan import Basis, PlannedJob


@dataclass(frozen=True)
class Packing:
    gpus: int
    budget_s: int
    lanes: tuple[tuple[str, ...], ...]  # job ids per lane, in the order the lane runs them
    starts: dict[str, float]  # simulated start and end of each unit, seconds from the allocation's start
    ends: dict[str, float]
    basis: Basis = "worst"  # what a pruned sweep's units were counted at

    @property
    def makespan_s(self) -> float:
        return max(self.ends.values(), default=0.0)

    @property
    def utilisation(self) -> float:
        """Busy lane-seconds ÷ (lanes × makespan)."""
        busy = sum(self.ends[j] - self.starts[j] for j in self.ends)
        return busy / (self.gpus * self.makespan_s) if self.makespan_s else 0.0

    def to_json(self) -> dict:
        return {
            "gpus": self.gpus,
            "budget_s": self.budget_s,
            "makespan_s": round(self.makespan_s),
            "utilisation": round(self.utilisation, 3),
            "basis": self.basis,
            "lanes": [list(lane) for lane in self.lanes],
        }


def unit_seconds(job: PlannedJob, basis: Basis = "worst") -> float:
    seconds = job.seconds(basis)
    return seconds if seconds is not None else float(job.resources.time_s)


def simulate(jobs: list[PlannedJob], gpus: int, basis: Basis = "worst") -> Packing:
    """Run the lanes' rule on the estimates: whenever a lane is free, it takes the ready unit with the
    longest estimate (lowest lane number first); a unit is ready when its parents in `jobs` have ended.
    Parents outside `jobs` are done or run elsewhere before the allocation starts."""
    ids = {j.id for j in jobs}
    waiting = list(jobs)
    free = list(range(gpus))
    running: list[tuple[float, int, str]] = []  # (end, lane, job id)
    starts: dict[str, float] = {}
    ends: dict[str, float] = {}
    lanes: list[list[str]] = [[] for _ in range(gpus)]
    now = 0.0
    while waiting or running:
        ready = [j for j in waiting if all(d.job_id in ends or d.job_id not in ids for d in j.depends_on)]
        for job in sorted(ready, key=lambda j: unit_seconds(j, basis), reverse=True)[: len(free)]:
            lane = free.pop(0)
            waiting.remove(job)
            starts[job.id] = now
            running.append((now + unit_seconds(job, basis), lane, job.id))
            lanes[lane].append(job.id)
        running.sort()
        now = running[0][0]
        while running and running[0][0] == now:  # every unit ending at this instant frees its lane
            end, lane, job_id = running.pop(0)
            ends[job_id] = end
            free.append(lane)
        free.sort()
    return Packing(gpus, 0, tuple(tuple(lane) for lane in lanes), starts, ends, basis)


def pack_plan(
    jobs: list[PlannedJob], gpus: int, budget: str, profile: ClusterProfile, basis: Basis = "worst"
) -> Packing:
    """The packing of `jobs` (the plan's jobs still to run) on `gpus` lanes, a pruned sweep's units
    counted on `basis`; ConfigError if a unit cannot take a lane or the simulated makespan exceeds the
    budget."""
    problems = []
    if not 1 <= gpus <= profile.max_gpus_per_node:
        problems.append(
            f"--pack {gpus}: a pack is one node, and nodes here have 1 to {profile.max_gpus_per_node} GPUs"
        )
    for job in jobs:
        if job.resources.nodes > 1:
            problems.append(
                f"{job.id} trains on {job.resources.placement()}, and a pack is one node: run it unpacked "
                f"(launch it with --exp {job.experiment} before or after the pack)"
            )
        elif job.resources.gpus > 1:
            problems.append(
                f"{job.id} trains on {job.resources.gpus} GPUs (DDP), and a lane is one GPU: run it unpacked "
                f"(launch it with --exp {job.experiment} before or after the pack), or set resources.gpus: 1"
            )
    if problems:
        raise ConfigError([Problem("command line", "--pack", p) for p in problems])
    budget_s = slurm_seconds(budget)
    if budget_s > profile.max_time_s:
        message = (
            f"{budget} is longer than cluster.yaml's max_time {profile.max_time} (the partition's limit)"
        )
        raise ConfigError([Problem("command line", "--budget", message)])
    packing = replace(simulate(jobs, gpus, basis), budget_s=budget_s)
    if packing.makespan_s > usable_s(jobs, budget_s):
        raise ConfigError([Problem("command line", "--budget", over_budget(jobs, packing, profile))])
    return packing


def points_that_fit(jobs: list[PlannedJob], gpus: int, budget_s: float, basis: Basis = "worst") -> str:
    """For a plan with sweep points: how many of them fit on `gpus` lanes within the budget when the most
    expensive (GPU-seconds of all its jobs) are dropped first, and which; "" without sweeps."""
    cost: dict[str, float] = {}
    for job in jobs:
        if job.sweep is not None:
            cost[job.experiment] = cost.get(job.experiment, 0.0) + unit_seconds(job, basis) * max(
                1, job.resources.gpus
            )
    if not cost:
        return ""
    dearest = sorted(cost, key=lambda name: (-cost[name], name))
    for dropped in range(1, len(dearest)):
        gone = set(dearest[:dropped])
        kept = [j for j in jobs if j.experiment not in gone]
        if simulate(kept, gpus, basis).makespan_s <= budget_s:
            named = ", ".join(dearest[:dropped][:6]) + (f" and {dropped - 6} more" if dropped > 6 else "")
            return (
                f"; {len(dearest) - dropped} of the {len(dearest)} sweep points fit on {gpus} GPU(s): drop "
                f"the most expensive first ({named}), e.g. fewer values or seeds in the sweep"
            )
    return ""


def usable_s(jobs: list[PlannedJob], budget_s: int) -> float:
    """The part of the budget units can work in: SLURM signals the allocation signal_delay_s before its
    limit (and up to SLURM_TIMER_S earlier), and the units then stop to checkpoint."""
    delay = max((j.resources.signal_delay_s for j in jobs), default=0)
    return budget_s - delay - SLURM_TIMER_S


def over_budget(jobs: list[PlannedJob], packing: Packing, profile: ClusterProfile) -> str:
    makespan, budget = packing.makespan_s, usable_s(jobs, packing.budget_s)
    if budget <= 0:  # before: "over the -1-23:59:30 the budget leaves"
        delay = max((j.resources.signal_delay_s for j in jobs), default=0)
        return (
            f"{slurm_time(packing.budget_s)} leaves no time to work: SLURM's stop signal comes "
            f"signal_delay_s ({delay} s) and up to {SLURM_TIMER_S} s before the end, so a budget must be "
            f"longer than {slurm_time(delay + SLURM_TIMER_S)}; the {len(jobs)} job(s) need about "
            f"{slurm_time(round(makespan))} on {packing.gpus} GPU(s)"
        )
    message = (
        f"the {len(jobs)} job(s) need about {slurm_time(round(makespan))} on {packing.gpus} GPU(s), "
        f"{slurm_time(round(makespan - budget))} over the {slurm_time(round(budget))} the budget "
        f"{slurm_time(packing.budget_s)} leaves before SLURM's stop signal"
    )
    if packing.basis == "worst" and any(j.expected_share < 1.0 for j in jobs):
        message += " (a pruned sweep counted with no run stopped; --budget-basis expected counts what pruning is expected to leave)"
    message += points_that_fit(jobs, packing.gpus, budget, packing.basis)
    for gpus in range(packing.gpus + 1, profile.max_gpus_per_node + 1):
        if simulate(jobs, gpus, packing.basis).makespan_s <= budget:
            return f"{message}; they would fit on {gpus} GPUs (--pack {gpus})"
    alone = simulate(
        jobs, max(1, len(jobs)), packing.basis
    ).makespan_s  # as many lanes as units: the longest chain alone
    return (
        f"{message}; no pack of up to {profile.max_gpus_per_node} GPUs fits, as its longest chain alone "
        f"takes {slurm_time(round(alone))}: raise --budget, or pack fewer experiments (--exp)"
    )


def pack_resources(jobs: list[PlannedJob], packing: Packing, profile: ClusterProfile) -> Resources:
    """One node with G GPUs for the budget; per lane the CPUs and memory of the hungriest unit (capped at
    the node's), and the partition, account, qos and constraint the units share."""
    shared = {}
    for key in ("partition", "account", "qos", "constraint"):
        values = {getattr(j.resources, key) for j in jobs}
        if len(values) > 1:
            raise ConfigError(
                [
                    Problem(
                        "command line",
                        "--pack",
                        f"the jobs ask for different resources.{key} ({', '.join(sorted(map(str, values)))}), "
                        "and a pack is one allocation: pack those of one at a time (--exp)",
                    )
                ]
            )
        shared[key] = values.pop() if values else None
    lanes = packing.gpus
    need_gb = lanes * max(j.resources.mem_gb for j in jobs)
    if need_gb > profile.max_mem_gb_per_node:
        hungriest = max(jobs, key=lambda j: j.resources.mem_gb)
        fits = int(profile.max_mem_gb_per_node // hungriest.resources.mem_gb)
        message = (
            f"{lanes} lanes x {hungriest.resources.mem_gb:g} GB ({hungriest.id}'s mem_gb) is more memory than a "
            f"node has ({profile.max_mem_gb_per_node:g} GB): pack on {fits} GPU(s), or lower resources.mem_gb"
        )
        raise ConfigError([Problem("command line", "--pack", message)])
    try:
        return pack_allocation(jobs, lanes, packing.budget_s, profile, shared)
    except ValidationError as exc:
        message = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise ConfigError([Problem("command line", "--budget", message)]) from None


def pack_allocation(jobs: list[PlannedJob], lanes: int, budget_s: int, profile, shared: dict) -> Resources:
    return Resources(
        gpus=lanes,
        time=slurm_time(budget_s),
        cpus=min(profile.max_cpus_per_node, lanes * max(j.resources.cpus for j in jobs)),
        mem_gb=lanes * max(j.resources.mem_gb for j in jobs),
        signal_delay_s=max(j.resources.signal_delay_s for j in jobs),
        max_requeues=max(j.resources.max_requeues for j in jobs),
        mail=sorted({m for j in jobs for m in j.resources.mail}),
        **shared,
    )


@dataclass(frozen=True)
class OutsideParent:
    """A unit's parent that is not a unit of the same pack: done, or queued as a job of its own."""

    id: str
    kind: str  # afterok | afterany
    run_dir: str
    config_hash: str
    job_kind: str = "train"  # train | eval | export: what "done" means for it (core/rundir.py is_done)


@dataclass(frozen=True)
class Unit:
    """One job of a packed allocation, as the allocation runs it: submitit pickles the list, each lane
    writes its unit's order file from it (slurm/queueing/lanes.py) and the unit's process reads that (slurm/queueing/unit.py)."""

    id: str
    kind: Literal["train", "eval"]
    spec: dict
    config_hash: str
    run_dir: str
    log_folder: str
    seconds: float  # its estimate: a free lane takes the longest ready unit
    depends_on: tuple[tuple[str, str], ...]  # (plan id, kind) of its parents
    outside: tuple[OutsideParent, ...] = ()
    gpus: int = 1

    def root_of(self, folder: str) -> Path:
        """The root (run root, log root) that `folder`, its run_dir or log_folder (ROOT/ID), lies below:
        its writes there are reached from it without following a link (core/below.py)."""
        return Path(folder).absolute().parents[len(Path(self.id).parts) - 1]

    def order(self, workdir: str) -> str:
        """The order file's JSON: the unit and the user's directory its stage runs in."""
        return json.dumps({**asdict(self), "workdir": workdir})

    @classmethod
    def of(cls, value: Unit | dict) -> Unit:
        """A Unit, from itself or from a dict (an order file; the pickled submission of an allocation
        queued before units were typed)."""
        if isinstance(value, Unit):
            return value
        fields = {k: v for k, v in value.items() if k in cls.__dataclass_fields__}
        outside = tuple(OutsideParent(**p) for p in fields.get("outside", ()))
        depends_on = tuple(tuple(d) for d in fields.get("depends_on", ()))
        return cls(**{**fields, "outside": outside, "depends_on": depends_on})


def unit_of(job: PlannedJob, log_root: str, outside: list[tuple[PlannedJob, str]] = ()) -> Unit:
    """What the allocation needs to run one unit. `outside`: its parents that are not units of this pack
    (done, or queued as jobs of their own), with the dependency kind."""
    return Unit(
        id=job.id,
        kind=job.kind,
        spec=job.spec.model_dump(),
        config_hash=job.config_hash,
        run_dir=job.run_dir,
        log_folder=str(log_folder(log_root, job.id)),
        seconds=unit_seconds(job),
        depends_on=tuple((d.job_id, d.kind) for d in job.depends_on),
        outside=tuple(OutsideParent(p.id, kind, p.run_dir, p.config_hash, p.kind) for p, kind in outside),
        gpus=job.resources.gpus,
    )
