"""A safe path below a root (the run root, the log root, a cache): every write under one goes through here.

The launch refuses links below the roots once (slurm/cli.py refuse_links), and a job once more at its start
(slurm/queueing/jobs.py refuse_links_in); a link planted later (`runs/.rungs` -> elsewhere, a stage's
`checkpoints/` -> elsewhere, while the job trains) must not be followed either. So a write is made safe at
the moment it happens: the folder is reached from the root one component at a time, each opened with
O_NOFOLLOW relative to the one before (`dir_fd`), and the file opened in that folder with O_NOFOLLOW too. A
link anywhere on the way fails with LinkBelowRoot naming it, and nothing is written. The root itself may be a
link: where the run root lives is the user's choice.

Writers that a library does (the Trainer's checkpoint save, our checkpoint rotation) take `check` immediately
before they start: a link planted between the check and the write is the one window left, a few instructions
wide, where the rest have none.

Standard library only: the launcher and the jobs share it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path


class LinkBelowRoot(OSError):
    """A symbolic link (or something that is not a folder) where a folder below a root belongs."""


def relative_parts(root: Path, path: Path) -> list[str]:
    """`path`'s components below `root`; ValueError when it is not below it (or climbs out with '..').
    Either may be relative to the working directory: a pack's units carry `runs/EXP/STAGE` as written in
    cluster.yaml, their roots are absolute."""
    parts = list(Path(os.path.abspath(path)).relative_to(os.path.abspath(root)).parts)
    if ".." in parts:
        raise ValueError(f"{path} is not below {root}")
    return parts


def open_folder(root: Path, folder: Path, create: bool = False) -> int:
    """A descriptor of `folder` (below `root`, or `root` itself), reached without following a link below
    `root`; the missing folders are made when `create` (the root too, following a link there). The
    caller closes it."""
    if create:
        Path(root).mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    here = Path(root)
    try:
        for name in relative_parts(root, folder):
            here = here / name
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o777, dir_fd=fd)
            inner = step_into(fd, name, here)
            os.close(fd)
            fd = inner
        return fd
    except BaseException:
        os.close(fd)
        raise


def step_into(fd: int, name: str, path: Path) -> int:
    """The folder `name` in the folder `fd`, not followed if it is a link."""
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        is_link = stat.S_ISLNK(os.lstat(name, dir_fd=fd).st_mode)
        what = "a symbolic link" if is_link else "a file"
        raise LinkBelowRoot(
            exc.errno, f"{what} where a folder belongs: never written through; remove it", str(path)
        ) from None


def open_file(root: Path, path: Path, flags: int, mode: int = 0o666, create_folders: bool = True) -> int:
    """`path` (below `root`) opened with `flags`, its folders reached as `open_folder` does and the file
    itself never through a link (O_NOFOLLOW: a link there fails with ELOOP, named)."""
    path = Path(path)
    folder = open_folder(root, path.parent, create=create_folders)
    try:
        return os.open(path.name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=folder)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LinkBelowRoot(
                exc.errno, "a symbolic link: never written through; remove it", str(path)
            ) from None
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    finally:
        os.close(folder)


def check(root: Path, path: Path) -> None:
    """Raise LinkBelowRoot if a link stands anywhere from below `root` down to `path` (which need not exist
    yet: its existing part is checked). For a library's writer, called immediately before it writes."""
    path, root = Path(path), Path(root)
    existing = path
    while not os.path.lexists(existing) and existing != root and existing != existing.parent:
        existing = existing.parent
    if existing == root or root not in existing.parents:
        return  # nothing below the root exists yet: nothing to follow
    if os.path.islink(existing):
        raise LinkBelowRoot(errno.ELOOP, "a symbolic link: never written through; remove it", str(existing))
    folder = existing if os.path.isdir(existing) else existing.parent
    os.close(open_folder(root, folder))
