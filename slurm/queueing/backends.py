"""Submission through submitit: sbatch on SLURM, subprocesses locally (finding, watching and cancelling a
submitted job later goes through slurm/cluster/scheduler.py). Jobs run the launch's code snapshot (slurm/queueing/snapshot.py).

Both backends take the same jobs with the same dependencies. SLURM enforces them itself (`--dependency`,
and the dev cluster's `kill_invalid_depend` cancels children of a failed parent); the local backend
starts a job only when its parents ended as its dependency kind requires.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import submitit

from core import below
from core.config import Resources
from core.devices import GPU_SHARES
from core.files import stderr_into
from core.job_records import current_job
from core.problems import ConfigError
from core.rundir import LogRoot, log_folder
from core.states import State, jobs_verdict, parent_verdict
from slurm.cluster.local_gpus import GpuPool, VisibleGpus, gpus_needed, too_many_gpus
from slurm.cluster.profile import ClusterProfile
from slurm.cluster.scheduler import COMMENT_MARK, cancel, local_failure, reached_time_limit, stop_local
from slurm.planning.arrays import JobArray
from slurm.planning.pack import Unit
from slurm.planning.plan import PlannedJob
from slurm.planning.shared_evals import SharedEval
from slurm.queueing.jobs import EvalStage, ExportStage, SharedEvalStage, TrainStage
from slurm.queueing.lanes import PackJob
from slurm.queueing.snapshot import CodeSnapshot
from slurm.watching.status import timed_out_text

CONTROLLER_LOG = "controller.err"  # in a local job's log folder: its submitit controller's own stderr


def job_callable(job: PlannedJob):
    return {"train": TrainStage, "eval": EvalStage, "export": ExportStage}[job.kind]()


def job_args(job: PlannedJob, workdir: Path) -> tuple:
    return (job.spec.model_dump(), job.config_hash, str(workdir))


@contextmanager
def working_directory(folder: Path):
    """The local executor starts the job's processes in the launcher's working directory."""
    previous = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


class SlurmBackend:
    name = "slurm"

    def __init__(self, profile: ClusterProfile, workdir: Path, code: CodeSnapshot):
        self.profile, self.workdir, self.code = profile, workdir, code

    def submit(self, job: PlannedJob, parents: list[tuple[str, str]], token: str = "") -> str:
        """Queue one job; `parents` are (scheduler id, dependency kind); `token`, its submission intent's,
        goes into its comment (job_comment). Returns the SLURM job id."""
        executor = submitit.SlurmExecutor(
            folder=self.log_folder(job), max_num_timeout=job.resources.max_requeues
        )
        executor.update_parameters(
            **self.sbatch_parameters(job, parents), **job_comment(token, f"runs {job.run_dir}")
        )
        below.check(self.profile.log_dir, self.log_folder(job))  # submitit writes there: see _start
        return executor.submit(job_callable(job), *job_args(job, self.workdir)).job_id

    def submit_array(self, array: JobArray, parents: list[tuple[str, str]], token: str = "") -> list[str]:
        """Queue `array` as one SLURM job array (submitit's batch: `--array=0-N%K`), task i running
        array.jobs[i] with its own spec; every task's log is in the arrays' folder. Returns each task's id
        (`123_4`), in order."""
        folder = LogRoot.of(self.profile.log_dir).arrays
        executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=array.resources.max_requeues)
        first = array.jobs[0]
        params = sbatch_parameters(
            array.name, array.resources, first.tasks, parents, self.profile, self.code.folder
        )
        # A task whose aftercorr parent failed would wait forever (DependencyNeverSatisfied) on a cluster
        # without kill_invalid_depend, and the shared eval waiting on the whole array with it.
        params["additional_parameters"]["kill-on-invalid-dep"] = "yes"
        what = f"runs {len(array.jobs)} points of sweep {first.sweep}, stage {first.stage}"
        executor.update_parameters(**params, array_parallelism=array.parallel, **job_comment(token, what))
        below.check(self.profile.log_dir, folder)
        with executor.batch():
            jobs = [executor.submit(job_callable(job), *job_args(job, self.workdir)) for job in array.jobs]
        return [str(job.job_id) for job in jobs]

    def submit_shared_eval(self, evals: SharedEval, parents: list[tuple[str, str]], token: str = "") -> str:
        """Queue the one job that scores `evals` in turn (slurm/queueing/jobs.py SharedEvalStage); its log
        and its progress are in the shared evals' folder. Returns its SLURM job id."""
        folder = LogRoot.of(self.profile.log_dir).shared_evals
        executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=evals.resources.max_requeues)
        params = sbatch_parameters(evals.name, evals.resources, 1, parents, self.profile, self.code.folder)
        what = f"scores {len(evals.jobs)} adapters of one base"
        executor.update_parameters(**params, **job_comment(token, what))
        below.check(self.profile.log_dir, folder)
        specs = [job.spec.model_dump() for job in evals.jobs]
        hashes = [job.config_hash for job in evals.jobs]
        progress = str(folder / (token or "by-hand"))
        return executor.submit(SharedEvalStage(), specs, hashes, progress, str(self.workdir)).job_id

    def log_folder(self, job: PlannedJob) -> Path:
        return log_folder(self.profile.log_dir, job.id)

    def submit_pack(
        self, units: list[Unit], resources: Resources, parents: list[tuple[str, str]], token: str = ""
    ) -> str:
        """Queue one allocation that runs `units` on `resources.gpus` lanes (slurm/queueing/lanes.py)."""
        executor = submitit.SlurmExecutor(
            folder=self.pack_log_folder(), max_num_timeout=resources.max_requeues
        )
        executor.update_parameters(
            **sbatch_parameters("lora-pack", resources, 1, parents, self.profile, self.code.folder),
            **job_comment(token, f"packs {len(units)} job(s)"),
        )
        # Units must have checkpointed before the allocation requeues itself, ahead of the time limit.
        grace_s = max(10, resources.signal_delay_s - 20)
        below.check(self.profile.log_dir, self.pack_log_folder())
        return executor.submit(PackJob(), units, resources.gpus, str(self.workdir), grace_s).job_id

    def pack_log_folder(self) -> Path:
        """The allocation's own log (which lane ran what, when); each unit logs where a job would."""
        return LogRoot.of(self.profile.log_dir).packs

    def sbatch_parameters(self, job: PlannedJob, parents: list[tuple[str, str]]) -> dict:
        return sbatch_parameters(job.id, job.resources, job.tasks, parents, self.profile, self.code.folder)

    def cancel(self, job_ids: list[str]) -> None:
        # Cancelling needs only the id; submitit's job wants a folder, which it does not read for this.
        cancel([submitit.SlurmJob(self.profile.log_dir, job_id) for job_id in job_ids])


def job_comment(token: str, what: str) -> dict:
    """The SLURM comment of a submission: its intent's token (core/job_records.py record_intent), by which the
    next launch finds the job in the queue if this one dies before recording it, and what it runs, for
    people reading squeue. No token, no comment."""
    return {"comment": f"{COMMENT_MARK} {token} {' '.join(what.split())}"} if token else {}


def sbatch_parameters(
    name: str,
    res: Resources,
    tasks: int,
    parents: list[tuple[str, str]],
    profile: ClusterProfile,
    code_folder: Path,
) -> dict:
    per_node = tasks // res.nodes  # an eval job (one task) is never given several nodes (validation)
    params = {
        "job_name": name,
        "time": res.timeout_min,
        # submitit's `nodes` is an integer; an elastic job's `min-max` reaches sbatch through
        # additional_parameters below, whose keys replace submitit's own.
        "nodes": res.nodes,
        # One task per GPU on each node (DDP); `cpus` is each node's, split over its tasks.
        "ntasks_per_node": per_node,
        "cpus_per_task": max(1, res.cpus // per_node),
        "mem": f"{int(res.mem_gb * 1024)}M",
        "signal_delay_s": res.signal_delay_s,
        "stderr_to_stdout": True,  # one log per job: what --tail follows
        # A requeued run adds to the log, not erase it.
        "additional_parameters": {"open-mode": "append"} | ({"nodes": res.node_count} if res.elastic else {}),
        # Run in the user's directory, as they expect; after the offline switches, so a setup line may
        # override them.
        "setup": [*offline_setup(profile), *profile.setup],
        # Python starts in the code snapshot, so it imports that code (sys.path[0]); the job then
        # moves to the user's directory (workdir) before it reads any data path.
        "srun_args": [f"--chdir={code_folder}"],
    }
    if res.elastic:
        # With --ntasks-per-node, SLURM (cons_tres) gives a min-max job its minimum whenever that holds its
        # tasks: always one node. Without it, as many nodes as it can without delaying the start. So the
        # allocation asks each node's CPUs as one task's, and the step (srun) starts one task per GPU on
        # every node it got, each with its share of the CPUs (tests/test_cluster_ddp.py).
        del params["ntasks_per_node"]
        params["cpus_per_task"] = res.cpus
        params["srun_args"] += [
            f"--ntasks-per-node={per_node}",
            f"--cpus-per-task={max(1, res.cpus // per_node)}",
        ]
    if tasks > 1:
        # A rank that fails ends the job at once; the others would wait in their next all-reduce
        # until the process group's timeout (10-30 minutes of idle GPUs).
        params["srun_args"].append("--kill-on-bad-exit=1")
    if res.gpus:
        # The job's GPUs, each visible to every task (no per-task binding): rank k trains on
        # cuda:LOCAL_RANK of the GPUs CUDA shows it (train/device.py), the same order on every task.
        params["gpus_per_node"] = res.gpus
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(res, key):
            params[key] = getattr(res, key)
    if res.mail:
        params["mail_type"] = ",".join(res.mail)
        if profile.mail_user:
            params["mail_user"] = profile.mail_user
    if parents:
        params["dependency"] = ",".join(f"{kind}:{job_id}" for job_id, kind in parents)
    return params


def offline_setup(profile: ClusterProfile) -> list[str]:
    """Jobs find what preflight fetched in the shared cache (hub_downloads: login), without waiting on a
    network the nodes may not have; one that lacks a file fails at once with its fetch command."""
    if profile.hub_downloads != "login":
        return []
    return ["export HF_HUB_OFFLINE=1", "export HF_DATASETS_OFFLINE=1"]


def local_threads(cpus: int, tasks: int, cores: int) -> int:
    """Math threads of each task of a local job: its `resources.cpus` shared over its tasks, as SLURM's
    --cpus-per-task gives them (slurm/queueing/jobs.py _use_allocated_cpus), and at most this machine's cores
    shared over its tasks. torch's own default, every core, makes each op of a small model wait on a busy
    core: 4 eval prompts of the tiny T5 took 4.7 s instead of 0.27 s beside one other busy process."""
    return max(1, min(cpus // tasks, cores // tasks))


class LocalBackend:
    """Runs jobs on this machine, `local_parallel_jobs` at a time, honouring the same dependencies; each
    job holds its `resources.gpus` of the GPUs this machine shows, and waits until they are free
    (slurm/cluster/local_gpus.py). Jobs start in plan order, first fit: one that fits the free GPUs starts even if
    an earlier one still waits for more (the plan is finite, so the larger one gets them in the end)."""

    name = "local"

    def __init__(
        self, profile: ClusterProfile, workdir: Path, code: CodeSnapshot, gpus: VisibleGpus | None = None
    ):
        self.profile, self.workdir, self.code = profile, workdir, code
        self.gpus = gpus if gpus is not None else VisibleGpus.detect()

    def run(
        self,
        jobs: list[PlannedJob],
        parents_of: Callable[[PlannedJob], list[tuple[str, str]]],
        on_start: Callable[[PlannedJob, str, tuple[str, ...]], None],  # job, pid, its GPUs
        on_end: Callable[[PlannedJob, State, str], None],
        adopted: Sequence[tuple[PlannedJob, submitit.LocalJob, tuple[str, ...]]] = (),
    ) -> dict[str, State]:
        """Run `jobs` (dependency order) to the end. `adopted` (job, handle, its GPUs) run already, started by
        an earlier launch: they are waited for as if this run had started them. `parents_of` names each
        job's parents among both. Once a job ends cancelled (--cancel notes it in job.json), this run starts
        nothing new. Ctrl-C (or an error, such as a job.json that cannot be written) stops the running jobs,
        then goes on."""
        # A job asking for more GPUs than there are would wait forever (launch.py refuses it earlier).
        if problems := too_many_gpus(jobs, self.gpus, {}):
            raise ConfigError(problems)
        run = LocalRun(list(jobs), GpuPool(self.gpus.ids))
        for job, handle, devices in adopted:
            run.pool.hold(devices)
            run.running[job.id] = (job, handle, tuple(devices))
        try:
            while run.waiting or run.running:
                self._collect_ended(run, on_end)
                if State.CANCELLED in run.states.values():
                    run.cancel_waiting(on_end)
                self._start_ready(run, parents_of, on_start, on_end)
                time.sleep(0.2)
        except BaseException:  # Ctrl-C, or a job.json that cannot be written: no job is left behind
            run.stop_running(on_end)
            raise
        return run.states

    def _start_ready(self, run: LocalRun, parents_of, on_start, on_end) -> None:
        for job in list(run.waiting):
            verdict = self._ready(parents_of(job), run.states)
            if verdict is State.BLOCKED:
                run.waiting.remove(job)
                run.states[job.id] = State.BLOCKED
                on_end(job, State.BLOCKED, "a parent it needs failed")
            elif verdict is State.PENDING and len(run.running) < self.profile.local_parallel_jobs:
                devices = run.pool.take(gpus_needed(job.resources.gpus, self.gpus))
                if devices is None:
                    continue  # its GPUs are held by running jobs: it waits, as for a parallel slot
                run.waiting.remove(job)
                shares = max((run.pool.shares(d) for d in devices), default=1)
                run.running[job.id] = (job, self._start(job, devices, shares), devices)
                on_start(job, run.running[job.id][1].job_id, devices)

    def _collect_ended(self, run: LocalRun, on_end) -> None:
        for job_id, (job, handle, devices) in list(run.running.items()):
            if handle.done():
                del run.running[job_id]
                run.pool.give_back(devices)
                run.states[job_id], reason = self.outcome(job, handle)
                on_end(job, run.states[job_id], reason)

    @staticmethod
    def _ready(parents: list[tuple[str, str]], states: dict[str, State]) -> State | None:
        """PENDING = may start now, None = wait, BLOCKED = a parent it needs failed (`states`: the ended)."""
        return jobs_verdict([parent_verdict(kind, states.get(parent)) for parent, kind in parents])

    def _start(self, job: PlannedJob, devices: tuple[str, ...], shares: int = 1):
        """Every task of the job sees all of `devices` (rank K uses cuda:K, as on SLURM); none: no GPU.
        `shares`: how many jobs may run on its GPU at once (its memory split between them, train/device.py).

        Each task is started by `python` below: `env` sets its CUDA_VISIBLE_DEVICES and execs Python.
        submitit's own `visible_gpus` takes integer ids only (not the UUIDs a user may have set), and a
        `setup` line would start the job through /bin/sh, where a bash that execs its last command makes
        submitit take the launcher's pid for the job's id."""
        python = f"env CUDA_VISIBLE_DEVICES={shlex.quote(','.join(devices))} {GPU_SHARES}={shares} "
        if "OMP_NUM_THREADS" not in os.environ:  # a user's own setting wins, as it does on SLURM
            threads = local_threads(job.resources.cpus, job.tasks, os.cpu_count() or 1)
            python += f"OMP_NUM_THREADS={threads} MKL_NUM_THREADS={threads} "
        python += shlex.quote(sys.executable)
        folder = log_folder(self.profile.log_dir, job.id)
        executor = submitit.LocalExecutor(folder=folder, python=python)
        # The time-limit signal (USR2) comes signal_delay_s before the limit, as on SLURM (submitit's own
        # default, 30 s, left an eval scoring its last predictions no time to end and requeue).
        executor.update_parameters(
            timeout_min=job.resources.timeout_min,
            signal_delay_s=job.resources.signal_delay_s,
            tasks_per_node=job.tasks,
            stderr_to_stdout=True,
        )
        # see SlurmBackend: the job imports the snapshot
        log_root = Path(self.profile.log_dir)
        with working_directory(self.code.folder), stderr_into(folder / CONTROLLER_LOG, log_root):
            # submitit writes the job's files itself (its pickle, script, logs; on a node, later): they
            # can only be checked here, immediately before it is handed them, not at each of its writes
            below.check(log_root, folder)
            return executor.submit(job_callable(job), *job_args(job, self.workdir))

    @staticmethod
    def outcome(job: PlannedJob, handle) -> tuple[State, str]:
        """COMPLETED; CANCELLED when its job.json record says so (--cancel); else FAILED with the
        exception's last line (its log holds the traceback)."""
        if handle.paths.result_pickle.exists() and not local_failure(handle):
            return State.COMPLETED, ""
        record = current_job(Path(job.run_dir))
        if record and record.job_id == str(handle.job_id) and record.cancelled_at:
            return State.CANCELLED, f"cancelled at {record.cancelled_at}"
        if reached_time_limit(handle):
            return State.TIMEOUT, f"{timed_out_text(job)} (log: {handle.paths.stdout})"
        return State.FAILED, f"{local_failure(handle)} (log: {handle.paths.stdout})"


@dataclass
class LocalRun:
    """A local run while it goes: the jobs still waiting, those running (job, handle, its GPUs), the GPUs
    they hold, and how the ended ones ended."""

    waiting: list[PlannedJob]
    pool: GpuPool
    running: dict[str, tuple[PlannedJob, submitit.LocalJob, tuple[str, ...]]] = field(default_factory=dict)
    states: dict[str, State] = field(default_factory=dict)

    def cancel_waiting(self, on_end) -> None:
        """A cancelled run starts nothing new (else --cancel of its jobs would let the next one start)."""
        for job in self.waiting:
            self.states[job.id] = State.CANCELLED
            on_end(job, State.CANCELLED, "not started: this run was cancelled (--cancel); relaunch to run it")
        self.waiting.clear()

    def stop_running(self, on_end) -> None:
        """Ctrl-C: the running jobs are stopped, not left behind without their launcher."""
        for job_id, (job, handle, _) in list(self.running.items()):
            stopped = stop_local(handle)
            self.states[job_id] = State.CANCELLED if stopped else State.UNKNOWN
            why = "stopped with its launcher" if stopped else f"pid {handle.job_id} could not be stopped"
            with contextlib.suppress(OSError):  # noting it in a full run folder: the stop still counts
                on_end(job, self.states[job_id], why)
        self.running.clear()
