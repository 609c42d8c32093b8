"""How busy the job's GPUs are, as `nvidia-smi` would say: utilisation and memory, sampled through NVML.

    sampler = GpuSampler.for_gpus(uuids)    # None without GPUs, without NVML, or when NVML fails to start
    sampler.start()
    ...                                     # every INTERVAL_S a daemon thread appends one Sample
    summarize(sampler.drain())              # {"gpu_util_percent", "gpu_mem_gb", "gpu_mem_total_gb"} or {}
    sampler.stop()

Why a thread, not a reading per logging step: a step can take seconds or milliseconds, and the training
thread should not pay for NVML calls. The thread only reads NVML and appends to a list; any error ends the
sampling with one warning, never the training. The values are device-wide (every process on the GPU counts,
as in nvidia-smi), not this process's share.

`summarize` is pure: tests feed it recorded samples. Torch-free: NVML (`pynvml`, the nvidia-ml-py package)
is imported only when a GPU is there to watch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("train.gpu_use")

INTERVAL_S = 5.0
GB = 1e9  # decimal, as nvidia-smi's "80 GB" cards are sold and reported


@dataclass(frozen=True)
class Reading:
    """One GPU at one moment."""

    util_percent: float  # share of the last sample period in which a kernel ran (NVML's "gpu" rate)
    mem_used_bytes: int
    mem_total_bytes: int


Sample = tuple[Reading, ...]  # every watched GPU, read at one moment


def summarize(samples: list[Sample]) -> dict[str, float]:
    """The fields a metrics row and progress.json get for the samples since the last row: the mean
    utilisation over all GPUs and samples; the peak memory of the fullest GPU (what runs out first), and
    that GPU's size. No samples (no GPU, or none taken yet): no fields, rather than zeros that would read
    as an idle GPU."""
    readings = [reading for sample in samples for reading in sample]
    if not readings:
        return {}
    fullest = max(readings, key=lambda r: r.mem_used_bytes)
    return {
        "gpu_util_percent": round(sum(r.util_percent for r in readings) / len(readings), 1),
        "gpu_mem_gb": round(fullest.mem_used_bytes / GB, 2),
        "gpu_mem_total_gb": round(fullest.mem_total_bytes / GB, 2),
    }


class GpuSampler:
    """Reads `read()` every `interval_s` on a daemon thread and keeps the samples until drained."""

    def __init__(self, read: Callable[[], Sample], interval_s: float = INTERVAL_S, close=lambda: None):
        self.read, self.interval_s, self.close = read, interval_s, close
        self.samples: list[Sample] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="gpu-sampler", daemon=True)

    @classmethod
    def for_gpus(cls, uuids: list[str], interval_s: float = INTERVAL_S) -> GpuSampler | None:
        """A sampler of these GPUs (NVML UUIDs, `GPU-...`), or None when there is nothing to watch."""
        read = nvml_reader(uuids) if uuids else None
        if read is None:
            return None
        import pynvml

        return cls(read, interval_s, close=pynvml.nvmlShutdown)

    def start(self) -> None:
        self.thread.start()

    def run(self) -> None:
        while not self.stopping.wait(self.interval_s):
            try:
                sample = self.read()
            except Exception as exc:  # NVML can fail mid-run (driver reset, GPU lost): stop watching only
                log.warning("GPU sampling stopped: %s", exc)
                return
            with self.lock:
                self.samples.append(sample)

    def drain(self) -> list[Sample]:
        """The samples taken since the last drain."""
        with self.lock:
            samples, self.samples = self.samples, []
        return samples

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=self.interval_s + 5)  # a hung NVML call must not hold up the job's end
        try:
            self.close()
        except Exception as exc:
            log.debug("NVML shutdown: %s", exc)


def nvml_reader(uuids: list[str]) -> Callable[[], Sample] | None:
    """A function reading these GPUs, or None (no nvidia-ml-py, no driver, none of the GPUs found)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # ImportError, or NVMLError when the driver library is missing
        log.info("GPU use is not sampled: NVML unavailable (%s)", exc)
        return None
    handles = []
    for uuid in uuids:
        try:
            handles.append(pynvml.nvmlDeviceGetHandleByUUID(uuid))
        except Exception as exc:  # e.g. a GPU of another node: NVML sees only this node's
            log.info("GPU %s is not sampled: %s", uuid, exc)
    if not handles:
        pynvml.nvmlShutdown()
        return None

    def read() -> Sample:
        return tuple(read_gpu(pynvml, handle) for handle in handles)

    return read


def read_gpu(pynvml, handle) -> Reading:
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return Reading(
        util_percent=float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
        mem_used_bytes=int(memory.used),
        mem_total_bytes=int(memory.total),
    )
