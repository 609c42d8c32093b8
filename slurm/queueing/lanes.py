"""What a packed allocation runs on its node: G lanes, one GPU each, working through the plan's units.

One process (the allocation's only task) keeps the units' dependencies in memory and starts each unit as
a child process that sees only its lane's GPU (CUDA_VISIBLE_DEVICES) and runs exactly what a separate
job would (slurm/queueing/unit.py → TrainStage / EvalStage), with its log where a separate job's would be. Every
unit keeps its own run directory and DONE; `lane.json` beside them says which lane ran it and how it
ended, for --status. Why one process and not one SLURM task per lane: lanes claim units dynamically and
must agree on who runs what; one scheduler in one process needs no locks or shared files to agree.

A free lane claims the ready unit with the longest estimate (slurm/planning/pack.py simulates the same rule). A
unit that fails blocks the units that need its adapter (afterok); the other lanes go on. On SLURM's USR2
(time limit, preemption) or SIGTERM every running unit is told to checkpoint; once all have ended, the
allocation requeues itself; on restart, units with a DONE are skipped and interrupted ones resume.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import submitit
from submitit.core.utils import JobPaths

from core.devices import visible_devices
from core.files import open_append, write_atomic
from core.redact import redact_job_output
from core.rundir import RunDir, is_done, read_lane
from core.states import State, lane_state, parent_verdict
from slurm.planning.pack import Unit
from slurm.queueing.jobs import StopRequest, _configure_logging

log = logging.getLogger("slurm.queueing.lanes")
# How often the lanes look at their children: a lane idles at most this long after its unit ends. (A
# SIGCHLD handler would wake them at once, but setting an Event from a signal handler can deadlock.)
POLL_S = 0.25
STOP_GRACE_S = 30  # default time a unit has to checkpoint after the stop before it is killed


def lane_devices(lanes: int) -> list[str]:
    """The GPU each lane binds its units to: the allocation's own (SLURM sets CUDA_VISIBLE_DEVICES to the
    GPUs it gave, e.g. "2,3,5,6"; read as CUDA reads it), else 0..lanes-1 (a machine without SLURM's GPU
    binding)."""
    given = visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    if len(given) >= lanes:
        return list(given[:lanes])
    return [str(k) for k in range(lanes)]


def outside_failed(unit: Unit) -> list[str]:
    """The unit's afterok parents outside the pack (queued separately, which the allocation waited for
    with afterany) that did not complete: it needs their adapters, so it is blocked."""
    return [
        parent.id
        for parent in unit.outside
        if parent.kind == "afterok" and not is_done(Path(parent.run_dir), parent.config_hash, parent.job_kind)
    ]


def lane_cpus(allowed: list[int], lanes: int) -> list[list[int]]:
    """Each lane's own cores, split evenly from the allocation's (a unit then sizes its threads and data
    workers to its lane, not to the whole allocation, and lanes never compete for a core); with fewer
    cores than lanes, lanes share them round-robin."""
    if len(allowed) < lanes:
        return [[allowed[k % len(allowed)]] for k in range(lanes)]
    share = len(allowed) // lanes
    return [allowed[k * share : (k + 1) * share] for k in range(lanes)]


class PackJob(submitit.helpers.Checkpointable):
    """The body of a packed allocation. Requeued by submitit's Checkpointable like a training stage."""

    def __call__(
        self, units: list[Unit], lanes: int, workdir: str, grace_s: float = STOP_GRACE_S
    ) -> dict[str, str]:
        code_folder = os.getcwd()  # the launch's code snapshot: the units import the same code
        os.chdir(workdir)
        redact_job_output()
        _configure_logging()
        stop = StopRequest()
        requeue = stop.listen()
        job_id = submitit.JobEnvironment().job_id
        outcome = Lanes(units, lane_devices(lanes), job_id, code_folder, workdir).run(stop, grace_s)
        if State.PENDING in outcome.values():  # stopped midway: resumes when requeued
            if stop.signal in (signal.SIGUSR2, None) and requeue is not None:
                requeue(signal.SIGUSR2, None)  # submitit: checkpoint() → scontrol requeue → exit
            raise RuntimeError(
                f"the pack stopped by {stop.signal.name if stop.signal else 'USR2'}; units saved"
            )
        failed = sorted(k for k, v in outcome.items() if v in (State.FAILED, State.BLOCKED))
        if failed:
            raise RuntimeError(f"{len(failed)} unit(s) did not complete: {', '.join(failed)}")
        return {uid: state.value for uid, state in outcome.items()}


class Lanes:
    def __init__(self, units: list[Unit], devices: list[str], job_id: str, code_folder: str, workdir: str):
        self.units = {unit.id: unit for unit in map(Unit.of, units)}
        self.devices, self.job_id = devices, job_id
        self.code_folder, self.workdir = code_folder, workdir
        self.state: dict[str, State] = {}  # unit id → COMPLETED | FAILED | BLOCKED | PENDING (stopped)
        self.running: dict[str, tuple[subprocess.Popen, int]] = {}
        self.started: dict[str, float] = {}  # unit id → time.time() at its start, in this allocation
        # Math threads per unit: its lane's share of the CPUs SLURM granted. Units are pinned to their
        # lane's cores only when SLURM bound the allocation to exactly those (else they may be anyone's).
        allowed = sorted(os.sched_getaffinity(0))
        granted = int(os.environ.get("SLURM_CPUS_PER_TASK") or len(allowed))
        self.cpus = lane_cpus(allowed, len(devices)) if len(allowed) == granted else []
        self.threads = max(1, granted // len(devices))

    def run(self, stop: StopRequest, grace_s: float = STOP_GRACE_S) -> dict[str, State]:
        self.resume_states()
        log.info(
            "%d unit(s) on %d lane(s) (GPUs %s)", len(self.units), len(self.devices), ",".join(self.devices)
        )
        while True:
            self.reap(stopping=stop.event.is_set())
            if stop.event.is_set():
                return self.stop_all(stop, grace_s)
            self.block_orphans()
            self.start_ready()
            if not self.running:
                return {uid: self.state.get(uid, State.BLOCKED) for uid in self.units}
            stop.event.wait(POLL_S)

    def resume_states(self) -> None:
        """On a (re)start: units with a DONE never run twice; units that failed or were blocked in an
        earlier run of this same allocation stay so (a failure is rarely cured by a requeue; --retry-failed
        is the way); a record left `running` by a killed allocation says the unit waits again."""
        for uid, unit in self.units.items():
            run_dir = Path(unit.run_dir)
            if is_done(run_dir, unit.config_hash, unit.kind):
                self.state[uid] = State.COMPLETED
                continue
            lane = read_lane(run_dir)
            if str(lane.get("pack_job")) != str(self.job_id):
                continue
            said = lane_state(lane.get("state"))
            if said in (State.FAILED, State.BLOCKED):
                self.state[uid] = said
            elif said in (State.RUNNING, State.PENDING):
                self.write_lane(unit, None, State.PENDING, "requeued: waits for a lane")

    def ready(self) -> list[dict]:
        def parent_ended(job_id: str, kind: str) -> bool:
            if job_id not in self.units:
                return True  # outside the pack: ended before it started (afterok ones: see outside_failed)
            return parent_verdict(kind, self.state.get(job_id)) is State.PENDING

        waiting = [u for uid, u in self.units.items() if uid not in self.state and uid not in self.running]
        ready = [u for u in waiting if all(parent_ended(j, k) for j, k in u.depends_on)]
        return sorted(ready, key=lambda u: u.seconds, reverse=True)

    def block_orphans(self) -> None:
        """A unit whose adapter parent failed or was blocked can never run (afterok), as SLURM would say."""
        changed = True
        while changed:
            changed = False
            for uid, unit in self.units.items():
                if uid in self.state or uid in self.running:
                    continue
                bad = [
                    f"{j} {self.state[j].value}"
                    for j, k in unit.depends_on
                    if parent_verdict(k, self.state.get(j)) is State.BLOCKED
                ] + [f"{j} did not complete" for j in outside_failed(unit)]
                if bad:
                    self.state[uid] = State.BLOCKED
                    self.write_lane(unit, None, State.BLOCKED, f"parent {bad[0]}")
                    log.warning("%s blocked: parent %s", uid, bad[0])
                    changed = True

    def start_ready(self) -> None:
        busy = {lane for _, lane in self.running.values()}
        free = [lane for lane in range(len(self.devices)) if lane not in busy]
        for unit, lane in zip(self.ready(), free, strict=False):  # as many as there are free lanes
            self.running[unit.id] = (self.start(unit, lane), lane)
            self.started[unit.id] = time.time()
            self.write_lane(unit, lane, State.RUNNING)
            log.info("lane %d (GPU %s): started %s", lane, self.devices[lane], unit.id)

    def start(self, unit: Unit, lane: int) -> subprocess.Popen:
        folder = Path(unit.log_folder).absolute()  # the unit's process starts in the code snapshot
        log_root = unit.root_of(unit.log_folder)  # made, and reached, without following a link below it
        order = folder / f"{self.job_id}_unit.json"  # what the unit runs; read by slurm/queueing/unit.py
        write_atomic(order, unit.order(self.workdir), root=log_root)
        env = {
            **os.environ,
            # A CPU job (gpus: 0) in a lane sees no GPU, as it would in its own allocation.
            "CUDA_VISIBLE_DEVICES": self.devices[lane] if unit.gpus else "",
            "OMP_NUM_THREADS": str(self.threads),
            "MKL_NUM_THREADS": str(self.threads),
            "LORA_PACK_LANE": str(lane),
        }
        if self.cpus:
            env["LORA_PACK_CPUS"] = ",".join(map(str, self.cpus[lane]))
        # Where a separate job's log would be (`--tail`, --status and the report find it unchanged).
        logfile = open_append(JobPaths(folder, self.job_id, task_id=0).stdout, binary=True, root=log_root)
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "slurm.queueing.unit", str(order)],
                cwd=self.code_folder,
                env=env,
                stdout=logfile,
                stderr=subprocess.STDOUT,
            )
        finally:
            logfile.close()  # the child holds its own copy

    def reap(self, stopping: bool = False) -> None:
        for uid, (child, lane) in list(self.running.items()):
            code = child.poll()
            if code is not None:
                del self.running[uid]
                self.ended(uid, lane, code, stopping)

    def ended(self, uid: str, lane: int, code: int, stopping: bool) -> None:
        unit = self.units[uid]
        if is_done(Path(unit.run_dir), unit.config_hash, unit.kind):
            # A pruned unit ends at its rung: its lane takes the next unit at once, as for any end.
            ended = State.PRUNED if RunDir(Path(unit.run_dir)).read_pruned() else State.COMPLETED
            self.state[uid] = ended
            self.write_lane(unit, lane, ended)
            log.info("lane %d: %s %s", lane, uid, "pruned" if ended is State.PRUNED else "done")
        elif stopping or code in (-signal.SIGUSR2, -signal.SIGTERM):
            # Stopped, not broken: SLURM's signal reaches every process of the allocation, and a unit
            # that was still starting dies of it; an eval stops after its batch, its predictions kept.
            self.state[uid] = State.PENDING
            self.write_lane(unit, lane, State.PENDING, "stopped; resumes when the allocation is requeued")
            log.warning("lane %d: %s stopped (exit code %s)", lane, uid, code)
        else:
            self.state[uid] = State.FAILED
            self.write_lane(unit, lane, State.FAILED, f"exit code {code}, see its log")
            log.error("lane %d: %s failed (exit code %s)", lane, uid, code)

    def stop_all(self, stop: StopRequest, grace_s: float) -> dict[str, State]:
        """Tell every running unit to checkpoint (the signal this process got) and wait for them; one that
        has not stopped after `grace_s` is killed (its last checkpoint stays), so the allocation still
        requeues before SLURM's own kill."""
        sent = stop.signal or signal.SIGUSR2
        log.warning("%s: %d running unit(s) checkpoint and stop", sent.name, len(self.running))
        for child, _ in self.running.values():
            child.send_signal(sent)
        deadline = time.monotonic() + grace_s
        for uid, (child, lane) in list(self.running.items()):
            try:
                code = child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error(
                    "lane %d: %s did not stop within %.0f s of %s: killed", lane, uid, grace_s, sent.name
                )
                child.kill()
                code = child.wait()
            self.ended(uid, lane, code, stopping=True)
        self.running.clear()
        return {uid: self.state.get(uid, State.PENDING) for uid in self.units}

    def write_lane(self, unit: Unit, lane: int | None, state: State, reason: str = "") -> None:
        started = self.started.get(unit.id)
        record = {
            "pack_job": self.job_id,
            "lane": lane,
            "gpu": self.devices[lane] if lane is not None else None,
            "state": state.value,
            "reason": reason,
            "at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            # epoch seconds of this allocation's run of the unit: lane use and estimate error (bench/)
            "started_s": started,
            "ended_s": time.time() if started is not None and state is not State.RUNNING else None,
        }
        write_atomic(RunDir(Path(unit.run_dir)).lane, json.dumps(record), root=unit.root_of(unit.run_dir))
