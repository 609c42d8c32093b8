"""One adapter from a run folder's job record (job.json) to submitit's own view of that job.

submitit knows where a job's files are (`JobPaths`: log, pickled call, result) and how to cancel a SLURM
job; we rebuild its `SlurmJob` / `LocalJob` from the record and ask it, instead of writing those facts
again. What submitit lacks stays here: whether a recorded local process is still ours (its controller,
or a task of it still holding its run folder after the controller was killed), stopping it for
sure (its `LocalJob.cancel` needs the `Popen` handle, which only the launching process holds, and sends
one SIGINT, which a process started in the background by a script ignores), a failed local job's reason,
and finding in the queue a job whose submission was never recorded (by the token of its comment).
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import submitit
from submitit.core.utils import pickle_load

from core.config import ascii_int
from core.files import read_window
from core.job_records import JobRecord, current_job, mark_cancelled
from core.rundir import LogRoot, log_folder
from core.writer_lock import holder
from slurm.cluster.client import run_client

EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*: ")  # "ValueError: ...", "torch.OutOfMemoryError: ..."
COMMENT_MARK = "slurm-lora"  # a job's SLURM comment: "slurm-lora TOKEN WHAT" (slurm/queueing/backends.py)
# How a local job is stopped: each signal in turn, until its processes are gone. SIGINT ends the tasks
# (their controller then ends cleanly); SIGTERM makes a trainer checkpoint at its step end and return
# (slurm/queueing/jobs.py); SIGKILL is for what ignores both (a job started with SIGINT ignored, as a script's `&`
# does, whose trainer is stuck in one long step).
STOP_STEPS = ((signal.SIGINT, 10.0), (signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0))
RECORD_TIME = "%Y-%m-%dT%H:%M:%S"  # core/job_records.py TIME_STAMP


class RecordedLocalJob(submitit.LocalJob):
    """A local job known from its record (another launch started it): it runs while its pid is still its
    submitit controller, or while its task still holds `run_dir` (orphaned_task); `submitted_at` (when
    the launcher recorded it) tells a reused pid from it."""

    def __init__(
        self, folder: Path, job_id: str, submitted_at: str | None = None, run_dir: Path | None = None
    ):
        super().__init__(folder, job_id)
        self.submitted_at, self.run_dir = submitted_at, run_dir

    def done(self, force_check: bool = False) -> bool:
        return not local_alive(self)


def scheduler_job(log_root: str, plan_id: str, record: JobRecord, run_dir: Path) -> submitit.Job:
    """The submitit job behind `run_dir`'s job.json record; its log folder is `log_root/EXP/STAGE`, or
    the arrays' folder for a task of a job array, the shared evals' for an eval scored by one (a folder
    for many jobs: slurm/queueing/backends.py)."""
    if record.array:
        folder = LogRoot.of(log_root).arrays
    elif record.shared:
        folder = LogRoot.of(log_root).shared_evals
    else:
        folder = log_folder(log_root, plan_id)
    if record.local:
        return RecordedLocalJob(folder, record.job_id, record.submitted_at, Path(run_dir))
    return submitit.SlurmJob(folder, record.job_id)


def cancel(jobs: list[submitit.Job]) -> list[str]:
    """SLURM jobs through submitit (scancel); local ones by stopping their processes (stop_local).
    Returns the ids of the local jobs that still run after every signal (not ours to kill)."""
    still = []
    for job in jobs:
        if isinstance(job, submitit.LocalJob):
            if local_alive(job) and not stop_local(job):
                still.append(str(job.job_id))
        else:
            job.cancel(check=False)
    return still


def cancel_rows(rows, log_root: str) -> list[str]:
    """The status rows' jobs, through submitit (scancel), or by stopping the local processes for sure, as
    each job.json record says; returns the plan ids of local jobs whose processes still run after every
    signal. A local job is noted cancelled first: its launcher, if alive, then sees it cancelled, not
    failed, and starts nothing new; so is an array task."""
    records = {r.job.id: current_job(Path(r.job.run_dir)) for r in rows}
    for row in rows:
        # A local job leaves no scheduler record, nor does an array task cancelled before it started
        # (SLURM's accounting never gets one): job.json notes the cancellation for --status.
        if (record := records[row.job.id]).local or record.array:
            mark_cancelled(Path(row.job.run_dir), record.job_id)
    jobs = {r.job.id: scheduler_job(log_root, r.job.id, records[r.job.id], Path(r.job.run_dir)) for r in rows}
    still = set(cancel(list(jobs.values())))
    return [job_id for job_id, job in jobs.items() if str(job.job_id) in still]


def local_alive(job: submitit.LocalJob) -> bool:
    """The job still runs: its controller, or a task of it whose controller is gone (orphaned_task)."""
    return controller_alive(job) or orphaned_task(job) is not None


def controller_alive(job: submitit.LocalJob) -> bool:
    """The recorded pid still runs submitit's controller for this job's folder, started before the job was
    recorded (a pid can be reused once the job ended: that process must neither count nor be signalled)."""
    pid = _pid(job.job_id)
    if pid is None or gone(pid):
        return False
    command = _command_line(pid)
    if "submitit" not in command or str(job.paths.folder) not in command:
        return False
    started, recorded = start_time(pid), _epoch(getattr(job, "submitted_at", None))
    # The record is written once the controller runs: a process started well after it is another one
    # (the margin absorbs the record's whole seconds and a clock set forward since).
    return started is None or recorded is None or started <= recorded + 60


def orphaned_task(job: submitit.LocalJob) -> int | None:
    """The pid of the job's task that still holds its run folder (core/writer_lock.py) although its
    controller is gone: tasks now die with their controller (slurm/queueing/jobs.py die_with_controller), but one
    started by older code, or on a system without parent-death signals, trains on. It counts when the
    folder's live holder is this job (its record's job id), on this host, and runs this job's task
    (submitit's `_submit` of its log folder: a reused pid does not)."""
    run_dir = getattr(job, "run_dir", None)
    if run_dir is None or controller_alive(job):
        return None
    held = holder(run_dir)
    if held is None or not held.here or held.job_id != str(job.job_id) or gone(held.pid):
        return None
    command = _command_line(held.pid)
    return held.pid if "submitit" in command and str(job.paths.folder) in command else None


def stop_local(job: submitit.LocalJob) -> bool:
    """Stop a local job's controller and every process under it, or its orphaned task and every process
    under that: SIGINT, SIGTERM, then SIGKILL, each followed by a bounded wait that polls the processes.
    True once they are all gone."""
    orphan = orphaned_task(job)
    return stop_tree(int(job.job_id) if orphan is None else orphan)


def stop_tree(root: int) -> bool:
    """Stop `root` (a controller, or an orphaned task) and every process under it (see STOP_STEPS)."""
    seen: set[int] = set()
    for signum, grace_s in STOP_STEPS:
        tree = [root, *descendants(root)]
        seen.update(tree)
        # SIGINT to the processes under the controller, as a terminal's Ctrl-C reaches them: it sees its
        # tasks end and exits without a traceback. The controller itself only once it has none left.
        targets = (tree[1:] if signum == signal.SIGINT else tree) or tree
        targets = [pid for pid in targets if not gone(pid)]
        for pid in targets:
            _send(pid, signum)
        if targets and all(ignores(pid, signum) for pid in targets):
            continue  # nothing to wait for (SIG_IGN, inherited from a launcher started with `&`)
        if wait_gone(seen, grace_s):
            return True
    return wait_gone(seen, 0)


def wait_gone(pids, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if all(gone(pid) for pid in pids):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _send(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
        os.kill(pid, signum)


def _pid(job_id: str) -> int | None:
    pid = ascii_int(job_id)
    return pid if pid else None


def _threads_exiting(pid: int) -> bool:
    """Whether a thread of `pid` other than a zombie is still listed (/proc/PID/task)."""
    try:
        threads = [t.name for t in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return False
    for thread in threads:
        try:
            text = Path(f"/proc/{pid}/task/{thread}/stat").read_text()
        except OSError:
            continue
        if text[text.rfind(")") + 2 :].split()[:1] not in (["Z"], ["X"]):
            return True
    return False


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat from field 3 (state) on; None when it cannot be read (no such process, not Linux)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def gone(pid: int) -> bool:
    """No such process, or a zombie (it ended; its parent has not collected it yet). A process whose main
    thread is a zombie while another of its threads still exits is not gone: it still holds its files and
    their locks (/proc/PID/stat shows the main thread's state alone; a killed trainer's folder read as held
    right after it read as gone)."""
    fields = _stat(pid)
    if fields is not None:
        return fields[0] in ("Z", "X") and not _threads_exiting(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return _ps(["stat="], pid).startswith("Z")


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (children first)."""
    parents = _parents()
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _parents() -> dict[int, int]:
    if Path("/proc/self/stat").exists():
        parents = {}
        for entry in Path("/proc").iterdir():
            if (pid := ascii_int(entry.name)) and (fields := _stat(pid)):
                parents[int(entry.name)] = int(fields[1])
        return parents
    rows = (line.split() for line in _ps(["pid=", "ppid="]).splitlines())
    return {int(row[0]): int(row[1]) for row in rows if len(row) == 2}


def start_time(pid: int) -> float | None:
    """When the process started (seconds since the epoch), or None when this system does not say."""
    fields = _stat(pid)
    if fields is None:
        started = _ps(["lstart="], pid).strip()
        try:
            return time.mktime(time.strptime(started, "%a %b %d %H:%M:%S %Y"))
        except ValueError:
            return None
    try:
        boot = next(line for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime"))
    except (OSError, StopIteration):
        return None
    return int(boot.split()[1]) + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def ignores(pid: int, signum: int) -> bool:
    """The process has `signum` set to SIG_IGN (Linux says so in /proc/PID/status; elsewhere: no)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), "0")
    return bool(int(mask, 16) >> (signum - 1) & 1)


def _epoch(stamp: str | None) -> float | None:
    try:
        return time.mktime(time.strptime(stamp, RECORD_TIME)) if stamp else None
    except (TypeError, ValueError):
        return None


def _ps(fields: list[str], pid: int | None = None) -> str:
    which = ["-p", str(pid)] if pid is not None else ["-A"]
    try:
        done = subprocess.run(
            ["ps", *which, "-o", ",".join(fields)], capture_output=True, text=True, errors="replace"
        )
    except OSError:
        return ""
    return done.stdout


def _command_line(pid: int) -> str:
    proc = Path(f"/proc/{pid}/cmdline")
    try:
        return proc.read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return _ps(["command="], pid)


def local_failure(job: submitit.LocalJob) -> str:
    """Why an ended local job did not complete: the last line of its exception (submitit pickles the
    traceback as the job's result), or that it left no result at all (killed, cancelled)."""
    try:
        outcome, value = pickle_load(job.paths.result_pickle)
    except (OSError, EOFError, ValueError, ImportError, AttributeError):
        return "ended without a result (killed or cancelled)"
    if outcome != "error":
        return ""
    # The exception's own line ("ValueError: ..."), not the last line of a multi-line message.
    heads = [line for line in str(value).splitlines() if EXCEPTION_LINE.match(line)]
    return heads[-1].strip() if heads else "failed (see the log)"


# The line slurm/queueing/jobs.py StopRequest logs when the time-limit signal (USR2) arrives: submitit's local
# controller sends it signal_delay_s before the job's limit, as SLURM does.
TIME_LIMIT_LINE = b"received SIGUSR2"
LOG_TAIL_BYTES = 1 << 20  # a job's log is read from its end, bounded


def reached_time_limit(job: submitit.LocalJob) -> bool:
    """An ended local job without a result whose log says the time-limit signal came: it was stopped at
    its limit (before: "ended without a result (killed or cancelled)", though its log had the signal)."""
    if job.paths.result_pickle.exists():
        return False
    try:  # bounded, and a FIFO at the log is never waited on (core/files.py read_window)
        return TIME_LIMIT_LINE in read_window(Path(job.paths.stdout), None, LOG_TAIL_BYTES)[0]
    except OSError:
        return False


def queued_by_token() -> dict[str, str] | None:
    """Token → SLURM job id of this user's queued jobs whose comment carries one, in one squeue call;
    {} where SLURM is not installed (nothing can be queued), None when squeue does not answer."""
    if not shutil.which("squeue"):
        return {}
    text = run_client(["squeue", "-h", "-r", "-u", getpass.getuser(), "-o", "%i|%k"])
    return None if text is None else parse_comments(text)


def parse_comments(text: str) -> dict[str, str]:
    """`squeue -h -o %i|%k` output → token → job id, for the comments slurm/queueing/backends.py writes."""
    found = {}
    for line in text.splitlines():
        job_id, _, comment = line.partition("|")
        words = comment.split(" ", 2)
        if len(words) >= 2 and words[0] == COMMENT_MARK and job_id.strip():
            found[words[1]] = job_id.strip()
    return found
