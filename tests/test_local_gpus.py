"""The local backend hides every GPU (issue 20, defect 2): submitit's LocalExecutor, given no GPU count, set
CUDA_VISIBLE_DEVICES="" for every job, so on a GPU workstation or a `salloc` node everything trained on CPUs.

Now each local job holds its `resources.gpus` of the GPUs the launcher sees (CUDA_VISIBLE_DEVICES, else
`nvidia-smi -L`), disjoint from every other running job's, and waits for them; a job asking for more than
the machine has is refused before anything runs. This machine has no GPU: the launcher is given made-up
GPU UUIDs, and the tests read what each job process received from its own log (slurm/queueing/jobs.py writes its
CUDA_VISIBLE_DEVICES there before torch starts; CPU torch then trains on the CPU, whatever it names).
Real local jobs (submitit's LocalExecutor), real tiny models."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from submitit.core.utils import JobPaths

import launch
from core.devices import visible_devices
from slurm.cluster.local_gpus import GpuPool, VisibleGpus, count_listed, gpus_needed
from tests.conftest import write_cluster_yaml
from tests.helpers import record, tiny_sql_base

EXPERIMENT = """\
name: {name}
inherits: _tiny-sql.yaml
train: {{max_steps: 2}}
resources: {{gpus: {gpus}}}
"""
UUIDS = ("GPU-0a1b2c3d-aaaa", "GPU-0a1b2c3d-bbbb", "GPU-0a1b2c3d-cccc")


def configs(tmp: Path, gpus: dict[str, int], **cluster) -> Path:
    folder = tmp / "configs"
    folder.mkdir()
    write_cluster_yaml(folder, tmp, **cluster)
    tiny_sql_base(folder)
    for name, count in gpus.items():
        (folder / f"{name}.yaml").write_text(EXPERIMENT.format(name=name, gpus=count))
    return folder


def received(tmp: Path, job: str, tasks: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES as each task of the job's last run logged it, task 0 first."""
    job_id = record(tmp, job)["job_id"]
    seen = []
    for task in range(tasks):
        log = JobPaths(tmp / "logs" / job, job_id, task_id=task).stdout.read_text()
        seen += re.findall(r"CUDA_VISIBLE_DEVICES=(\S*)$", log, re.MULTILINE)[-1:]
    return seen


def lifetimes(printed: str) -> dict[str, tuple[int, int]]:
    """Job id → (line it started on, line it ended on) in the launcher's output: the launcher prints
    RUNNING after starting a job and COMPLETED after its process ended, in one loop."""
    lines = printed.splitlines()
    started = {m[1]: k for k, line in enumerate(lines) if (m := re.search(r" (\S+): RUNNING ", line))}
    ended = {m[1]: k for k, line in enumerate(lines) if (m := re.search(r" (\S+): COMPLETED", line))}
    return {job: (started[job], ended[job]) for job in started}


@pytest.mark.slow
def test_local_backend_gives_each_job_its_own_gpus_instead_of_hiding_them(
    repo_root, tmp_path, tiny, monkeypatch, capsys
):
    monkeypatch.chdir(repo_root)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(UUIDS))
    # Four jobs may run at once, and the GPUs are 3: a-pair (2) and b-one (1) hold them all, c-cpu needs
    # none, so d-late must wait for GPUs, not for a slot.
    gpus = {"a-pair": 2, "b-one": 1, "c-cpu": 0, "d-late": 1}
    folder = configs(tmp_path, gpus, local_parallel_jobs=4)
    argv = ["--all", "--config-dir", str(folder), "--backend", "local", "--no-preflight"]
    assert launch.main(argv) == 0
    printed = capsys.readouterr().out

    seen = {name: received(tmp_path, f"{name}/train", max(1, count)) for name, count in gpus.items()}
    pair = seen["a-pair"][0].split(",")
    # A two-GPU job: both tasks see both of its GPUs (rank K uses cuda:K, as on SLURM), ids as given.
    assert len(pair) == 2 and set(pair) <= set(UUIDS) and seen["a-pair"] == [seen["a-pair"][0]] * 2, seen
    assert seen["b-one"][0] in UUIDS and seen["d-late"][0] in UUIDS, seen
    assert seen["c-cpu"] == [""], seen  # a CPU job sees no GPU
    held = {name: set(filter(None, ",".join(values).split(","))) for name, values in seen.items()}
    spans = lifetimes(printed)
    for x in gpus:
        for y in gpus:
            overlap = x < y and spans[x + "/train"][0] < spans[y + "/train"][1]
            overlap = overlap and spans[y + "/train"][0] < spans[x + "/train"][1]
            assert not (overlap and held[x] & held[y]), f"{x} and {y} ran at once on {held[x] & held[y]}"
    first_freed = min(spans["a-pair/train"][1], spans["b-one/train"][1])
    assert spans["d-late/train"][0] > first_freed, f"d-late started before a GPU was free:\n{printed}"
    assert spans["c-cpu/train"][0] < first_freed, "c-cpu waited for GPUs it does not use"
    assert f"on GPUs {','.join(UUIDS)} (CUDA_VISIBLE_DEVICES=" in printed
    # job.json keeps what each job was given: the report's GPU-hours of a local job count these.
    for name in gpus:
        given = record(tmp_path, f"{name}/train")
        assert set(given["gpus"]) == held[name], (name, given)


def test_local_job_asking_more_gpus_than_the_machine_has_is_refused_before_anything_runs(
    repo_root, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(repo_root)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    folder = configs(tmp_path, {"big": 3, "small": 1}, local_parallel_jobs=2)
    # With preflight on: the refusal comes before it (preflight writes its token counts into runs/).
    assert launch.main(["--all", "--config-dir", str(folder), "--backend", "local"]) == 2
    err = capsys.readouterr().err
    assert (
        "configs/big.yaml: resources.gpus: asks for 3 GPUs but this machine has 2 "
        "(CUDA_VISIBLE_DEVICES='0,1')" in err
    ), err
    assert "e.g. resources.gpus=2 on the command line" in err and "small" not in err, err
    assert "1 problem(s); nothing was submitted." in err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "logs").exists()


def test_visible_gpus_are_read_as_cuda_reads_them_ids_and_uuids_kept(tmp_path, monkeypatch):
    assert visible_devices("0,1,2") == ("0", "1", "2")
    assert visible_devices(" GPU-8f3a , MIG-5c1e/1/0") == ("GPU-8f3a", "MIG-5c1e/1/0")
    assert visible_devices("") == () and visible_devices("-1") == ()  # every GPU hidden
    assert visible_devices("0,-1,1") == ("0",)  # CUDA stops at the first entry it cannot read
    listing = (
        "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-1111)\n"
        "  MIG 3g.40gb     Device  0: (UUID: MIG-2222)\n"
        "GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-3333)\n"
    )
    assert count_listed(listing) == 2
    # Without CUDA_VISIBLE_DEVICES: the GPUs nvidia-smi lists (a stand-in here: this machine has none).
    tool = tmp_path / "bin" / "nvidia-smi"
    tool.parent.mkdir()
    tool.write_text(f"#!/bin/sh\ncat <<'END'\n{listing}END\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tool.parent}:/usr/bin:/bin")
    assert VisibleGpus.detect({}).ids == ("0", "1")
    assert VisibleGpus.detect({"CUDA_VISIBLE_DEVICES": ""}).ids == ()  # the user hid them: none
    # A machine without GPUs runs GPU jobs on its CPUs (the demo, CI), rather than refusing them.
    assert gpus_needed(2, VisibleGpus((), "none")) == 0 and gpus_needed(2, VisibleGpus(("0", "1"), "")) == 2


def test_gpu_pool_never_gives_one_gpu_to_two_running_jobs():
    pool = GpuPool(("0", "1", "2"))
    first = pool.take(2)
    assert first == ("0", "1") and pool.take(2) is None  # one is free: a two-GPU job waits
    assert pool.take(1) == ("2",) and pool.take(1) is None and pool.take(0) == ()
    pool.give_back(first)
    assert pool.take(2) == ("0", "1")


def test_a_gpu_listed_three_times_runs_three_jobs_each_planning_for_a_third_of_its_memory():
    """Issue 40 (4): CUDA_VISIBLE_DEVICES=0,0,0 (bench/gpu_check's demo part) meant three jobs at once on
    GPU 0, but the pool held GPU ids as a set (one job at a time), and a job told so would still have
    planned its split for 95 % of the whole GPU: three such jobs run it out of memory."""
    from train.device import FAKE_FREE_GPU_GB, GPU_SHARES, Hardware, decide, free_gpu_gb

    pool = GpuPool(("0", "0", "0"))
    assert [pool.take(1) for _ in range(4)] == [("0",), ("0",), ("0",), None]  # a fourth waits for a slot
    assert pool.shares("0") == 3 and pool.take(2) is None  # never two ranks on one GPU
    pool.give_back(("0",))
    assert pool.take(1) == ("0",)
    cpu = decide(Hardware(), "auto")
    assert free_gpu_gb(cpu, {FAKE_FREE_GPU_GB: "80", GPU_SHARES: "3"}) == pytest.approx(80 / 3)
    assert free_gpu_gb(cpu, {FAKE_FREE_GPU_GB: "80"}) == 80.0
