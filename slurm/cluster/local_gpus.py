"""The GPUs of this machine, for the local backend: which the launcher sees, and which local job holds which.

The launcher never imports torch, so it finds the GPUs as CUDA would: CUDA_VISIBLE_DEVICES when set (ids or
UUIDs, kept as written, so a job gets exactly the GPUs the user meant), else the GPUs `nvidia-smi -L`
lists, else none. Each job holds its `resources.gpus` of them, disjoint from every other running job's,
and waits until that many are free. A machine with no GPU at all runs every job on its CPUs (the demo,
CI, a laptop); a machine with GPUs refuses a job asking for more than it has, before anything runs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from core.devices import visible_devices
from core.problems import ConfigError, Problem


@dataclass(frozen=True)
class VisibleGpus:
    ids: tuple[str, ...]  # what a job's CUDA_VISIBLE_DEVICES is made of
    source: str  # where they were read, for messages

    @staticmethod
    def detect(env: Mapping[str, str] = os.environ) -> VisibleGpus:
        if "CUDA_VISIBLE_DEVICES" in env:
            value = env["CUDA_VISIBLE_DEVICES"]
            return VisibleGpus(visible_devices(value), f"CUDA_VISIBLE_DEVICES={value!r}")
        count = nvidia_smi_count()
        if count is None:
            return VisibleGpus((), "no CUDA_VISIBLE_DEVICES and no nvidia-smi")
        return VisibleGpus(tuple(str(k) for k in range(count)), f"nvidia-smi -L lists {count}")

    def describe(self) -> str:
        if not self.ids:
            return f"no GPU ({self.source}): jobs run on CPUs"
        return f"GPUs {','.join(self.ids)} ({self.source})"


def nvidia_smi_count() -> int | None:
    """GPUs of this machine as the driver lists them; None without nvidia-smi or when it fails (no
    driver loaded): the machine then counts as having none."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        done = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, errors="replace", timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return count_listed(done.stdout) if done.returncode == 0 else None


def count_listed(listing: str) -> int:
    """Whole GPUs in `nvidia-smi -L` output ("GPU 0: NVIDIA H100 ... (UUID: GPU-...)"); its indented MIG
    lines are parts of those GPUs, not more of them."""
    return sum(1 for line in listing.splitlines() if re.match(r"GPU \d+:", line))


def gpus_needed(asked: int, visible: VisibleGpus) -> int:
    """A job's share: what it asks, or none on a machine without GPUs (it runs on CPUs, as the demo does)."""
    return asked if visible.ids else 0


class GpuPool:
    """Which of the visible GPUs running jobs hold; a job takes its share whole or waits. A GPU listed N
    times (CUDA_VISIBLE_DEVICES=0,0,0) is N slots: up to N jobs run on it at once, each told so
    (`shares`), so that each plans to fill only its part of the GPU's memory (train/device.py)."""

    def __init__(self, ids: tuple[str, ...]):
        self.ids, self.held = ids, Counter()

    def take(self, count: int) -> tuple[str, ...] | None:
        """`count` distinct GPUs with a free slot (in the machine's order), now held by the caller; None if
        fewer have one."""
        free = [d for d in dict.fromkeys(self.ids) if self.held[d] < self.shares(d)]
        if count > len(free):
            return None
        self.hold(free[:count])
        return tuple(free[:count])

    def hold(self, ids) -> None:
        self.held.update(ids)

    def give_back(self, ids: tuple[str, ...]) -> None:
        self.held.subtract(ids)

    def shares(self, device: str) -> int:
        """How many jobs may run on `device` at once: how many times it is listed."""
        return self.ids.count(device)


def too_many_gpus(jobs, visible: VisibleGpus, files: Mapping[str, str]) -> list[Problem]:
    """A job asking for more GPUs than this machine has would wait forever: one problem per experiment and
    key. `files`: experiment name → its YAML, where the problem points."""
    problems = []
    for job in jobs:
        if job.resources.nodes > 1:
            # Refused, not run as nodes x gpus ranks here: the job would train on another placement than
            # the one written (another speed book row, another memory per rank) without a word.
            ranks = job.resources.tasks
            message = (
                f"asks for {job.resources.placement()}, and the local backend runs every job on this one "
                f"machine; run it on SLURM, or here as one node of {ranks} ranks (resources.nodes=1 "
                f"resources.gpus={ranks} on the command line: the same global batch)"
            )
            problems.append(Problem(files.get(job.experiment, job.experiment), "resources.nodes", message))
            continue
        asked, have = job.resources.gpus, len(set(visible.ids))  # a GPU listed twice is still one GPU
        if not visible.ids or asked <= have:
            continue
        key = "resources.gpus" if job.kind == "train" else "eval.resources.gpus"
        message = (
            f"asks for {asked} GPUs but this machine has {have} ({visible.source}), and the local "
            f"backend runs every job on it; ask for at most {have} (e.g. {key}={have} on the command line) "
            "or run it on SLURM"
        )
        problems.append(Problem(files.get(job.experiment, job.experiment), key, message))
    return problems


def refuse_too_many_gpus(jobs, files: Mapping[str, str]) -> None:
    """At planning time, before preflight and before anything runs: raise ConfigError for jobs that could
    never get their GPUs on this machine."""
    if problems := too_many_gpus(jobs, VisibleGpus.detect(), files):
        raise ConfigError(problems)
