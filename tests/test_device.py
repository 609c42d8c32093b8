"""train/device.py: the device and dtype decision table, on made-up hardware (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from train.device import Hardware, PlacementError, decide, ranks

CPU = Hardware(cpu_cores=16)
H100 = Hardware(cuda_devices=1, bf16_supported=True, capability_major=9, name="NVIDIA H100", cpu_cores=16)
V100 = Hardware(cuda_devices=1, bf16_supported=False, capability_major=7, name="Tesla V100", cpu_cores=8)
FOUR_A100 = Hardware(cuda_devices=4, bf16_supported=True, capability_major=8, name="A100", cpu_cores=32)


def row(placement) -> tuple:
    return (placement.device, placement.precision, placement.load_dtype, placement.compute_dtype)


@pytest.mark.parametrize(
    ("hardware", "asked", "expected"),
    [
        (CPU, "auto", ("cpu", "fp32", torch.float32, torch.float32)),
        (CPU, "fp32", ("cpu", "fp32", torch.float32, torch.float32)),
        # CPU bf16: autocast over fp32 weights (bf16 weights are slower on CPUs for small models).
        (CPU, "bf16", ("cpu", "bf16", torch.float32, torch.float32)),
        (H100, "auto", ("cuda:0", "bf16", torch.bfloat16, torch.bfloat16)),
        (H100, "bf16", ("cuda:0", "bf16", torch.bfloat16, torch.bfloat16)),
        # fp16 AMP needs fp32 master weights for its gradient scaler.
        (H100, "fp16", ("cuda:0", "fp16", torch.float32, torch.float16)),
        (H100, "fp32", ("cuda:0", "fp32", torch.float32, torch.float32)),
        (V100, "auto", ("cuda:0", "fp16", torch.float32, torch.float16)),
        (V100, "fp32", ("cuda:0", "fp32", torch.float32, torch.float32)),
    ],
)
def test_decision_table(hardware, asked, expected):
    placement = decide(hardware, asked)
    assert row(placement) == expected
    assert placement.warnings == ()


def test_gpu_batching_and_loading_facts_follow_the_device():
    gpu, cpu = decide(H100, "auto"), decide(CPU, "auto")
    assert (gpu.cuda, gpu.pin_memory, gpu.pad_to_multiple_of, gpu.workers) == (True, True, 8, 4)
    assert (cpu.cuda, cpu.pin_memory, cpu.pad_to_multiple_of, cpu.workers) == (False, False, None, 0)
    assert (gpu.bf16, gpu.fp16, cpu.bf16, cpu.fp16) == (True, False, False, False)
    assert gpu.device_name == "NVIDIA H100" and cpu.device_name == "cpu"
    assert (
        decide(Hardware(cuda_devices=1, bf16_supported=True, capability_major=8, cpu_cores=2), "auto").workers
        == 2
    )


def test_tf32_on_ampere_and_later_unless_fp32_was_asked_for():
    assert decide(H100, "auto").tf32 and decide(H100, "fp16").tf32
    assert not decide(H100, "fp32").tf32  # asked for fp32, gets fp32 matmuls
    assert not decide(V100, "auto").tf32 and not decide(CPU, "auto").tf32


def test_the_gpu_comes_from_local_rank():
    assert decide(FOUR_A100, "auto", local_rank=2, world_size=4).device == "cuda:2"
    assert ranks({"LOCAL_RANK": "2", "WORLD_SIZE": "4"}) == {"local_rank": 2, "world_size": 4}
    assert ranks({}) == {"local_rank": 0, "world_size": 1}
    with pytest.raises(PlacementError, match="LOCAL_RANK 4 .* 4 GPU"):
        decide(FOUR_A100, "auto", local_rank=4, world_size=8)
    # SLURM binding one GPU to each task: every task sees its own GPU as cuda:0.
    assert decide(H100, "auto", local_rank=3, world_size=4).device == "cuda:0"


def test_a_batch_is_split_over_ddp_processes_only():
    ddp = decide(FOUR_A100, "auto", local_rank=1, world_size=4)
    assert (ddp.world_size, ddp.backend, ddp.warnings) == (4, "nccl", ())
    assert decide(H100, "auto").world_size == decide(CPU, "auto").world_size == 1


def test_one_process_with_several_gpus_uses_its_own_gpu_and_says_how_to_use_all():
    # The bug of issue 11: the Trainer wrapped the model in nn.DataParallel and multiplied the batch by 4.
    alone = decide(FOUR_A100, "auto")
    assert (alone.device, alone.world_size) == ("cuda:0", 1)
    assert "sees 4 GPUs" in alone.warnings[0] and "resources.gpus" in alone.warnings[0]


def test_ranks_talk_nccl_between_gpus_and_gloo_between_cpus():
    assert decide(H100, "auto").backend == "nccl"
    cpu = decide(CPU, "auto", local_rank=1, world_size=2)
    assert (cpu.device, cpu.world_size, cpu.backend) == ("cpu", 2, "gloo")


def test_what_this_hardware_cannot_do_falls_back_with_a_warning():
    # A config written for the cluster still runs on a laptop; summary.json records what ran.
    fp16_on_cpu = decide(CPU, "fp16")
    assert row(fp16_on_cpu) == ("cpu", "fp32", torch.float32, torch.float32)
    assert "fp16 needs a CUDA GPU" in fp16_on_cpu.warnings[0]
    bf16_on_v100 = decide(V100, "bf16")
    assert row(bf16_on_v100) == ("cuda:0", "fp16", torch.float32, torch.float16)
    assert "Tesla V100 has no native bf16" in bf16_on_v100.warnings[0]


def test_this_machine_runs_where_the_table_says_and_is_read_once():
    """Precision auto on this machine: a GPU node trains on cuda:0 in bf16 or fp16, a CPU machine in fp32
    (a detection that missed the GPU, or saw one that is not there, lands on the wrong row)."""
    hardware = Hardware.detect()
    assert Hardware.detect() is hardware  # read from torch once
    placement = decide(hardware, "auto")
    if torch.cuda.is_available():
        assert (placement.device, placement.precision in ("bf16", "fp16")) == ("cuda:0", True)
    else:
        assert (placement.device, placement.precision) == ("cpu", "fp32")
