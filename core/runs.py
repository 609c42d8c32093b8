"""What the report reads of a run root, as typed records: the scheduler layer (slurm/watching/reporting.py)
loads the run root once, reads each job's summary.json once, and hands these to eval/report.py, which
then needs nothing of the plan or the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from core.states import State
from core.sweep import SweepMember


@dataclass(frozen=True)
class JobUsage:
    """What one job held of the cluster, as it charges it (slurm/watching/usage.py)."""

    held_s: float  # wall time held, every attempt (a packed unit: its lane time)
    gpu_hours: float
    gpus: int  # held by the last attempt (a packed unit: its lane's one)
    attempts: int
    source: str  # "sacct", "sacct: share of pack 123", "local clock"


@dataclass(frozen=True)
class PackUsage:
    job_id: str
    gpus: int
    held_s: float
    gpu_hours: float
    busy: float | None  # lane-seconds its units used ÷ (lanes x held); None where none was timed


@dataclass(frozen=True)
class PlanUsage:
    jobs: dict[str, JobUsage]  # plan id → what it held; jobs without a figure are absent
    packs: tuple[PackUsage, ...] = ()
    unanswered: tuple[str, ...] = ()  # SLURM job ids sacct gave nothing for


@dataclass(frozen=True)
class JobRun:
    """One job of the run root: the plan's facts about it and what its run folder holds."""

    id: str  # EXP/STAGE
    experiment: str
    stage: str
    kind: str  # train, eval, export
    run_dir: Path
    gpus: int  # what it asks for (its resources)
    state: State | None  # None: the scheduler was not asked (a report made from run folders alone)
    model: str = ""  # a training stage's base model (name_or_path)
    method: str = ""  # a training stage's adapter method (lora, qlora)
    summary: dict = field(default_factory=dict)  # a training stage's summary.json, read once ({}: none)
    used: JobUsage | None = None  # what it held (slurm/watching/usage.py); None: no scheduler figure


@dataclass(frozen=True)
class BaseEval:
    """An experiment's base-model eval (the base without any adapter, scored as the experiment is)."""

    job_id: str  # the plan job that scores the base
    out_dir: str  # where its results.json is
    model: str  # the base model (name_or_path), for the row's label
    left_out: str | None = None  # why this experiment has no base row; then job_id/out_dir are ""


@dataclass(frozen=True)
class ReportInput:
    """Everything one report is made of (eval/report.py write_report), in one value. `jobs`: the run root's,
    in plan order; `baselines`: the baselines.yaml file(s) found; `tasks`: experiment → its `task:`
    (None: not set); `gpu_hour_cost`: cluster.yaml's, for a cost per experiment and in total; `usage`: what
    the packs held, and which jobs sacct knew nothing of; `sweeps`: experiment → the sweep point it is
    (absent: not a point); `base_evals`: experiment → its base-model eval
    (absent: none, no delta); `descriptions`: experiment → its `description:`."""

    jobs: list[JobRun]
    run_root: Path
    baselines: Path | list[Path] | None = None
    tasks: dict[str, str | None] = field(default_factory=dict)
    gpu_hour_cost: float | None = None
    usage: PlanUsage | None = None
    sweeps: dict[str, SweepMember] = field(default_factory=dict)
    base_evals: dict[str, BaseEval] = field(default_factory=dict)
    descriptions: dict[str, str] = field(default_factory=dict)
