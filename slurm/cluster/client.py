"""SLURM's client commands (squeue, sacct, sacctmgr, scontrol, sinfo): one way to run them, and the one
reader of the TRES lists they print.

A command's answer is its standard output, or None when it could not be run, failed, or took longer than
CLIENT_TIMEOUT_S: every caller then goes on without it (a launch without the limits checked, a status
without the scheduler's states) instead of crashing or hanging the login node.
"""

from __future__ import annotations

import shutil
import subprocess

from core.config import ascii_int

# How long one client command may take. Each answers from slurmctld's or slurmdbd's memory in well under a
# second; a busy controller (a backfill pass over thousands of jobs) can take tens of seconds, and a
# client retries an unanswered message itself for SLURM's MessageTimeout (10 s by default) at a time. A
# minute lets a slow controller answer; past it the controller is hung, and waiting longer helps nobody.
CLIENT_TIMEOUT_S = 60
GPUS = "gres/gpu"  # a TRES list's GPUs of every type; `gres/gpu:TYPE` counts those of one type


def run_client(command: list[str]) -> str | None:
    """`command`'s standard output, or None when it is missing, fails or passes CLIENT_TIMEOUT_S. Bytes
    that are not UTF-8 (a name in Latin-1) are replaced, not a crash."""
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, errors="replace", timeout=CLIENT_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def tres_counts(tres: str) -> dict[str, int]:
    """A TRES list as SLURM prints it (AllocTRES, MaxTRES, GrpTRES) → each resource's count:
    `cpu=8,mem=64G,gres/gpu=4,gres/gpu:a100=4` → {"cpu": 8, "gres/gpu": 4, "gres/gpu:a100": 4}. A count
    that is not ASCII digits (`mem=64G`, `n/a`, `-1`, `2²`) is left out: no figure, never a crash."""
    counts = {}
    for item in tres.split(","):
        name, _, value = item.partition("=")
        if (count := ascii_int(value)) is not None:
            counts[name.strip()] = count
    return counts


def gpu_counts(counts: dict[str, int]) -> dict[str, int]:
    """The GPU entries of tres_counts: `gres/gpu` (every type) and each `gres/gpu:TYPE`; what they add up
    to is the caller's rule (a limit binds at its tightest, an allocation holds the total)."""
    return {name: n for name, n in counts.items() if name == GPUS or name.startswith(f"{GPUS}:")}


def pick_backend(name: str) -> str:
    """auto: SLURM when its client is installed and a controller answers, else this machine."""
    if name != "auto":
        return name
    if not shutil.which("sbatch"):
        return "local"
    return "slurm" if run_client(["sinfo", "-h", "-o", "%P"]) is not None else "local"
