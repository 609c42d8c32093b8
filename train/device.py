"""Every device and dtype decision, in one place: which device this process uses and in what precision.

    placement = current("auto")            # Hardware.detect() + LOCAL_RANK/WORLD_SIZE from the environment
    decide(Hardware(cuda_devices=1, bf16_supported=True, capability_major=9), "auto")   # pure: tests use this

`decide` is a pure function of facts (the hardware, `train.precision`, the process's rank), so its whole
table is tested on a CPU. The trainer, the eval job and the benchmark ask it; nothing else calls
`torch.cuda.*` to decide anything.

The table (precision → what runs):
- CPU: auto and fp32 → fp32. bf16 → bf16 autocast over fp32 weights (bf16 weights are slower on CPUs for
  small models, and the optimizer keeps fp32 anyway). fp16 → fp32 with a warning: there is no fp16 AMP on a
  CPU, and a config written for the cluster should still run on a laptop; summary.json records fp32.
- GPU with bf16 (compute capability ≥ 8: A100, H100, L40S...): auto and bf16 → bf16 weights and autocast;
  TF32 matmuls on. fp16 → fp16 AMP over fp32 weights (the gradient scaler needs fp32 master weights).
  fp32 → fp32, TF32 off (asked for fp32, gets fp32).
- GPU without bf16 (V100, T4): auto → fp16 AMP over fp32 weights. bf16 → the same, with a warning (no
  emulated bf16: it is many times slower). fp32 → fp32.
- The GPU is `cuda:LOCAL_RANK` when the process sees several (torchrun; SLURM tasks sharing the node's
  GPUs), `cuda:0` when it sees one (SLURM binding one GPU to each task). A rank without a GPU is an error.
- Data parallelism is DDP only: WORLD_SIZE processes, one GPU each, backend nccl (gloo on CPUs). One
  process that sees several GPUs uses only its own, with a warning: the Trainer would otherwise wrap the
  model in nn.DataParallel (slow; 4-bit models cannot) and multiply the batch by the GPU count.
Warnings are returned in `Placement.warnings` for the caller to log, so the table stays pure.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Literal

import torch

from core.devices import GPU_SHARES

Precision = Literal["auto", "bf16", "fp16", "fp32"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Every trainable parameter (LoRA matrices, modules_to_save copies, added-token rows), whatever the weights
# are loaded in: AdamW on bf16 weights rounds most small updates away (bf16 keeps 8 bits of mantissa), and
# its moments would be bf16 too. peft upcasts LoRA weights itself but leaves modules_to_save copies alone.
TRAINABLE_DTYPE = torch.float32


class PlacementError(RuntimeError):
    """This process cannot run here as asked (e.g. LOCAL_RANK names a GPU the node does not have)."""


@dataclass(frozen=True)
class Hardware:
    """What this node offers, read from torch once (`detect`), or written by hand in tests."""

    cuda_devices: int = 0
    bf16_supported: bool = False  # natively: emulated bf16 does not count
    capability_major: int = 0
    name: str = "cpu"
    cpu_cores: int = 1

    @staticmethod
    @cache
    def detect() -> Hardware:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if not torch.cuda.is_available():
            return Hardware(cpu_cores=cores)
        return Hardware(
            cuda_devices=torch.cuda.device_count(),
            bf16_supported=torch.cuda.is_bf16_supported(including_emulation=False),
            capability_major=torch.cuda.get_device_capability()[0],
            name=torch.cuda.get_device_name(),
            cpu_cores=cores,
        )


@dataclass(frozen=True)
class Placement:
    """Where and how this process runs. `precision` is what actually runs (never "auto")."""

    device: str  # "cuda:K" or "cpu"
    device_name: str  # the GPU's name, or "cpu"
    precision: Literal["bf16", "fp16", "fp32"]
    load_dtype: torch.dtype  # the weights, as loaded
    compute_dtype: torch.dtype  # what a 4-bit base computes in (bnb_4bit_compute_dtype)
    tf32: bool
    pin_memory: bool
    pad_to_multiple_of: int | None  # tensor cores like multiples of 8; on a CPU it only adds padding
    workers: int  # data loader workers for `data.num_workers: auto`
    world_size: int  # DDP processes a global batch is split over (1: no data parallelism)
    warnings: tuple[str, ...] = field(default=())

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def backend(self) -> Literal["nccl", "gloo"]:
        """The torch.distributed backend between the ranks: nccl between GPUs, gloo between CPUs."""
        return "nccl" if self.cuda else "gloo"

    @property
    def bf16(self) -> bool:
        return self.precision == "bf16"

    @property
    def fp16(self) -> bool:
        return self.precision == "fp16"


def decide(hardware: Hardware, precision: Precision, local_rank: int = 0, world_size: int = 1) -> Placement:
    """The placement for one process; see the module docstring for the table."""
    if hardware.cuda_devices == 0:
        return on_cpu(hardware, precision, world_size)
    if hardware.cuda_devices == 1:
        local_rank = 0  # this task's own GPU, bound to it (CUDA_VISIBLE_DEVICES holds only that one)
    if local_rank >= hardware.cuda_devices:
        raise PlacementError(
            f"LOCAL_RANK {local_rank} names GPU {local_rank}, but this node shows {hardware.cuda_devices} "
            "GPU(s): start one process per allocated GPU (resources.gpus) and check CUDA_VISIBLE_DEVICES"
        )
    runs, warnings = gpu_precision(hardware, precision)
    if world_size <= 1 and hardware.cuda_devices > 1:
        warnings += (
            f"this process sees {hardware.cuda_devices} GPUs but is one process: it trains on cuda:0 only. "
            "For data parallelism run one process per GPU (resources.gpus: N starts N tasks)",
        )
    return Placement(
        device=f"cuda:{local_rank}",
        device_name=hardware.name,
        precision=runs,
        load_dtype=torch.bfloat16 if runs == "bf16" else torch.float32,
        compute_dtype=DTYPES[runs],
        tf32=hardware.capability_major >= 8 and precision != "fp32",
        pin_memory=True,
        pad_to_multiple_of=8,
        workers=min(4, hardware.cpu_cores),
        world_size=max(1, world_size),
        warnings=warnings,
    )


def gpu_precision(hardware: Hardware, precision: Precision) -> tuple[str, tuple[str, ...]]:
    if precision in ("auto", "bf16") and hardware.bf16_supported:
        return "bf16", ()
    if precision == "bf16":
        return "fp16", (f"train.precision bf16: {hardware.name} has no native bf16; using fp16 AMP",)
    return ("fp16" if precision == "auto" else precision), ()


def on_cpu(hardware: Hardware, precision: Precision, world_size: int) -> Placement:
    runs, warnings = precision, ()
    if precision in ("auto", "fp16"):
        runs = "fp32"
    if precision == "fp16":
        warnings = ("train.precision fp16 needs a CUDA GPU (no fp16 AMP on a CPU); running in fp32",)
    return Placement(
        device="cpu",
        device_name="cpu",
        precision=runs,
        load_dtype=torch.float32,  # CPU bf16 runs as autocast over fp32 weights
        compute_dtype=torch.float32,
        tf32=False,
        pin_memory=False,
        pad_to_multiple_of=None,
        workers=0,  # workers would take cores from the math
        world_size=max(1, world_size),
        warnings=warnings,
    )


def gpu_uuid(placement: Placement) -> str | None:
    """This process's GPU as NVML names it (`GPU-<uuid>`), or None on a CPU. The CUDA index is not NVML's:
    CUDA_VISIBLE_DEVICES renumbers the GPUs a process sees, and NVML always sees all of the node's."""
    if not placement.cuda:
        return None
    return f"GPU-{torch.cuda.get_device_properties(placement.device).uuid}"


# A test seam standing in for torch.cuda.mem_get_info: with it set, a process on a CPU chooses its batch
# split as a GPU with this many GB free (and in all) would (it still trains on the CPU). Tests only.
FAKE_FREE_GPU_GB = "LORA_TEST_FREE_GPU_GB"


def free_gpu_gb(placement: Placement, env: Mapping[str, str] = os.environ) -> float | None:
    """GB (10**9 bytes) this process's training step may fill on its GPU (step_memory_gb), at most its
    share of the whole GPU when `GPU_SHARES` jobs share it: the jobs start together, each sees the memory
    the others have not taken yet, and each planning to fill 95 % of it ran them all out of memory.
    None on a CPU."""
    shares = max(1, int(env.get(GPU_SHARES) or 1))
    if env.get(FAKE_FREE_GPU_GB):
        return float(env[FAKE_FREE_GPU_GB]) / shares
    if not placement.cuda:
        return None
    free, total = torch.cuda.mem_get_info(placement.device)
    return min(step_memory_gb(free, torch.cuda.memory_reserved(placement.device)), total / shares / 10**9)


def step_memory_gb(free_bytes: int, held_bytes: int) -> float:
    """What the memory model's whole step may fill: the GPU's free memory plus what torch already holds for
    this process. The split is chosen after the model is loaded, and the estimate counts the model's weights
    itself: free memory alone counted them twice (a 7B bf16 LoRA's 15 GB, taken off the micro-batch)."""
    return (free_bytes + held_bytes) / 10**9


def split_memory_gb(free_per_rank: list[float | None]) -> float | None:
    """The memory every rank's split is chosen for: the smallest free memory of all ranks (one decision for
    all, since the ranks must step together); None when any rank has no GPU."""
    if not free_per_rank or any(free is None for free in free_per_rank):
        return None
    return min(free_per_rank)


def fused_loss_possible(placement: Placement, installed: bool) -> bool:
    """Whether a fused linear cross-entropy may run (train/loss.py): Liger's Triton kernels need a CUDA GPU
    and the `[gpu]` extra; on a CPU, or without the extra, the plain loss runs, unchanged."""
    return placement.cuda and installed


def ranks(env: Mapping[str, str] = os.environ) -> dict[str, int]:
    """This process's LOCAL_RANK and WORLD_SIZE (set by torchrun and by the DDP job wrapper; else 0 and 1)."""
    return {"local_rank": int(env.get("LOCAL_RANK", 0)), "world_size": int(env.get("WORLD_SIZE", 1))}


def current(precision: Precision) -> Placement:
    """The placement of this process on this node."""
    return decide(Hardware.detect(), precision, **ranks())
