"""One writer per run folder: a training (or eval) job holds its folder exclusively for its life, and a
second one refuses to start, naming the first (`FolderHeld`: host, pid, job id, since when).

What is held: a POSIX record lock (`fcntl.lockf`, i.e. fcntl F_SETLK) over the whole of FOLDER/.writer.lock,
taken by the job's rank 0 before it writes anything and kept until its process ends. Beside it,
FOLDER/.writer.json names the holder; the lock, not that file, says whether a holder is alive.

- Released by the kernel when the process ends, however it ends (kill -9, the OOM killer, a segfault):
  no stale lock to clean up on a local disk.
- Shared filesystems: POSIX locks are the locks NFS carries between nodes (v3 through lockd/NLM, v4 in the
  protocol itself, with the server as the arbiter; Linux's flock() is only emulated by them there) and
  Lustre carries with the `-o flock` mount option. Limits:
  - Lustre `-o localflock`: each node sees only its own locks, so the rule holds between the jobs of one
    node only; without either option (`noflock`) locking fails, and the job warns and runs unguarded
    (status then knows the job by its controller only). NFS mounted `nolock` is like `localflock`.
  - A node that dies holding the lock: NFSv4's server releases it when the node's lease lapses (90 s
    by default), Lustre when it evicts the node; NFSv3 only when the node comes back (statd). A requeue
    of the same job (the same id in the holder record) waits up to REQUEUE_WAIT_S for it; past that it
    refuses like any second job. Removing .writer.lock frees the folder (a new file, a new lock), for
    when the named holder is surely dead.
  - A network partition longer than the lease: the server drops the lock although its holder may still
    run; another job can then start. The cut-off holder cannot write meanwhile, and Linux fails its
    further use of the lost lock with EIO, but not its writes of other files once the link is back:
    SLURM's own node-failure handling (the node is set down and its jobs killed) is what ends it.
- Ranks: only rank 0 holds the lock (it is the one that writes the folder). Every rank of a job carries
  the same job id, so the other ranks only check that no *other* job holds the folder, and refuse
  like rank 0 if one does (rather than wait for a rendezvous rank 0 will never join). A shared lock on
  every rank cannot work: a second job's ranks would share it as well.
- A POSIX lock belongs to the process: closing *any* descriptor of the file in that process releases
  it, so the holding process opens .writer.lock once, and nothing else in it opens that file. Readers in
  other processes (`holder`) test the lock by taking it shared for an instant; the holder-to-be retries
  for PROBE_GRACE_S so that such a test never makes a job refuse.

Standard library only: the launcher (`--status`, `--cancel`, a relaunch) and the jobs both use it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from core.files import open_lock, read_json, write_json_atomic
from core.rundir import RunDir

log = logging.getLogger(__name__)

PROBE_GRACE_S = 1.0  # a reader's test holds the lock for microseconds (milliseconds over NFS)
REQUEUE_WAIT_S = 150.0  # above NFSv4's default 90 s lease, for a requeue after its node died
# Rank 0 records itself right after it locks; another rank that probes in between waits this long for the
# record before it takes the holder for another job's.
RECORD_GRACE_S = 10.0
RETRY_S = 0.05
UNSUPPORTED = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}
HOLDER_FIELDS = {"host": str, "pid": int, "job_id": str, "since": str}


class FolderHeld(RuntimeError):
    """Another job holds the run folder; the message names it and says what to do."""


@dataclass(frozen=True)
class Holder:
    """Who holds a run folder, as its holder recorded it."""

    host: str = "?"
    pid: int = 0
    job_id: str | None = None
    since: str = "?"

    @property
    def here(self) -> bool:
        return self.host == socket.gethostname()

    def __str__(self) -> str:
        if not self.pid:  # locked, but not yet (or never) recorded
            return "a process that has not said who it is yet"
        job = f"job {self.job_id}, " if self.job_id else ""
        return f"{job}pid {self.pid} on {self.host}, since {self.since}"


def lock_path(folder: Path) -> Path:
    return RunDir(Path(folder)).writer_lock


def holder_path(folder: Path) -> Path:
    return RunDir(Path(folder)).writer


def recorded_holder(folder: Path) -> Holder | None:
    """What .writer.json says (the last holder, alive or not); None without one."""
    raw = read_json(holder_path(folder), {}, expected=dict, fields=HOLDER_FIELDS)
    if "pid" not in raw:
        return None
    return Holder(raw.get("host", "?"), raw["pid"], raw.get("job_id"), raw.get("since", "?"))


def holder(folder: Path) -> Holder | None:
    """The live holder of `folder`, or None when nobody holds it, or when its filesystem has no locks
    (then nothing can be known). Never call it from the process that holds the folder (see above)."""
    try:
        fd = os.open(lock_path(folder), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # no lock file: never held (or not a file we may open)
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return recorded_holder(folder) or Holder()
        return None
    finally:
        os.close(fd)  # releases the instant's shared lock with it
    return None


@contextmanager
def hold_folder(folder: Path, job_id: str | None = None, rank: int = 0) -> Iterator[None]:
    """Hold `folder` for the block's life (rank 0), or check that no other job holds it (other ranks).
    Raises FolderHeld naming the holder."""
    folder = Path(folder)
    if rank != 0:
        other, started = holder(folder), time.monotonic()
        # Locked but not yet recorded as this job: most likely this job's rank 0 between its lock and its
        # record, the record still empty (seen on the two-node dev cluster: rank 1 of a requeued run refused
        # its own job's folder) or still a dead job's (a killed controller's: M2, --retry-failed refused).
        while (
            other is not None
            and (not other.pid or (job_id is not None and other.job_id != job_id))
            and time.monotonic() - started < RECORD_GRACE_S
        ):
            time.sleep(RETRY_S)
            other = holder(folder)
        if other is not None and (job_id is None or other.job_id != job_id):
            raise held(folder, other)
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    with open_lock(lock_path(folder)) as fh:
        locked = take(fh, folder, job_id)
        if locked:
            write_json_atomic(holder_path(folder), record(job_id), indent=1)
        try:
            yield
        finally:
            if locked:  # the record goes first, while it is still ours
                holder_path(folder).unlink(missing_ok=True)
                fcntl.lockf(fh, fcntl.LOCK_UN)


def take(fh, folder: Path, job_id: str | None) -> bool:
    """Lock; True once held, False where the filesystem has no locks (warned). A holder of another job
    is refused after PROBE_GRACE_S; an earlier run of this same job is waited for (REQUEUE_WAIT_S)."""
    started = time.monotonic()
    while True:
        try:
            fcntl.lockf(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno in UNSUPPORTED:
                log.warning(
                    "%s cannot be locked (%s): one writer per folder is not enforced on this filesystem "
                    "(Lustre: mount with -o flock)",
                    lock_path(folder),
                    exc.strerror,
                )
                return False
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        other = recorded_holder(folder)
        same_job = job_id is not None and other is not None and other.job_id == job_id
        if time.monotonic() - started > (REQUEUE_WAIT_S if same_job else PROBE_GRACE_S):
            raise held(folder, other or Holder())
        time.sleep(RETRY_S)


def record(job_id: str | None) -> dict:
    body = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    return {**body, **({"job_id": job_id} if job_id else {})}


def held(folder: Path, other: Holder) -> FolderHeld:
    return FolderHeld(
        f"{folder} is held by another job ({other}), which still runs: a second one would write the "
        "same files; wait for it to end, or stop it (launch.py --cancel --exp EXP) and relaunch"
    )
