"""The plan: every job to run, its resolved spec and hash, resources and dependencies. Pure data.

Stage N+1 starts from stage N's adapter (`afterok`: it needs the data), the eval job follows the last
stage (`afterok`) on its own, smaller allocation (`eval.resources`), and `after: [other]` waits for the
other experiment's last job to end (`afterany`: ordering only). Each job carries its estimated duration
(slurm/planning/estimate.py), and `resources.time: auto` is resolved here from it, so everything downstream sees a
concrete time limit. The plan is printed by --dry-run, tested as data, and only then submitted.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from pydantic import ValidationError

from core import layout
from core.config import (
    AdapterSpec,
    EvalJob,
    ExportJob,
    PruneJob,
    Resources,
    TrainJob,
    what_it_computes,
)
from core.devices import estimated_gpus
from core.durations import format_duration, slurm_time
from core.hashing import content_hash
from core.names import PREFERENCE
from core.problems import ConfigError, Problem
from core.pruning import definition_hash, expected_epochs
from core.rundir import ADAPTER, CONFIG, in_folder, is_done, run_folder
from slurm.cluster.profile import ClusterProfile
from slurm.planning import guesses
from slurm.planning.estimate import GUESSED_EVAL_FLOOR_S, Estimate, Estimator, auto_time_limit_s
from slurm.planning.validation import LoadedExperiment

DependencyKind = Literal["afterok", "afterany"]
# What a pruned sweep's runs are counted at: every run to its end (worst), or the epochs successive halving
# is expected to leave them (expected: core/pruning.py expected_epochs).
Basis = Literal["worst", "expected"]


@dataclass(frozen=True)
class Dependency:
    job_id: str
    kind: DependencyKind


@dataclass(frozen=True)
class PlannedJob:
    id: str  # "EXP/STAGE" or "EXP/eval": also the SLURM job name and the run/log sub-folder
    experiment: str
    stage: str
    kind: Literal["train", "eval", "export"]
    spec: TrainJob | EvalJob | ExportJob
    config_hash: str
    resources: Resources
    depends_on: tuple[Dependency, ...]
    wave: int  # how many jobs must end before this one can start, along the longest chain
    estimate: Estimate = Estimate(None, "unknown", "not estimated")
    time_auto: bool = False  # `time: auto`: resources.time is set from the estimate (estimated)
    sweep: str | None = None  # the sweep its experiment is a point of (core/sweep.py)

    @property
    def run_dir(self) -> str:
        return self.spec.run_dir if isinstance(self.spec, TrainJob) else self.spec.out_dir

    @property
    def tasks(self) -> int:
        """Processes the job runs: one per GPU for training (DDP); an eval job is one process."""
        return self.resources.tasks if self.kind == "train" else 1

    @property
    def limit_origin(self) -> str:
        """Its time limit and where it came from, for a job that reached it: written, `auto` from an
        estimate, or `auto` from a guess (no speed of this model measured yet)."""
        key = "resources.time" if self.kind == "train" else "eval.resources.time"
        if not self.time_auto:
            return f"{self.resources.time}, written as {key}"
        guess = "a guessed " if self.estimate.source == "guess" else f"the {self.estimate.source} "
        estimate = format_duration(self.estimate.seconds) if self.estimate.seconds else "no"
        return f"{self.resources.time}, {key}: auto from {guess}estimate of {estimate}"

    @property
    def expected_share(self) -> float:
        """The share of its training a job is expected to run: for a training stage of a pruned sweep, its
        expected epochs (core/pruning.py expected_epochs, for the sweep's size) over its epochs; else 1."""
        if not isinstance(self.spec, TrainJob) or self.spec.prune is None:
            return 1.0
        train, prune = self.spec.train, self.spec.prune
        return (
            expected_epochs(train.epochs, prune.rungs, prune.keep, prune.runs, prune.min_points)
            / train.epochs
        )

    def seconds(self, basis: Basis = "worst") -> float | None:
        """Its estimate; `expected`: the part a pruned run is expected to run (the worst case stops none).
        Start-up is never saved: a stopped run paid it whole."""
        if self.estimate.seconds is None:
            return None
        if basis == "worst":
            return self.estimate.seconds
        startup = min(self.estimate.startup_s, self.estimate.seconds)
        return startup + (self.estimate.seconds - startup) * self.expected_share

    @property
    def effective_batch(self) -> int | None:
        """Examples per optimizer step: batch_size x grad_accum x tasks (each task takes its own batch)."""
        if not isinstance(self.spec, TrainJob):
            return None
        return self.spec.train.batch_size * self.spec.train.grad_accum * self.tasks


@dataclass(frozen=True)
class Plan:
    jobs: tuple[PlannedJob, ...]
    run_root: str
    log_root: str
    # experiment → the job that scores its base model (eval.baseline), or why it has none
    base_of: dict[str, str] = field(default_factory=dict)
    base_left_out: dict[str, str] = field(default_factory=dict)
    # sweep → its `parallel:` (how many of its array's tasks may run at once), where written
    sweep_parallel: dict[str, int] = field(default_factory=dict)
    # The GPUs of this machine when the local backend runs the plan (0: its jobs run on CPUs, and are
    # estimated so: core/devices.py estimated_gpus); None on SLURM.
    gpus_here: int | None = None

    def job(self, job_id: str) -> PlannedJob:
        return next(j for j in self.jobs if j.id == job_id)

    def edges(self) -> list[tuple[str, str, str]]:
        return [(dep.job_id, job.id, dep.kind) for job in self.jobs for dep in job.depends_on]

    def critical_path(self, experiment: str | None = None) -> tuple[float, list[str]]:
        """(makespan in seconds, the chain of jobs that sets it), if every job starts as soon as its
        parents end (no queue wait, enough GPUs). A job without an estimate counts as 0 s. With
        `experiment`, that experiment's own jobs alone (what waiting on other experiments adds is left out)."""
        end: dict[str, float] = {}
        before: dict[str, str | None] = {}
        jobs = [j for j in self.jobs if experiment in (None, j.experiment)]
        for job in jobs:  # parents come first
            parents = [d for d in job.depends_on if d.job_id in end]
            parent = max(parents, key=lambda d: end[d.job_id], default=None)
            start = end[parent.job_id] if parent else 0.0
            end[job.id], before[job.id] = start + (job.estimate.seconds or 0.0), parent and parent.job_id
        last = max(end, key=end.get, default=None)
        path = []
        while last is not None:
            path.append(last)
            last = before[last]
        return (end[path[0]] if path else 0.0), path[::-1]

    def sweep_totals(self, points: list[str]) -> dict:
        """A sweep's points, and the GPU-hours and makespan (every point at once) of what is left of it;
        a pruned sweep's GPU-hours as expected too (its worst case stops no run)."""
        unknown = bool(self.unestimated())
        pruned = self.pruned()
        return {
            "points": len(points),
            "gpu_hours": None if unknown else round(self.gpu_hours(), 3),
            **(
                {"expected_gpu_hours": None if unknown else round(self.gpu_hours("expected"), 3)}
                if pruned
                else {}
            ),
            "makespan_s": None if unknown else round(self.critical_path()[0]),
        }

    def pruned(self) -> bool:
        """Whether any of its jobs may stop at a rung (a pruned sweep's training stage)."""
        return any(j.expected_share < 1.0 for j in self.jobs)

    def experiments(self) -> list[str]:
        return list(dict.fromkeys(j.experiment for j in self.jobs))

    def experiment_path(self, name: str) -> dict:
        seconds, path = self.critical_path(name)
        unknown = any(j.estimate.seconds is None for j in self.jobs if j.experiment == name)
        return {"critical_path_s": None if unknown else round(seconds), "critical_path": path}

    def gpu_hours(self, basis: Basis = "worst") -> float:
        return sum((j.seconds(basis) or 0.0) * j.resources.total_gpus for j in self.jobs) / 3600

    def file_of(self, job: PlannedJob, files: dict[str, str]) -> str:
        """The YAML a job's problems are reported in: its experiment's; a base-model eval's is that of the
        first experiment it is the base of."""
        if job.experiment in files:
            return files[job.experiment]
        return next(
            (files[e] for e, base in self.base_of.items() if base == job.id and e in files), job.experiment
        )

    def sweeps(self) -> dict[str, list[str]]:
        """Sweep name → the experiments of its points, in plan order."""
        found: dict[str, list[str]] = {}
        for job in self.jobs:
            if job.sweep is not None and job.experiment not in found.setdefault(job.sweep, []):
                found[job.sweep].append(job.experiment)
        return found

    def of_sweep(self, sweep: str) -> Plan:
        return replace(self, jobs=tuple(j for j in self.jobs if j.sweep == sweep))

    def unestimated(self) -> list[str]:
        return [j.id for j in self.jobs if j.estimate.seconds is None]

    def only(self, job_ids) -> Plan:
        """The plan's jobs in `job_ids`, in order; their dependencies on the others count as met."""
        return replace(self, jobs=tuple(j for j in self.jobs if j.id in job_ids))

    def left(self, states: dict[str, str]) -> Plan:
        """What is left to run: every job whose state (as a relaunch decides it) is not `done`."""
        return self.only({j.id for j in self.jobs if states.get(j.id, "planned") != "done"})

    def to_json(self, states: dict[str, str] | None = None) -> dict:
        """`states`: plan id → what a relaunch would do (planned, done, queued, running, refused);
        makespan and GPU-hours are those of what is left."""
        states = states or {}
        left = self.left(states)
        unknown = bool(left.unestimated())  # then makespan and GPU-hours would be lower bounds: say nothing
        return {
            "run_root": self.run_root,
            "log_root": self.log_root,
            "makespan_s": None if unknown else round(left.critical_path()[0]),
            "gpu_hours": None if unknown else round(left.gpu_hours(), 3),
            **(
                {"expected_gpu_hours": None if unknown else round(left.gpu_hours("expected"), 3)}
                if left.pruned()
                else {}
            ),
            "experiments": {name: self.experiment_path(name) for name in self.experiments()},
            "sweeps": {
                name: left.of_sweep(name).sweep_totals(points) for name, points in self.sweeps().items()
            },
            "jobs": [
                {
                    "id": j.id,
                    "state": states.get(j.id, "planned"),
                    "sweep": j.sweep,
                    "experiment": j.experiment,
                    "stage": j.stage,
                    "kind": j.kind,
                    "config_hash": j.config_hash,
                    "run_dir": j.run_dir,
                    "wave": j.wave,
                    "tasks": j.tasks,
                    "placement": j.resources.placement(),
                    "effective_batch": j.effective_batch,
                    "estimate": j.estimate.to_json(),
                    "time_limit_min": j.resources.timeout_min,
                    "depends_on": [{"job": d.job_id, "kind": d.kind} for d in j.depends_on],
                    "resources": j.resources.model_dump(),
                    "spec": j.spec.model_dump(),
                }
                for j in self.jobs
            ],
            "edges": [{"from": a, "to": b, "kind": k} for a, b, k in self.edges()],
        }


def build_plan(
    experiments: list[LoadedExperiment],
    profile: ClusterProfile,
    estimator: Estimator | None = None,
    gpus_here: int | None = None,
) -> Plan:
    """Jobs in an order where every dependency comes before its dependents, each with its estimate.
    Estimates read the run root's speed book unless another `estimator` is given; `gpus_here`: this
    machine's GPUs when the local backend runs the plan (Plan.gpus_here), None on SLURM."""
    estimator = estimator or Estimator.for_run_root(profile.run_dir)
    jobs: dict[str, PlannedJob] = {}
    last_job: dict[str, str] = {}
    base_of: dict[str, str] = {}
    base_left_out: dict[str, str] = {}
    parallel: dict[str, int] = {}
    for loaded in order_by_after(experiments):
        chained = [Dependency(last_job[t], "afterany") for t in loaded.experiment.after if t in last_job]
        sweep = loaded.sweep.sweep if loaded.sweep is not None else None
        if loaded.sweep is not None and loaded.sweep.parallel is not None:
            parallel[sweep] = loaded.sweep.parallel
        for job in experiment_jobs(loaded, profile, chained, jobs):
            jobs[job.id] = replace(
                estimated(job, estimator, profile, str(loaded.file), gpus_here), sweep=sweep
            )
        last_job[loaded.name] = job.id
        exp = loaded.experiment
        if exp.eval.metrics and exp.eval.baseline:
            if exp.model.added_tokens:
                base_left_out[exp.name] = (
                    "it adds tokens (model.added_tokens) the base model has no embeddings for, so the base "
                    "would be scored with another tokenizer than the adapter"
                )
                continue
            base = base_eval_job(loaded, profile)
            if base.id not in jobs:  # shared: planned once for every experiment it is the base of
                jobs[base.id] = estimated(base, estimator, profile, str(loaded.file), gpus_here)
            base_of[exp.name] = base.id
    return Plan(
        tuple(jobs.values()), profile.run_dir, profile.log_dir, base_of, base_left_out, parallel, gpus_here
    )


def base_eval_job(loaded: LoadedExperiment, profile: ClusterProfile) -> PlannedJob:
    """The eval of the experiment's base model without an adapter, on the prompts, metrics, generation
    settings and split of its own eval (after its last stage): one job per distinct such eval, named by
    its content's full identity (a 24-bit name once let two generation settings share one folder), so
    every experiment and sweep point that shares it shares one job, planned and hashed like any other.
    A local model path is named relative to where the launch runs (`./models/x`, `models/x/` and its
    absolute path are one base, and moving the repository changes nothing). A QLoRA experiment's base is
    scored 4-bit, as its adapter is: the difference is the adapter's alone. A base eval finished under
    the name it had before (`legacy_base_eval_job`) is recognised and kept, never run again."""
    content = base_eval_content(loaded)
    local = normalised_model_path(content.model.name_or_path)
    if local is not None:
        content = content.model_copy(
            update={"model": content.model.model_copy(update={"name_or_path": local})}
        )
    job = named_base_eval(content, content_hash(content.model_dump()), loaded, profile)
    if Path(job.run_dir).exists():
        return job
    old = legacy_base_eval_job(loaded, profile)
    return old if is_done(Path(old.run_dir), old.config_hash, old.kind) else job


def legacy_base_eval_job(loaded: LoadedExperiment, profile: ClusterProfile) -> PlannedJob:
    """The base eval as it was planned before its name held the full identity: the model path as
    written, 6 hex characters of the content's hash."""
    content = base_eval_content(loaded)
    return named_base_eval(content, content_hash(content.model_dump(), 6), loaded, profile)


def base_eval_content(loaded: LoadedExperiment) -> EvalJob:
    exp, stage = loaded.experiment, loaded.stages[-1]
    scored = stage.data.eval if exp.eval.split == "eval" else stage.data.train
    data = stage.data.scored_only(scored)  # a curriculum's `order` makes no other base row
    adapter = AdapterSpec(
        method=exp.adapter.method, quant_type=exp.adapter.quant_type, double_quant=exp.adapter.double_quant
    )
    return EvalJob(
        experiment=layout.BASE_EVAL_PREFIX,
        stage=layout.EVAL,
        model=exp.model,
        adapter=adapter,
        data=data,
        eval=exp.eval.model_copy(update={"after_each_stage": False}),
        adapter_dir=None,
        out_dir="",
    )


def normalised_model_path(name_or_path: str) -> str | None:
    """A local model folder's path relative to where the launch runs (a folder outside it: absolute);
    None for a hub id."""
    if not Path(name_or_path).is_dir():
        return None
    absolute = os.path.abspath(name_or_path)
    relative = os.path.relpath(absolute)
    return absolute if relative.startswith("..") else relative


def named_base_eval(
    content: EvalJob, identity: str, loaded: LoadedExperiment, profile: ClusterProfile
) -> PlannedJob:
    exp = loaded.experiment
    model = re.sub(r"[^A-Za-z0-9_.]+", "_", exp.model.name_or_path.rstrip("/").rsplit("/", 1)[-1])[:24]
    name = f"{layout.BASE_EVAL_PREFIX}{model}-{identity}"
    spec = content.model_copy(
        update={"experiment": name, "out_dir": run_folder(profile.run_dir, name, layout.EVAL)}
    )
    resources = exp.eval.resources.for_training(with_profile_defaults(exp.resources, profile), spec.source)
    return make_job(f"{name}/{layout.EVAL}", "eval", spec, resources, [], {})


EXPORT_GUESS = Estimate(600.0, "guess", "an export: load the base, merge, check a few prompts, save")


def with_exports(plan: Plan, targets: list[tuple[str, str | None]], gguf: bool) -> Plan:
    """The plan and, for each (experiment, stage or None: its last), the export of that stage
    (launch.py --export): after its training (afterok: it needs the adapter) and after the stage's eval
    and its base-model eval (afterany: their scores make the model card's table, when they have them)."""
    jobs = list(plan.jobs)
    known = {j.id: j for j in jobs}
    problems = []
    for experiment, stage in targets:
        stages = [j.stage for j in jobs if j.experiment == experiment and j.kind == "train"]
        if (stage or stages[-1]) not in stages:
            listed = ", ".join(stages)
            problems.append(
                Problem(
                    "command line", "--export", f"{experiment} has no stage '{stage}' (its stages: {listed})"
                )
            )
            continue
        stage = stage or stages[-1]
        trained = known[f"{experiment}/{stage}"]
        last = stage == stages[-1]
        evals = [known[i] for i in (f"{experiment}/{layout.eval_folder(stage, last)}",) if i in known]
        if last and experiment in plan.base_of:
            evals.insert(0, known[plan.base_of[experiment]])
        name = layout.export_folder(stage, last)
        spec = ExportJob(
            experiment=experiment,
            stage=stage,
            stage_dir=trained.run_dir,
            out_dir=run_folder(plan.run_root, experiment, name),
            eval_configs=[in_folder(e.run_dir, CONFIG) for e in evals],
            gguf=gguf,
        )
        deps = [Dependency(trained.id, "afterok"), *(Dependency(e.id, "afterany") for e in evals)]
        resources = (evals[-1] if evals else trained).resources.model_copy(
            update={"gpus": min(1, trained.resources.gpus)}
        )
        job = replace(
            make_job(f"{experiment}/{name}", "export", spec, resources, deps, known), estimate=EXPORT_GUESS
        )
        known[job.id] = job
        jobs.append(job)
    if problems:
        raise ConfigError(problems)
    return replace(plan, jobs=tuple(jobs))


def calibration_plan(plan: Plan, steps: int, estimator: Estimator | None = None) -> Plan:
    """For each experiment, its first training stage cut to `steps` steps, without evals or tracking, in
    RUN_ROOT/EXP/STAGE-calibrate (the speed book's layout): its speed-book row is marked `calibration`.
    Time limit: the stage's, at most an hour."""
    estimator = estimator or Estimator.for_run_root(plan.run_root)
    jobs = []
    for name in plan.experiments():
        first = next((j for j in plan.jobs if j.experiment == name and j.kind == "train"), None)
        if first is None:  # a base-model eval: nothing trains
            continue
        stage = layout.calibration_folder(first.stage)
        train = first.spec.train.model_copy(
            update={"max_steps": steps, "eval_every_epochs": None, "early_stopping": None}
        )
        spec = first.spec.model_copy(
            update={
                "stage": stage,
                "train": train,
                "init_adapter": None,
                "run_dir": run_folder(plan.run_root, name, stage),
                "tracking": [],
                "calibration": True,
                "prune": None,  # a calibration measures speed: it joins no sweep's rung records
            }
        )
        resources = first.resources.model_copy(update={"time": slurm_time(min(first.resources.time_s, 3600))})
        job = make_job(f"{name}/{stage}", "train", spec, resources, [], {})
        gpus = estimated_gpus(resources.gpus, plan.gpus_here)
        gpu = guesses.job_gpu(resources) if gpus else None
        jobs.append(replace(job, estimate=estimator(spec, gpus, gpu)))
    return Plan(tuple(jobs), plan.run_root, plan.log_root, gpus_here=plan.gpus_here)


def estimated_again(plan: Plan, profile: ClusterProfile, files: dict[str, str]) -> Plan:
    """The same plan, estimated from what the run root holds now (the tokens preflight counted, a speed
    book grown meanwhile): estimates and `time: auto` limits change, not the jobs. `files`: experiment →
    its YAML, where a limit that does not fit is reported."""
    estimator = Estimator.for_run_root(plan.run_root)
    jobs = tuple(
        estimated(job, estimator, profile, plan.file_of(job, files), plan.gpus_here) for job in plan.jobs
    )
    return replace(plan, jobs=jobs)


def estimated(
    job: PlannedJob, estimator: Estimator, profile: ClusterProfile, file: str, gpus_here: int | None = None
) -> PlannedJob:
    """The job with its estimate, and `time: auto` replaced by the limit that estimate sets; on the devices
    it will run on (core/devices.py estimated_gpus: a local machine without GPUs runs it on CPUs)."""
    gpus = estimated_gpus(job.resources.gpus, gpus_here)
    gpu = guesses.job_gpu(job.resources, profile.partition) if gpus else None
    estimate = estimator(job.spec, gpus, gpu, profile.gpu_mem_for(job.resources) if gpus else None)
    resources = job.resources
    if job.time_auto:
        guessed = estimate.source == "guess"
        floor = GUESSED_EVAL_FLOOR_S if guessed and job.kind == "eval" else 0
        limit = auto_time_limit_s(
            estimate.seconds, resources.signal_delay_s, profile.max_time_s, guessed, floor
        )
        try:  # validated again: the signal delay must fit inside the limit, as for a written time
            resources = Resources.model_validate({**resources.model_dump(), "time": slurm_time(limit)})
        except ValidationError as exc:
            key = "resources.time" if job.kind == "train" else "eval.resources.time"
            message = f"auto became {slurm_time(limit)} (cluster.yaml max_time {profile.max_time}): "
            raise ConfigError(
                [Problem(file, key, message + exc.errors()[0]["msg"].removeprefix("Value error, "))]
            ) from None
    return replace(job, estimate=estimate, resources=resources)


def order_by_after(experiments: list[LoadedExperiment]) -> list[LoadedExperiment]:
    by_name = {e.name: e for e in experiments}
    ordered: dict[str, LoadedExperiment] = {}  # by name: comparing whole experiments is O(n) each

    def place(item: LoadedExperiment) -> None:
        if item.name in ordered:
            return
        for target in item.experiment.after:
            if target in by_name:
                place(by_name[target])
        ordered[item.name] = item

    for item in experiments:
        place(item)
    return list(ordered.values())


def experiment_jobs(
    loaded: LoadedExperiment,
    profile: ClusterProfile,
    first_deps: list[Dependency],
    known: dict[str, PlannedJob],
) -> list[PlannedJob]:
    exp = loaded.experiment
    resources = with_profile_defaults(exp.resources, profile)
    jobs: list[PlannedJob] = []
    previous: PlannedJob | None = None
    for stage in loaded.stages:
        spec = TrainJob(
            **of_stage(exp, stage),
            train=stage.train,
            init_adapter=in_folder(previous.run_dir, ADAPTER) if previous else None,
            run_dir=run_folder(profile.run_dir, exp.name, stage.name),
            tracking=exp.tracking,
            prune=pruning_of(loaded),
            global_ranks=resources.tasks if resources.elastic else None,
            fewest_ranks=resources.min_nodes * resources.tasks_per_node if resources.elastic else None,
            functions_from=functions_folder(loaded, stage),
        )
        spec = with_definition(spec, loaded)
        deps = [Dependency(previous.id, "afterok")] if previous else list(first_deps)
        previous = make_job(
            f"{exp.name}/{stage.name}", "train", spec, resources, deps, {**known, **_ids(jobs)}
        )
        jobs.append(previous)
        is_last = stage is loaded.stages[-1]
        if exp.eval.metrics and (is_last or exp.eval.after_each_stage):
            name = layout.eval_folder(stage.name, is_last)
            pairs = preference_pairs(loaded, stage)
            jobs.append(
                eval_job(exp, stage, previous, name, resources, profile, {**known, **_ids(jobs)}, pairs)
            )
    return jobs


def pruning_of(loaded: LoadedExperiment) -> PruneJob | None:
    """A pruned sweep's point: its block, and the sweep whose rung records it joins."""
    member = loaded.sweep
    if member is None or member.prune is None:
        return None
    return PruneJob(**member.prune.model_dump(), sweep=member.sweep)


def with_definition(spec: TrainJob, loaded: LoadedExperiment) -> TrainJob:
    """A pruned point's spec with what its losses are measured under (core/pruning.py definition_hash)."""
    if spec.prune is None or loaded.sweep is None:
        return spec
    under = definition_hash(spec.model_dump(), list(loaded.sweep.swept))
    known = {"measured_under": under, "runs": loaded.sweep.size}
    return spec.model_copy(update={"prune": spec.prune.model_copy(update=known)})


def of_stage(exp, stage) -> dict:
    """What a stage's training job and its eval job share: the experiment, the model, adapter and data."""
    return {
        "experiment": exp.name,
        "stage": stage.name,
        "model": exp.model,
        "adapter": exp.adapter,
        "data": stage.data,
    }


def preference_pairs(loaded: LoadedExperiment, stage):
    """The pairs an earlier stage's eval scores besides its own data: the last preference stage's data
    (None: the stage's own data are pairs, or no stage has pairs)."""
    if stage.data.format == PREFERENCE:
        return None
    return next((s.data for s in reversed(loaded.stages) if s.data.format == PREFERENCE), None)


def eval_job(
    exp, stage, trained: PlannedJob, name: str, training: Resources, profile, known, pairs=None
) -> PlannedJob:
    """The job that scores `trained`'s adapter, on its own allocation (`eval.resources`); `pairs`:
    preference_pairs."""
    spec = EvalJob(
        **of_stage(exp, stage),
        eval=exp.eval,
        preference_pairs=pairs,
        adapter_dir=in_folder(trained.run_dir, ADAPTER),
        out_dir=run_folder(profile.run_dir, exp.name, name),
    )
    resources = exp.eval.resources.for_training(training, spec.source)
    return make_job(f"{exp.name}/{name}", "eval", spec, resources, [Dependency(trained.id, "afterok")], known)


def _ids(jobs: list[PlannedJob]) -> dict[str, PlannedJob]:
    return {j.id: j for j in jobs}


def functions_folder(loaded: LoadedExperiment, stage) -> str | None:
    """The config's folder, for a GRPO stage with a user's reward function (imported from there)."""
    if stage.train.method == "grpo" and any(r.function for r in stage.train.reward_objective.rewards):
        return str(loaded.file.parent.resolve())
    return None


def make_job(job_id, kind, spec, resources, deps, known: dict[str, PlannedJob]) -> PlannedJob:
    parents = [known[d.job_id] for d in deps]
    # A job's identity covers what it starts from: a changed stage 1 means stage 2 must run again.
    data_parents = sorted(p.config_hash for p, d in zip(parents, deps, strict=True) if d.kind == "afterok")
    # How a run is watched or split into micro-batches does not change what it computes: left out.
    identity = {"spec": what_it_computes(spec.model_dump()), "parents": data_parents}
    # The ranks a training stage runs on set its global batch, its steps per epoch and its schedule: the
    # same YAML on 1 and on 2 GPUs trains two different adapters. One rank is left out, so every stage
    # that finished before the world size counted keeps its hash.
    if kind == "train" and resources.tasks > 1:
        identity["world_size"] = resources.tasks
    digest = content_hash(identity)
    wave = 1 + max((p.wave for p in parents), default=-1)
    experiment, stage = job_id.split("/", 1)
    return PlannedJob(
        job_id,
        experiment,
        stage,
        kind,
        spec,
        digest,
        resources,
        tuple(deps),
        wave,
        time_auto=resources.time == "auto",
    )


def with_profile_defaults(resources: Resources, profile: ClusterProfile) -> Resources:
    """The experiment's own partition/account/qos win; the cluster profile fills what it left out."""
    fill = {k: getattr(profile, k) for k in ("partition", "account", "qos") if getattr(resources, k) is None}
    return resources.model_copy(update=fill)
