"""One launch at a time per run root: an exclusive `flock` on `RUN_DIR/.launch.lock`.

Held from the first decision (what is done, what is queued) to the last submission, and by a local run
until its jobs end: a second launch would otherwise decide from the same state and submit every job
again. A second launch waits for the first (saying who holds the lock), then decides from what the first
one queued. The kernel drops the lock when its holder exits, however it exits: no stale lock to clean up.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from core.files import open_lock
from core.rundir import RunRoot


@contextmanager
def launch_lock(run_root: Path, on_wait: Callable[[str], None]) -> Iterator[None]:
    """Hold the run root's launch lock; `on_wait(holder)` is called once if another launch has it."""
    run_root.mkdir(parents=True, exist_ok=True)
    with open_lock(RunRoot.of(run_root).launch_lock) as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait(holder(fh))
            fcntl.flock(fh, fcntl.LOCK_EX)
        fh.seek(0)
        fh.truncate(0)
        fh.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        fh.flush()
        try:
            yield
        finally:
            fh.truncate(0)
            fcntl.flock(fh, fcntl.LOCK_UN)


def holder(fh) -> str:
    """Who holds the lock, as its holder wrote it ("pid 123 on login1 since 2026-01-02 10:00:00")."""
    fh.seek(0)
    return fh.read().strip() or "another launch (it has not written its name yet)"
