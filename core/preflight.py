"""What preflight found for one training job: computed by train/preflight.py (torch) on a cache miss, kept
in the cache and judged on the login node by slurm/planning/preflight.py (torch-free)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


def trained_share(trained: int, total: int) -> str:
    """ "2,481 of 7,126 tokens trained on (34.8 %)": what the loss sees (axolotl's preprocess --debug shows it)."""
    return f"{trained:,} of {total:,} tokens trained on ({100 * trained / max(total, 1):.1f} %)"


@dataclass
class JobPreflight:
    job: str  # EXP/STAGE
    trainable_percent: float
    trainable_params: int
    total_params: int
    trainable_by_module: dict[str, int]
    max_trainable_percent: float
    max_length: int | None = None  # None: token lengths skipped (see tokens_skipped)
    max_target_length: int | None = None
    tokens_per_epoch: int | None = None  # prompt + target tokens as trained (train/data.py trained_tokens)
    labelled_tokens: int | None = None  # of those, the ones the loss sees (labels other than -100)
    # conversations whose content holds a special token's text (`<|im_end|>` typed into an answer): it is
    # encoded as that control token (train/data.py warn_marker_text); None: not chat data
    marker_text_conversations: int | None = None
    # p50, p90, p99, max of the untruncated lengths: "inputs" (causal, image-text: the whole sequence), and
    # "targets" for seq2seq
    length_percentiles: dict[str, list[int]] = field(default_factory=dict)
    examples: int | None = None
    longest_example: int | None = None
    truncated_inputs: int | None = None
    dropped_examples: int | None = None  # left out whole (DPO: pairs whose answer alone does not fit)
    truncated_at: dict[str, int] = field(default_factory=dict)
    # the lengths the memory model judges the steps at (train/preflight.py step_lengths): max_length,
    # max_target_length, the most target tokens of an example, and the eval set's own
    step_lengths: dict = field(default_factory=dict)
    tokens_skipped: str | None = None
    data_refused: str | None = None  # why the job would fail at its start on this data (deterministic)
    # GB = 10**9 bytes throughout (train/memory.py), as GPUs are sold and cluster.yaml's gpu_mem_gb is read
    memory_gb: float | None = None  # the larger of the training step's and the in-training eval's peak
    memory: dict = field(default_factory=dict)
    gpu_mem_gb: float | None = None
    split: dict | None = None  # core/split.py Split.as_json(): what the job will run with on this GPU
    fits: bool | None = None  # None: no gpu_mem_gb for this job's partition, or no length to judge by
    largest_batch: int | None = None
    alternatives: list[str] = field(default_factory=list)
    fetch: list[str] = field(default_factory=list)  # `hf download` commands for what this machine lacks

    @property
    def too_trainable(self) -> bool:  # unrounded, as check_trainable compares it
        return 100 * self.trainable_params / self.total_params > self.max_trainable_percent

    def as_json(self) -> dict:
        return asdict(self)
