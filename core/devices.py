"""CUDA_VISIBLE_DEVICES read as CUDA reads it, torch-free: for the launcher's local backend (which GPUs it
may hand out), a pack's lanes (which GPU each binds) and the report (how many GPUs a local job held)."""

from __future__ import annotations

import re

# A CUDA_VISIBLE_DEVICES entry CUDA accepts: an index, or a (prefix of a) GPU or MIG UUID.
DEVICE_ENTRY = re.compile(r"^(\d+|GPU-[0-9A-Za-z-]+|MIG-[0-9A-Za-z/-]+)$")


def visible_devices(value: str) -> tuple[str, ...]:
    """The devices CUDA shows for this CUDA_VISIBLE_DEVICES: the list ends at the first entry it cannot
    read, so "-1" (a common way to hide every GPU) and "" leave none, and "0,-1,1" leaves only 0."""
    devices: list[str] = []
    for entry in value.split(","):
        if not DEVICE_ENTRY.match(entry.strip()):
            break
        devices.append(entry.strip())
    return tuple(devices)


# How many jobs the local backend runs on a job's GPU at once, in the job's environment: a GPU listed N times
# in CUDA_VISIBLE_DEVICES (0,0,0) is N slots (slurm/cluster/local_gpus.py), and each job plans to fill only its
# share of the GPU's memory (train/device.py free_gpu_gb).
GPU_SHARES = "LORA_GPU_SHARES"


def estimated_gpus(asked: int, gpus_here: int | None) -> int:
    """The GPUs a job's estimate and its `time: auto` limit count: what it asks (on SLURM, `gpus_here` is
    None); none where the local backend runs it on a machine without GPUs, which then runs it on CPUs. Its
    speed is then a CPU's, the speed book's CPU rows or a CPU guess, not an assumed GPU's: a DPO job once
    ran 13:19 of a 15:00 limit sized for an A100 while it trained on two CPU cores."""
    return 0 if gpus_here == 0 else asked
