"""How busy the job's GPUs are, as `nvidia-smi` would say: utilisation and memory, sampled through NVML.

    sampler = GpuSampler.for_gpus(uuids)    # None without GPUs, without NVML, or when NVML fails to start
    sampler.start()
    ...                                     # every INTERVAL_S a daemon thread keeps one Sample
    summarize(sampler.drain())              # {"gpu_util_percent", "gpu_mem_gb", "gpu_mem_total_gb"} or {}
    sampler.stop()

Across nodes NVML sees only its own node's GPUs, so each node's first rank samples its node (`watch_plan`):
rank 0 keeps its samples, the others post theirs to rank 0 (`keep=`, through the rendezvous store:
train/distributed.py post/collect), and rank 0's `JobGpus.drain()` gives every node's samples since the
last row; `summarize_nodes` makes them the row's fields, with one entry per node under `gpu_nodes`.

Why a thread, not a reading per logging step: a step can take seconds or milliseconds, and the training
thread should not pay for NVML calls. The thread only reads NVML and appends to a list; any error ends the
sampling with one warning, never the training. The values are device-wide (every process on the GPU counts,
as in nvidia-smi), not this process's share.

`summarize` is pure: tests feed it recorded samples. Torch-free: NVML (`pynvml`, the nvidia-ml-py package)
is imported only when a GPU is there to watch.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import astuple, dataclass

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


def summarize_nodes(by_node: Mapping[str, list[Sample]]) -> dict:
    """`summarize` over every node's samples together (the mean utilisation of all GPUs, the fullest GPU of
    any node) and, for a job on more than one node, each node's own under `gpu_nodes` ({} for a node whose
    samples have not come since the last row)."""
    fields = summarize([sample for samples in by_node.values() for sample in samples])
    if len(by_node) > 1 and fields:
        fields["gpu_nodes"] = {node: summarize(samples) for node, samples in sorted(by_node.items())}
    return fields


def watch_plan(where: list[tuple[str, str | None]], rank: int) -> tuple[list[str], dict[int, str]]:
    """What this rank watches, given every rank's (node, GPU UUID or None) in rank order: the GPUs of its
    node if it is its node's first rank, else none; and, for rank 0, the other nodes' first ranks (who post
    their samples to it) with their nodes. Nodes without GPUs (a CPU run) are left out."""
    first: dict[str, int] = {}
    for other, (node, uuid) in enumerate(where):
        if uuid:
            first.setdefault(node, other)
    node = where[rank][0]
    mine = (
        [uuid for other_node, uuid in where if other_node == node and uuid] if first.get(node) == rank else []
    )
    posting = {other: n for n, other in first.items() if other != 0} if rank == 0 else {}
    return mine, posting


def encode(sample: Sample) -> str:
    """A sample as the text a node posts to rank 0 (`decode` reads it)."""
    return json.dumps([astuple(reading) for reading in sample])


def decode(text: str) -> Sample:
    return tuple(Reading(*fields) for fields in json.loads(text))


class JobGpus:
    """Rank 0's view of the job's GPUs: its own node's sampler and what the other nodes posted."""

    def __init__(
        self,
        node: str,
        sampler: GpuSampler | None,
        posting: dict[int, str],
        collect: Callable[[list[int]], dict[int, list[str]]],
    ):
        self.node, self.sampler, self.posting, self.collect = node, sampler, posting, collect

    def drain(self) -> dict[str, list[Sample]]:
        """Each node's samples since the last drain (only the nodes that have GPUs to watch)."""
        by_node = {self.node: self.sampler.drain()} if self.sampler else {}
        if self.posting:
            for rank, texts in self.collect(list(self.posting)).items():
                by_node[self.posting[rank]] = [decode(text) for text in texts]
        return by_node


class GpuSampler:
    """Reads `read()` every `interval_s` on a daemon thread and keeps the samples until drained, or hands
    each to `keep` (another node's first rank: posting it to rank 0)."""

    def __init__(
        self,
        read: Callable[[], Sample],
        interval_s: float = INTERVAL_S,
        close=lambda: None,
        keep: Callable[[Sample], None] | None = None,
    ):
        self.read, self.interval_s, self.close = read, interval_s, close
        self.keep = keep or self.keep_here
        self.samples: list[Sample] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="gpu-sampler", daemon=True)

    @classmethod
    def for_gpus(
        cls, uuids: list[str], interval_s: float = INTERVAL_S, keep: Callable[[Sample], None] | None = None
    ) -> GpuSampler | None:
        """A sampler of these GPUs (NVML UUIDs, `GPU-...`), or None when there is nothing to watch."""
        read = nvml_reader(uuids) if uuids else None
        if read is None:
            return None
        import pynvml

        return cls(read, interval_s, close=pynvml.nvmlShutdown, keep=keep)

    def start(self) -> None:
        self.thread.start()

    def run(self) -> None:
        while not self.stopping.wait(self.interval_s):
            try:
                sample = self.read()
                self.keep(sample)
            except Exception as exc:  # NVML can fail mid-run (driver reset, GPU lost), or the post to rank
                log.warning("GPU sampling stopped: %s", exc)  # 0 (it ended): stop watching only
                return

    def keep_here(self, sample: Sample) -> None:
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
