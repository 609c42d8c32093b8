"""The code a launch submits, frozen: queued jobs run it, whatever the working tree holds when they start.

The packages a job imports (core/, slurm/, train/, eval/ and launch.py) are copied into `LOG_DIR/.code/<hash>/`,
named by a hash of their content, so relaunching unchanged code reuses the folder. Jobs start with that
folder as their working directory (Python puts it first on sys.path), then move to the user's directory,
where relative data paths point. submitit's RsyncSnapshot would need git-tracked files and rsync on the
login node; a copy of a few hundred kB needs neither.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from core.below import check
from core.rundir import LogRoot

ROOT = Path(__file__).resolve().parents[2]  # the checkout: slurm/queueing/snapshot.py is two below it
PACKAGES = ("core", "slurm", "train", "eval")  # pyproject.toml's packages, less demo/ (no job imports it)
MODULES = ("launch.py",)


@dataclass(frozen=True)
class CodeSnapshot:
    folder: Path
    commit: str | None  # git HEAD of the tree it was copied from; None outside a git checkout
    dirty: bool | None  # the copied files differ from that commit (edited or untracked)

    def provenance(self) -> dict:
        return {"commit": self.commit, "dirty": self.dirty, "snapshot": str(self.folder)}


def take_snapshot(log_dir: Path, root: Path = ROOT) -> CodeSnapshot:
    files = code_files(root)
    lexical = LogRoot.of(log_dir).code_snapshot(content_hash(root, files))
    # A link planted at `.code/` since the launch's check: refused here, immediately before the copy
    # (it would have been resolved, and jobs started from the code it points to).
    check(log_dir, lexical)
    folder = lexical.resolve()
    if not folder.is_dir():
        copy_files(root, files, folder)
    return CodeSnapshot(folder, *git_state(root))


def code_files(root: Path) -> list[Path]:
    """Relative paths of every Python file a job may import (not caches)."""
    found = [Path(m) for m in MODULES if (root / m).is_file()]
    for package in PACKAGES:
        found += [p.relative_to(root) for p in (root / package).rglob("*.py") if "__pycache__" not in p.parts]
    return sorted(found)


def content_hash(root: Path, files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path).encode() + b"\0" + (root / path).read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def copy_files(root: Path, files: list[Path], folder: Path) -> None:
    """Copied into a temporary sibling, then renamed: a job never starts from half a snapshot, and two
    launches taking the same snapshot at once both end up with one complete folder."""
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for path in files:
        (tmp / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / path, tmp / path)
    try:
        tmp.rename(folder)
    except OSError:  # the other launch renamed first: same content
        shutil.rmtree(tmp, ignore_errors=True)


def git_state(root: Path) -> tuple[str | None, bool | None]:
    commit = _git(root, "rev-parse", "HEAD")
    if commit is None:
        return None, None
    changes = _git(root, "status", "--porcelain", "--", *PACKAGES, *MODULES)
    return commit.strip(), bool(changes and changes.strip())


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(root), *args],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None
