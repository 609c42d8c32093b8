"""What runs on the compute node: thin callables that submitit pickles, one per job kind.

They turn the scheduler's world (signals, requeue, DONE) into plain calls of the trainer and the
evaluator, which never talk to the scheduler themselves.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import submitit

from core.files import links_below, write_json_atomic
from core.redact import redact_job_output
from core.rundir import RunDir, mark_done
from core.writer_lock import hold_folder
from slurm.cluster.client import run_client
from slurm.cluster.rendezvous import (
    RendezvousError,
    first_node,
    gpus_on_node,
    master_address,
    rendezvous_port,
    same_on_every_node,
    tasks_per_node,
)
from train.libraries import hide, unused_libraries

log = logging.getLogger("slurm.queueing.jobs")


class StageJob(submitit.helpers.Checkpointable):
    """What every job does before its work: move from the code snapshot it was started in to the user's
    directory (relative data paths), mask secrets in its output, log, and size its math threads.

    On a time limit or preemption submitit calls `checkpoint()` (Checkpointable's: requeue this same call
    with the same arguments); a training stage then resumes from its last checkpoint, an eval from the
    predictions it made.

    A training or eval job holds its folder for its life (core/writer_lock.py): a second job there
    refuses to start, naming the first. A local job's task dies with its controller (die_with_controller).
    """

    holds_folder = True  # one writer per folder (an export commits its files atomically itself)

    def __call__(self, spec: dict, config_hash: str, workdir: str) -> str:
        rank = ready_process(spec, workdir)
        folder = Path(spec.get("run_dir") or spec["out_dir"])
        refuse_links_in(folder)
        if not self.holds_folder:
            return self.run(spec, config_hash)
        with hold_folder(folder, this_job_id(), rank):
            return self.run(spec, config_hash)

    def run(self, spec: dict, config_hash: str) -> str:
        raise NotImplementedError


def ready_process(spec: dict, workdir: str) -> int:
    """What every job does first, in this order (StageJob's docstring); returns this task's rank."""
    die_with_controller()
    os.chdir(workdir)
    redact_job_output()
    rank = _export_distributed_environment()
    _configure_logging(rank)
    if int(os.environ.get("SLURM_JOB_NUM_NODES", "1")) > 1:
        log.info(placement_line())
    # The GPUs SLURM or the local backend gave this task, as it got them (torch renumbers them).
    log.info("CUDA_VISIBLE_DEVICES=%s", os.environ.get("CUDA_VISIBLE_DEVICES", "(not set)"))
    _use_allocated_cpus()  # before torch is imported
    hide(unused_libraries(spec))  # before peft is imported: a LoRA job never loads bitsandbytes
    return rank


def this_job_id() -> str | None:
    """The scheduler's id of this process's job, the same on all its ranks and its requeues: the local
    controller's pid (submitit's local job id), or SLURM's job id (`123_4` for a task of an array, as
    job.json records it: its SLURM_JOB_ID is a number of its own); None when run by hand."""
    if local := os.environ.get("SUBMITIT_LOCAL_JOB_ID"):  # first: a local job may run inside an allocation
        return local
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID") or None


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_controller() -> None:
    """A local job's task is killed when its submitit controller dies, however it dies: `kill -9` of the
    pid --status shows (the controller's) left the trainer training on, unseen, beside the next one.

    Linux's parent-death signal (prctl PR_SET_PDEATHSIG) does it in the kernel, with no process left to
    ask. SIGKILL, as the controller got: a SIGTERM would be ignored until the job's own handler is set
    (submitit bypasses it), and would leave the trainer running to its next step end. What is lost is
    what a node failure loses: the steps since the last committed checkpoint. Only where the controller
    is the task's parent (no `setup` shell between them, which the local backend never adds); elsewhere
    (SLURM: its step daemon ends what it started; other systems) nothing is done."""
    controller = os.environ.get("SUBMITIT_LOCAL_JOB_ID")
    local = os.environ.get("SUBMITIT_EXECUTOR") == "local" and not os.environ.get("SUBMITIT_LOCAL_WITH_SHELL")
    if not (local and controller and sys.platform.startswith("linux")):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("cannot tie this task to its controller: %s", os.strerror(ctypes.get_errno()))
        return
    if str(os.getppid()) != controller:  # it died before the prctl: the signal will never come
        os.kill(os.getpid(), signal.SIGKILL)


def refuse_links_in(folder: Path) -> None:
    """A link planted in this job's folder after its launch checked the run root (slurm/cli.py
    refuse_links) would make the trainer, TensorBoard or the eval write through it: the job fails first,
    naming it. RUN_ROOT/EXP/FOLDER: the experiment's and the job's own folder may not be links either."""
    found = [p for p in (folder.parent, folder) if p.is_symlink()]
    found += links_below(folder) if folder.is_dir() and not found else []
    if found:
        raise RuntimeError(
            f"symbolic link(s) in the run folder, refused (a job never writes through one): "
            f"{', '.join(map(str, found))}; remove them and relaunch"
        )


class TrainStage(StageJob):
    """Train one stage. On SLURM's time-limit or preemption signal (USR2), the trainer saves a checkpoint
    at the next step end and returns; then submitit requeues this same call, which resumes from it.
    On SIGTERM (scancel, `scontrol requeue`, preemption with a grace time) it also checkpoints first."""

    def run(self, spec: dict, config_hash: str) -> str:
        from core.config import TrainJob
        from train.stage import run_stage

        job = TrainJob.model_validate(spec)
        stop = StopRequest()
        requeue = stop.listen()
        rank = int(os.environ.get("RANK", "0"))
        if run_stage(job, stop.event) == "interrupted":
            # The ranks stopped together at one step and the checkpoint is whole (train/callbacks.py).
            if rank != 0:
                return job.run_dir  # rank 0 requeues the whole job; this task just ends
            # No signal of its own: SLURM's USR2 reached only another rank, which stopped us all; the
            # time limit is as near for this rank, so it requeues as for its own USR2.
            if stop.signal in (signal.SIGUSR2, None) and requeue is not None:
                requeue(signal.SIGUSR2, None)  # submitit: checkpoint() → scontrol requeue → exit
            # SIGTERM: SLURM itself requeues (scontrol requeue, preemption) or cancels; progress is saved.
            name = stop.signal.name if stop.signal else "USR2"
            raise RuntimeError(f"{job.experiment}/{job.stage} stopped by {name}; its checkpoint is saved")
        if rank == 0:
            mark_done(Path(job.run_dir), config_hash)
        return job.run_dir


class EvalStage(StageJob):
    """Generate with a saved adapter and score it; reads only the run directory. Each batch's predictions
    are on disk before the next starts (eval/predictions.py), so a requeue, or a rerun after a kill, goes
    on from them. On SLURM's time-limit or preemption signal (USR2) the eval stops after its current batch
    and submitit requeues this same call; on SIGTERM it stops the same way and SLURM requeues or cancels."""

    def run(self, spec: dict, config_hash: str) -> str:
        from core.config import EvalJob
        from eval.job import run_eval

        job = EvalJob.model_validate(spec)
        if skipped_as_pruned(job):
            mark_done(Path(job.out_dir), config_hash)
            return job.out_dir
        stop = StopRequest()
        requeue = stop.listen()
        if run_eval(job, stop.event) is None:
            if stop.signal in (signal.SIGUSR2, None) and requeue is not None:
                requeue(signal.SIGUSR2, None)  # submitit: checkpoint() → scontrol requeue → exit
            name = stop.signal.name if stop.signal else "USR2"
            raise RuntimeError(
                f"{job.experiment}/{job.stage}'s eval stopped by {name}; its predictions are kept"
            )
        mark_done(Path(job.out_dir), config_hash)
        return job.out_dir


class SharedEvalStage(submitit.helpers.Checkpointable):
    """Score several eval jobs of one base model in one process (eval/shared.py run_shared_eval), each into
    its own eval folder, which it holds for its life as EvalStage holds its one, and marks DONE as soon as
    it is scored. A member already DONE (scored by its own job, or before a requeue or a kill) is not
    scored again; a pruned one with `prune.eval_pruned: false` is skipped as EvalStage skips it; one whose
    training did not finish (no DONE there: failed, cancelled, or killed after it wrote its adapter) is not
    scored, and its status says why. On USR2 or TERM it stops after the current batch and requeues as
    EvalStage does: the next run starts at the first member not scored."""

    def __call__(self, specs: list[dict], hashes: list[str], progress: str, workdir: str) -> list[str]:
        from contextlib import ExitStack

        from core.config import EvalJob
        from core.rundir import is_done
        from eval.shared import run_shared_eval

        ready_process(specs[0], workdir)
        jobs = [(EvalJob.model_validate(spec), h) for spec, h in zip(specs, hashes, strict=True)]
        left = [(job, h) for job, h in jobs if not is_done(Path(job.out_dir), h, "eval") and trained(job)]
        hash_of = {job.out_dir: h for job, h in left}
        with ExitStack() as held:
            for job, _ in left:
                refuse_links_in(Path(job.out_dir))
                held.enter_context(hold_folder(Path(job.out_dir), this_job_id()))
            for job, h in [(job, h) for job, h in left if skipped_as_pruned(job)]:
                mark_done(Path(job.out_dir), h)
                left.remove((job, h))
            stop = StopRequest()
            requeue = stop.listen()

            def scored(job, result: dict) -> None:
                if "not_scored" not in result:
                    mark_done(Path(job.out_dir), hash_of[job.out_dir])

            results = run_shared_eval([job for job, _ in left], Path(progress), stop.event, scored)
        if any(result is None for result in results):
            if not stop.event.is_set():  # nothing asked it to stop: a requeue would end the same way
                raise RuntimeError("a shared eval left members unscored without a stop signal")
            if stop.signal in (signal.SIGUSR2, None) and requeue is not None:
                requeue(signal.SIGUSR2, None)  # submitit: checkpoint() → scontrol requeue → exit
            name = stop.signal.name if stop.signal else "USR2"
            raise RuntimeError(f"a shared eval stopped by {name}; its predictions are kept")
        return [job.out_dir for job, _ in jobs]


def trained(job) -> bool:
    """Whether the eval's training finished (its DONE; a base-model eval has no training)."""
    if job.adapter_dir is None:
        return True
    if RunDir.of_adapter(job.adapter_dir).done.exists():
        return True
    log.warning("%s: not scored: its training %s has no DONE", job.out_dir, Path(job.adapter_dir).parent)
    return False


def skipped_as_pruned(job) -> bool:
    """A pruned run whose sweep says `prune.eval_pruned: false` is not evaluated: its results.json says so
    (the eval is then done, and the report shows the run as pruned, without scores)."""
    pruned = RunDir.of_adapter(job.adapter_dir).read_pruned() if job.adapter_dir else {}
    if pruned.get("evaluate") is not False:
        return False
    Path(job.out_dir).mkdir(parents=True, exist_ok=True)
    folder = RunDir(Path(job.out_dir))
    write_json_atomic(folder.results, {"skipped": "pruned (prune.eval_pruned: false)"}, root=folder.run_root)
    return True


class ExportStage(StageJob):
    """Merge a trained stage's adapter into its base, check the merged model against the adapter, write the
    export (eval/export.py); a failed check fails the job with its figures. Idempotent: an export already
    made from the same adapter and settings is skipped."""

    holds_folder = False  # what it publishes carries no lock file; its commit is atomic (EXPORT_DONE)

    def run(self, spec: dict, config_hash: str) -> str:
        from core.config import ExportJob
        from eval.export import eval_inputs, export_stage

        job = ExportJob.model_validate(spec)
        ran = [Path(c) for c in job.eval_configs if Path(c).is_file()]  # an eval never submitted has none
        eval_spec, rows = eval_inputs(ran)
        export_stage(
            Path(job.stage_dir), Path(job.out_dir), eval_spec=eval_spec, eval_rows=rows, gguf=job.gguf
        )
        mark_done(Path(job.out_dir), config_hash)
        return job.out_dir


class StopRequest:
    """Turns SLURM's signals into a flag the trainer checks at each step end."""

    def __init__(self):
        self.event = threading.Event()
        self.signal: signal.Signals | None = None

    def listen(self):
        """Take over USR2 and TERM from submitit; return submitit's USR2 handler (it requeues)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        previous = signal.getsignal(signal.SIGUSR2)
        signal.signal(signal.SIGUSR2, self._ask)
        signal.signal(signal.SIGTERM, self._ask)
        return previous if callable(previous) else None

    def _ask(self, signum, frame) -> None:
        self.signal = signal.Signals(signum)
        log.warning(
            "received %s: stopping at the next step end (training) or batch end (eval)", self.signal.name
        )
        self.event.set()


def _export_distributed_environment() -> int:
    """A job of several tasks (resources.gpus > 1 or nodes > 1: one per GPU on each node) is one DDP run:
    export RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR (loopback on one node; else the first node's NodeAddr,
    slurm/cluster/rendezvous.py), MASTER_PORT (drawn from the job id, so every node and a requeued job meet on the
    same one) for torch's env:// rendezvous; train/device.py then puts rank K on cuda:LOCAL_RANK.
    CUDA_VISIBLE_DEVICES is left as SLURM set it: it may name GPUs 2,3 of the node, not 0,1. Returns
    this task's rank."""
    environment = submitit.JobEnvironment()
    if environment.num_tasks <= 1:
        return 0
    os.environ["MASTER_PORT"] = str(rendezvous_port(environment.job_id))
    exported = submitit.helpers.TorchDistributedEnvironment().export(
        set_cuda_visible_devices=False,
        overwrite=True,  # a RANK inherited from the submitting shell is stale
    )
    if environment.num_nodes == 1:
        # Every rank is on this node: meet on loopback, not on whatever the node's name resolves to (an
        # outside address a closed network or a firewall may drop).
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    else:
        os.environ["MASTER_ADDR"] = _first_node_address()
    return exported.rank


def _first_node_address() -> str:
    """MASTER_ADDR of a job across nodes: submitit's is the first node's *name*, which need not be how
    the nodes reach each other; SLURM's NodeAddr is. The tasks-per-node shape is checked here too."""
    same_on_every_node(tasks_per_node(os.environ.get("SLURM_TASKS_PER_NODE", "1")))
    nodelist = os.environ["SLURM_JOB_NODELIST"]
    hostnames = run_client(["scontrol", "show", "hostnames", nodelist])
    if hostnames is None:  # `n[1-2]` is SLURM's own compression: no guess at its first name
        raise RendezvousError(f"scontrol show hostnames {nodelist} did not answer on this node")
    node = first_node(hostnames)
    os.environ["RENDEZVOUS_NODE"] = node  # for placement_line
    return master_address(node, run_client(["scontrol", "show", "node", node]) or "")


def placement_line(env=os.environ) -> str:
    """Who is rank 0 where, and where this task is: the first line to read when ranks do not meet."""
    return (
        f"rank 0 of {env.get('WORLD_SIZE')} is on {env.get('RENDEZVOUS_NODE')} "
        f"({env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}); this task is rank {env.get('RANK')} on "
        f"{env.get('SLURMD_NODENAME', '?')}, node {env.get('SLURM_NODEID')} of "
        f"{env.get('SLURM_JOB_NUM_NODES')}, {gpus_on_node(env.get('SLURM_GPUS_ON_NODE')) or 0} GPU(s) there"
    )


def _use_allocated_cpus() -> None:
    """Math threads = the CPUs SLURM gave this job. More threads than cores (torch defaults to every core
    of the node) makes OpenMP threads of neighbouring jobs spin against each other: 10x slower steps."""
    cpus = os.environ.get("SLURM_CPUS_PER_TASK") or os.environ.get("SLURM_CPUS_ON_NODE")
    tasks = int(os.environ.get("WORLD_SIZE", "1"))
    if not cpus and tasks > 1:  # the local backend's ranks share this machine's cores
        cpus = str(max(1, (os.cpu_count() or 1) // tasks))
    if cpus:
        os.environ.setdefault("OMP_NUM_THREADS", cpus)
        os.environ.setdefault("MKL_NUM_THREADS", cpus)


def _configure_logging(rank: int = 0) -> None:
    # Each task has its own log file (`--tail EXP/STAGE --rank K`); the rank in each line tells merged
    # copies apart.
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"
    )
