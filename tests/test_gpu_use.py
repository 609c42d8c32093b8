"""GPU use: the aggregation on recorded samples, the sampler thread with a fake reader, the callback's
files, and the path without a GPU for real (this machine has neither a GPU nor NVML's library).

The readings below are made up in NVML's shape (utilisation %, used/total bytes), not recorded from a GPU:
no GPU was at hand. What they test is the arithmetic and the plumbing, which does not depend on the card.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from types import SimpleNamespace

import pytest

from tests.train_helpers import make_job, read_jsonl
from train import distributed
from train.callbacks import RunDirectoryLog
from train.device import current
from train.gpu_use import GpuSampler, JobGpus, Reading, encode, summarize, summarize_nodes, watch_plan
from train.recipe import run_stage

GIB = 2**30
H100 = 85_520_809_984  # bytes NVML reports as an H100's total
# Two GPUs of a DDP job over three samples: GPU 1 holds more memory and peaks in the second sample.
SAMPLES = [
    (Reading(90, 30 * GIB, H100), Reading(80, 40 * GIB, H100)),
    (Reading(100, 31 * GIB, H100), Reading(70, 60 * GIB, H100)),
    (Reading(50, 30 * GIB, H100), Reading(90, 41 * GIB, H100)),
]


def test_mean_utilisation_and_the_fullest_gpus_peak_memory():
    # Averaging memory over samples would hide the 60 GiB peak that is what runs out; summing over GPUs
    # would report 91 GiB on 80 GB cards.
    assert summarize(SAMPLES) == {
        "gpu_util_percent": 80.0,  # (90 + 80 + 100 + 70 + 50 + 90) / 6
        "gpu_mem_gb": 64.42,  # 60 GiB in GB
        "gpu_mem_total_gb": 85.52,
    }


def test_no_samples_give_no_fields_not_an_idle_gpu():
    assert summarize([]) == {} and summarize([(), ()]) == {}


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.time() + timeout_s
    while not condition() and time.time() < deadline:
        time.sleep(0.01)
    assert condition()


def test_sampler_collects_until_drained_and_a_failing_read_ends_only_the_sampling(caplog):
    readings = iter([SAMPLES[0], SAMPLES[1]])

    def read():
        sample = next(readings, None)
        if sample is None:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return sample

    sampler = GpuSampler(read, interval_s=0.01)
    with caplog.at_level(logging.WARNING, logger="train.gpu_use"):
        sampler.start()
        wait_for(lambda: not sampler.thread.is_alive())
    assert sampler.drain() == SAMPLES[:2] and sampler.drain() == []
    assert "GPU sampling stopped: NVML_ERROR_GPU_IS_LOST" in caplog.text
    sampler.stop()  # after the thread ended on its own: still fine


def test_without_nvml_or_gpu_there_is_no_sampler():
    assert GpuSampler.for_gpus([]) is None  # a CPU run: NVML is not even started
    # No NVML library here; on a GPU node this UUID is no GPU's: either way nothing to watch.
    assert GpuSampler.for_gpus(["GPU-00000000-0000-0000-0000-000000000000"]) is None


class FakeSampler:
    def __init__(self, batches):
        self.batches = list(batches)

    def drain(self):
        return self.batches.pop(0)


def test_each_nodes_first_rank_watches_its_own_nodes_gpus_not_rank_0_all_of_them():
    # Two nodes of two GPUs. Rank 0 once watched every rank's GPU; NVML on n1 cannot see n2's, so n2 went
    # unwatched (and its UUIDs were logged as "not sampled").
    where = [("n1", "GPU-a"), ("n1", "GPU-b"), ("n2", "GPU-c"), ("n2", "GPU-d")]
    assert watch_plan(where, 0) == (["GPU-a", "GPU-b"], {2: "n2"})
    assert watch_plan(where, 1) == ([], {})
    assert watch_plan(where, 2) == (["GPU-c", "GPU-d"], {})
    assert watch_plan(where, 3) == ([], {})
    # One node: rank 0 watches all, nobody posts (the rows stay as they were).
    assert watch_plan(where[:2], 0) == (["GPU-a", "GPU-b"], {})
    # A CPU run on two nodes: nothing to watch, nothing to collect at each row.
    assert watch_plan([("n1", None), ("n2", None)], 0) == ([], {})


def test_a_rows_gpu_fields_cover_every_node_and_name_each_one():
    # n2's GPU is the fullest (60 GiB): one node's peak would hide it.
    fields = summarize_nodes({"n1": [SAMPLES[0][:1]], "n2": [SAMPLES[1][1:]]})
    assert fields["gpu_util_percent"] == 80.0 and fields["gpu_mem_gb"] == 64.42  # (90 + 70) / 2; 60 GiB
    assert fields["gpu_nodes"] == {"n1": summarize([SAMPLES[0][:1]]), "n2": summarize([SAMPLES[1][1:]])}
    assert "gpu_nodes" not in summarize_nodes({"n1": SAMPLES})  # one node: the row is as it always was
    assert summarize_nodes({"n1": [], "n2": []}) == {}  # no samples yet: no fields, not an idle GPU


@pytest.fixture
def store(monkeypatch):
    """A real rendezvous store (torch's TCPStore) hosted by this process, as rank 0 hosts it in a job."""
    import socket

    from torch.distributed import TCPStore

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(distributed, "_store", TCPStore("127.0.0.1", port, 1, is_master=True))
    monkeypatch.setattr(distributed, "_posted", {})
    monkeypatch.setattr(distributed, "_collected", {})
    return distributed._store


def test_another_nodes_samples_reach_rank_0s_rows_through_the_store_each_once(tmp_path, store):
    # The other node's first rank is played by a sampler thread posting through the real store; its reader
    # is recorded readings (no NVML here). Each sample must reach one row, never two, and leave the store.
    readings, allowed, posted = iter(SAMPLES), threading.Semaphore(0), threading.Semaphore(0)

    def read():  # one reading each time the test allows one; past the third, NVML "fails"
        assert allowed.acquire(timeout=5)
        return next(readings)

    def post(sample):
        distributed.post("gpu_use", encode(sample))
        posted.release()

    remote = GpuSampler(read, interval_s=0.01, keep=post)
    gpus = JobGpus(
        "n1", FakeSampler([[SAMPLES[0]], [], []]), {0: "n2"}, lambda r: distributed.collect("gpu_use", r)
    )
    callback = RunDirectoryLog(tmp_path, gpus)
    callback.on_train_begin(None, SimpleNamespace(global_step=0, num_input_tokens_seen=0), None)
    remote.start()
    for _ in range(2):
        allowed.release()
        assert posted.acquire(timeout=5)
    log_step(callback, 1, {"loss": 2.0})
    allowed.release()
    assert posted.acquire(timeout=5)
    allowed.release()  # the fourth read finds no reading: the sampler ends
    remote.stop()
    log_step(callback, 2, {"loss": 1.9})
    log_step(callback, 3, {"loss": 1.8})
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows[0]["gpu_nodes"] == {"n1": summarize([SAMPLES[0]]), "n2": summarize(SAMPLES[:2])}
    assert rows[1]["gpu_nodes"] == {"n1": {}, "n2": summarize(SAMPLES[2:])}
    assert "gpu_util_percent" not in rows[2]  # nothing new from either node
    assert not store.check(["gpu_use/0/1"]) and not store.check(["gpu_use/0/3"])


def log_step(callback: RunDirectoryLog, step: int, logs: dict) -> None:
    args = SimpleNamespace(train_batch_size=8, gradient_accumulation_steps=1, world_size=1)
    state = SimpleNamespace(global_step=step, epoch=step / 10, num_input_tokens_seen=100 * step, max_steps=10)
    state.is_world_process_zero = True
    callback.on_log(args, state, None, logs=logs)


def test_rows_carry_the_gpu_use_since_the_last_row_and_progress_keeps_the_latest(tmp_path):
    callback = RunDirectoryLog(tmp_path, FakeSampler([{"n1": SAMPLES[:2]}, {"n1": []}, {"n1": SAMPLES[2:]}]))
    state = SimpleNamespace(global_step=0, num_input_tokens_seen=0)
    callback.on_train_begin(None, state, None)
    log_step(callback, 1, {"loss": 2.0})
    progress_1 = json.loads((tmp_path / "progress.json").read_text())
    log_step(callback, 2, {"loss": 1.9})  # no sample since step 1 (steps faster than the interval)
    progress_2 = json.loads((tmp_path / "progress.json").read_text())
    log_step(callback, 3, {"loss": 1.8})
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows[0]["gpu_util_percent"] == 85.0 and rows[0]["gpu_mem_gb"] == 64.42
    assert "gpu_util_percent" not in rows[1]
    assert rows[2]["gpu_util_percent"] == 70.0 and rows[2]["gpu_mem_gb"] == 44.02
    assert progress_1["gpu_util_percent"] == progress_2["gpu_util_percent"] == 85.0


def test_a_run_without_gpu_writes_no_gpu_fields_and_completes(tiny, tmp_path):
    # A CPU run must complete without NVML and write no gpu_ fields (zeros would read as an idle GPU). On a
    # GPU node the same run trains on its GPU (whether a sample lands in 3 steps depends on its speed).
    job = make_job(tiny, tmp_path)
    assert run_stage(job) == "completed"
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    progress = json.loads((tmp_path / "progress.json").read_text())
    if current("auto").cuda:
        assert json.loads((tmp_path / "summary.json").read_text())["device"].startswith("cuda")
        return
    assert rows and not [key for row in rows for key in row if key.startswith("gpu_")]
    assert not [key for key in progress if key.startswith("gpu_")]


@pytest.fixture(autouse=True)
def no_leftover_sampler_threads():
    yield
    assert not [t for t in threading.enumerate() if t.name == "gpu-sampler" and t.is_alive()]
