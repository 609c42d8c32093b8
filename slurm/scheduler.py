"""One adapter from a run folder's job record (job.json) to submitit's own view of that job.

submitit knows where a job's files are (`JobPaths`: log, pickled call, result) and how to cancel it; we
rebuild its `SlurmJob` / `LocalJob` from the record and ask it, instead of writing those facts again. What
submitit lacks stays here: whether a recorded local process is still ours (its `LocalJob.cancel` needs the
`Popen` handle, which only the launching process holds) and a failed local job's reason.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import submitit
from submitit.core.utils import pickle_load

EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*: ")  # "ValueError: ...", "torch.OutOfMemoryError: ..."


def scheduler_job(log_root: str, plan_id: str, record: dict) -> submitit.Job:
    """The submitit job behind a job.json record; its log folder is `log_root/EXP/STAGE`."""
    folder = Path(log_root) / plan_id
    if record.get("backend") == "local":
        return submitit.LocalJob(folder, str(record["job_id"]))
    return submitit.SlurmJob(folder, str(record["job_id"]))


def cancel(jobs: list[submitit.Job]) -> None:
    """SLURM jobs through submitit (scancel); local ones by interrupting their controller process, as
    submitit's LocalJob.cancel does (it stops the job's tasks and exits)."""
    for job in jobs:
        if isinstance(job, submitit.LocalJob):
            if local_alive(job):
                os.kill(int(job.job_id), signal.SIGINT)
        else:
            job.cancel(check=False)


def local_alive(job: submitit.LocalJob) -> bool:
    """The recorded pid still runs submitit's controller for this job's folder (a pid can be reused by an
    unrelated process once the job ended: that one must neither count as running nor be signalled)."""
    try:
        os.kill(int(job.job_id), 0)
    except (ValueError, OSError):
        return False
    command = _command_line(job.job_id)
    return "submitit" in command and str(job.paths.folder) in command


def _command_line(pid: str) -> str:
    proc = Path(f"/proc/{pid}/cmdline")
    if proc.exists():
        return proc.read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
    done = subprocess.run(["ps", "-o", "command=", "-p", pid], capture_output=True, text=True, check=False)
    return done.stdout


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
