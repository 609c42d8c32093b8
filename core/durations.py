"""Durations, the one owner of how they are read and written: SLURM's `D-HH:MM:SS` both ways, the looser
forms SLURM's tools print, and the rough `1h12m` of an estimate.

A duration we write (a config's `resources.time`, cluster.yaml's `max_time` and `budget`, `--budget`, a
`#SBATCH --time`) has one strict form, TIME_FORMAT, checked by core/config.py `SlurmTime`. What sacctmgr,
scontrol, squeue and sacct print is read with `read_duration`, which also takes `MM:SS` and `MM` and reads
UNLIMITED, INFINITE or an odd value as None (no limit, or no figure): never a crash.
"""

from __future__ import annotations

import math
import re

# \Z, not $: `$` also matches before a final newline, which would reach an #SBATCH line.
TIME_FORMAT = re.compile(r"^(?:(\d+)-)?(\d{1,2}):(\d{2}):(\d{2})\Z", re.ASCII)
# SLURM's own forms (sbatch --time, sacctmgr MaxWall, scontrol MaxTime, squeue %M): D-HH:MM:SS, D-HH:MM,
# D-HH, HH:MM:SS, MM:SS, MM.
SCHEDULER_FORMAT = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", re.ASCII)


def slurm_seconds(time: str) -> int:
    """'1-02:03:04' → 93784; `time` in TIME_FORMAT (a validated config value)."""
    days, hours, minutes, seconds = TIME_FORMAT.match(time).groups()
    return int(days or 0) * 86400 + int(hours) * 3600 + int(minutes) * 60 + int(seconds)


def slurm_time(seconds: int) -> str:
    """93784 → '1-02:03:04' (the days part only when there are days)."""
    days, rest = divmod(int(seconds), 86400)
    clock = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{clock}" if days else clock


def read_duration(text: str) -> int | None:
    """A duration as SLURM's tools print it, in seconds: `1-02:00:00` → 93600, `02:00:00` → 7200, `05:30`
    (MM:SS) → 330, `10` (minutes) → 600, `1-12` (D-HH) → 129600; None for UNLIMITED, INFINITE, `-1`,
    nothing, or anything else."""
    match = SCHEDULER_FORMAT.fullmatch(text.strip())
    if not match:
        return None
    days, first, second, third = match.groups()
    if third is not None:
        clock = int(first) * 3600 + int(second) * 60 + int(third)
    elif second is not None:
        clock = int(first) * 3600 + int(second) * 60 if days else int(first) * 60 + int(second)
    else:
        clock = int(first) * 3600 if days else int(first) * 60
    return int(days or 0) * 86400 + clock


def format_eta(seconds: float | None) -> str:
    """`01:02:03`, `1-02:00:00` past a day (slurm_time); "" for no figure. Before, the ETA was a 24-hour
    clock and 26 hours read as 02:00:00."""
    if seconds is None or not math.isfinite(seconds):
        return ""
    return slurm_time(round(max(0, seconds)))


def format_duration(seconds: float) -> str:
    """'45s', '12m', '1h12m', '2d3h': as much precision as an estimate deserves."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    minutes = math.ceil(seconds / 60)
    if minutes < 60:
        return f"{minutes}m"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    return f"{hours // 24}d{hours % 24}h"
