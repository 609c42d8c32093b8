"""What preflight counted, kept in the run root for the plans after it (core/rundir.py RunRoot): each
training file's exact examples and tokens (`preflight-tokens.json`, keyed by `exact_key`) and the batch
split each job chose on its partition's GPU (`preflight-splits.json`, keyed by `split_key`). The estimate
(slurm/planning/estimate.py) and the dry run read them; a preflight writes them
(slurm/watching/preflight_report.py). Torch-free: the keys are found without reading a file."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from core.config import TrainJob
from core.files import is_kind, read_json, warn_unreadable, write_json_atomic
from core.hashing import CACHE_KEY_CHARS, content_hash
from core.names import TOKENIZER_FILES
from core.rundir import RunRoot
from core.split import Split, resolve


@dataclass(frozen=True)
class DataTokens:
    examples: int
    tokens: float  # prompt + target tokens, summed over the examples
    # Assistant turns of each conversation, in file order (TextSize.answers); (): not conversations, or unknown
    answers: tuple[int, ...] = ()


def exact_key(spec: TrainJob) -> str:
    """What preflight's token count of a training file depends on, found without torch and without reading
    a file: the model and its added tokens, a local tokenizer's files and the data file by size and
    modification time, the data keys (max lengths included: the count is after truncation)."""

    def stamp(path: Path) -> list | None:
        if not path.is_file():
            return None
        stat = path.stat()
        return [path.name, stat.st_size, stat.st_mtime_ns]

    folder, source = Path(spec.model.name_or_path), spec.data.train
    parts = [
        spec.model.name_or_path,
        spec.model.revision,
        spec.model.kind,
        spec.model.added_tokens,
        [stamp(folder / name) for name in TOKENIZER_FILES] if folder.is_dir() else None,
        None if source.startswith("hf:") else stamp(Path(source)),
        spec.data.model_dump(exclude={"eval", "order", "num_workers"}),
    ]
    if spec.train.method == "grpo":  # its count is of prompts with their completions (train/grpo.py)
        grpo = spec.train.reward_objective
        parts.append(["grpo", grpo.num_generations, grpo.max_completion_length])
    return content_hash(parts, CACHE_KEY_CHARS)


def read_exact_tokens(run_root: str | Path) -> dict[str, DataTokens]:
    """Entries of another shape, or with no example or token (the estimates divide by both), are left
    out, the file named in a warning (core/files.py)."""
    path = RunRoot.of(run_root).preflight_tokens
    kept = read_json(path, {}, expected=dict)
    found = {
        k: DataTokens(v["examples"], v["tokens"])
        for k, v in kept.items()
        if is_kind(v, dict)
        and v.keys() == {"examples", "tokens"}
        and is_kind(v["examples"], int)
        and is_kind(v["tokens"], float)
        and v["examples"] > 0
        and 0 < v["tokens"] < math.inf
    }
    if len(found) < len(kept):
        warn_unreadable(path, f"{len(kept) - len(found)} entries are not a count of examples and tokens")
    return found


def record_exact_tokens(run_root: str | Path, counted: Iterable[tuple[TrainJob, int, int]]) -> None:
    """Keep preflight's (examples, tokens) of each job's training file for the estimates of later plans."""
    book = {k: {"examples": v.examples, "tokens": v.tokens} for k, v in read_exact_tokens(run_root).items()}
    new = {exact_key(spec): {"examples": examples, "tokens": tokens} for spec, examples, tokens in counted}
    if new and any(book.get(k) != v for k, v in new.items()):
        os.makedirs(run_root, exist_ok=True)
        write_json_atomic(RunRoot.of(run_root).preflight_tokens, book | new)


# ---- the batch split preflight chose (core/split.py), for the dry run and the estimate ------------------
def split_key(spec: TrainJob, gpu_mem_gb: float | None) -> str:
    """What the split a job chooses depends on, found without torch: the training file and model
    (exact_key), the adapter, the train keys the memory model reads, an eval's presence, the GPU's memory."""
    train = spec.train.model_dump(
        include={"batch_size", "grad_accum", "micro_batch", "gradient_checkpointing", "precision"}
    )
    evaluating = bool(spec.data.eval) and spec.train.eval_every_epochs is not None
    parts = [exact_key(spec), spec.adapter.model_dump(), train, evaluating, gpu_mem_gb]
    return content_hash(parts, CACHE_KEY_CHARS)


def read_splits(run_root: str | Path) -> dict[str, Split]:
    """Preflight's splits by split_key; entries of another shape are left out, the file named."""
    path = RunRoot.of(run_root).preflight_splits
    kept, found = read_json(path, {}, expected=dict), {}
    for key, value in kept.items():
        try:
            found[key] = Split.from_json(value)
        except TypeError:
            continue
    if len(found) < len(kept):
        warn_unreadable(path, f"{len(kept) - len(found)} entries are not a batch split")
    return found


def record_splits(run_root: str | Path, chosen: Iterable[tuple[TrainJob, float | None, dict]]) -> None:
    """Keep the split preflight chose for each job (on its partition's gpu_mem_gb) for later dry runs."""
    book = {k: v.as_json() for k, v in read_splits(run_root).items()}
    new = {split_key(spec, gpu_mem): split for spec, gpu_mem, split in chosen}
    if new and any(book.get(k) != v for k, v in new.items()):
        os.makedirs(run_root, exist_ok=True)
        write_json_atomic(RunRoot.of(run_root).preflight_splits, book | new)


def known_split(spec: TrainJob, splits: Mapping[str, Split], gpu_mem_gb: float | None) -> Split | None:
    """The split the job will run with, where known on the login node: an explicit micro_batch, or what
    preflight chose for `auto` on this GPU memory; None: chosen at the job's start."""
    if spec.train.micro_batch != "auto":
        return resolve(spec.train, None, None)
    return splits.get(split_key(spec, gpu_mem_gb))
