"""core/devices.py visible_devices: CUDA_VISIBLE_DEVICES read once, as CUDA reads it (the list ends at the
first entry CUDA cannot read), by all three torch-free readers: the local backend (which GPUs it hands
out), a pack's lanes (which GPU each binds) and the report (how many GPUs a local job held, from its log)."""

from __future__ import annotations

import pytest

from core.devices import visible_devices
from slurm.cluster.local_gpus import VisibleGpus
from slurm.queueing.lanes import lane_devices
from slurm.watching.usage import given_gpus


@pytest.mark.parametrize(
    ("value", "devices"),
    [
        ("2,3,5,6", ("2", "3", "5", "6")),  # what SLURM gives an allocation on a shared node
        ("GPU-8f3a,MIG-5c1e/1/0", ("GPU-8f3a", "MIG-5c1e/1/0")),
        ("0,-1,1", ("0",)),  # CUDA stops at -1: GPU 1 is hidden
        ("0,,1", ("0",)),  # and at an empty entry
        ("-1", ()),
        ("", ()),
    ],
)
def test_every_reader_sees_the_gpus_cuda_sees(value, devices, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    assert visible_devices(value) == devices
    assert VisibleGpus.detect().ids == devices
    log = tmp_path / "job.out"
    log.write_text(
        f"2026-11-27 10:00:00 INFO CUDA_VISIBLE_DEVICES={value}\nstep 1\n"
    )  # slurm/queueing/jobs.py's line
    assert given_gpus(log) == len(devices)
    if devices:
        assert lane_devices(len(devices)) == list(devices)


def test_a_lane_is_never_bound_to_a_gpu_cuda_cannot_see(monkeypatch):
    """Before, the lanes split CUDA_VISIBLE_DEVICES on commas without CUDA's stop rule: "0,-1,1" bound lane
    1 to "-1", and its units ran on no GPU at all."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,-1,1")
    assert lane_devices(1) == ["0"]
    assert "-1" not in lane_devices(2)
