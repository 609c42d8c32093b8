"""Examples → prompts → token ids, cached on disk under a key that changes with anything that matters.

Causal LMs learn only the target: prompt tokens are labelled -100. Lengths are measured once, so
`max_length: auto` can pick the smallest length that truncates nothing instead of a blind 2048.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import datasets

from train.config import DataSpec
from train.examples import check_file, check_rows, numbered_csv, numbered_jsonl

log = logging.getLogger("train.data")
FIXED_LENGTHS = (128, 256, 512, 1024, 2048)


def read_rows(source: str, spec: DataSpec) -> list[dict]:
    """Checked rows of a .jsonl/.csv/.parquet file, or of `hf:NAME:SPLIT` (honours HF_DATASETS_OFFLINE)."""
    if source.startswith("hf:"):
        name, _, split = source[3:].partition(":")
        rows = list(datasets.load_dataset(name, split=split or "train"))
        check_rows(list(enumerate(rows, 1)), spec, Path(source))
        return rows
    path = Path(source)
    check_file(path, spec)
    if path.suffix.lower() == ".parquet":
        return list(datasets.Dataset.from_parquet(str(path)))
    return [row for _, row in (numbered_csv(path) if path.suffix.lower() == ".csv" else numbered_jsonl(path))]


def prompt_of(row: dict, spec: DataSpec) -> str:
    if spec.prompt_template is None:
        return str(row[spec.input_field])
    return spec.prompt_template.format(**row)


def prompts_and_targets(source: str, spec: DataSpec, limit: int | None = None) -> tuple[list[str], list[str]]:
    rows = read_rows(source, spec)[:limit]
    return [prompt_of(r, spec) for r in rows], [str(r[spec.target_field]) for r in rows]


def encode(tokenizer, prompts: list[str], targets: list[str], kind: str) -> dict[str, list]:
    """Token ids with no truncation; truncation comes later, once lengths are known."""
    if kind == "seq2seq":
        inputs = tokenizer(prompts)["input_ids"]
        labels = tokenizer(text_target=targets)["input_ids"]
        return {"input_ids": inputs, "labels": labels, "length": [len(i) for i in inputs]}
    prompt_ids = tokenizer(prompts)["input_ids"]
    target_ids = tokenizer(targets, add_special_tokens=False)["input_ids"]
    input_ids, labels = [], []
    for p, t in zip(prompt_ids, target_ids, strict=True):
        full = p + t + [tokenizer.eos_token_id]
        input_ids.append(full)
        labels.append([-100] * len(p) + t + [tokenizer.eos_token_id])
    return {"input_ids": input_ids, "labels": labels, "length": [len(i) for i in input_ids]}


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    extra = json.dumps([str(t) for t in tokenizer.all_special_tokens] + [tokenizer.padding_side])
    return hashlib.sha256((text + extra).encode()).hexdigest()[:16]


def source_fingerprint(source: str) -> str:
    if source.startswith("hf:"):
        return source
    stat = Path(source).stat()
    return f"{Path(source).resolve()}:{stat.st_size}:{stat.st_mtime_ns}"


def cache_root() -> Path:
    return Path(os.environ.get("LORA_CACHE_DIR", Path.home() / ".cache" / "lora-pipeline"))


def tokenized(source: str, spec: DataSpec, tokenizer, kind: str) -> datasets.Dataset:
    """The tokenized examples of one file, from the disk cache when nothing that matters changed."""
    key_parts = [
        source_fingerprint(source),
        tokenizer_fingerprint(tokenizer),
        kind,
        spec.prompt_template or "",
        spec.input_field,
        spec.target_field,
    ]
    key = hashlib.sha256(json.dumps(key_parts).encode()).hexdigest()[:20]
    folder = cache_root() / "tokenized" / key
    if (folder / "dataset_info.json").is_file():
        log.info("tokenized %s: from cache %s", source, folder)
        return datasets.load_from_disk(str(folder))
    prompts, targets = prompts_and_targets(source, spec)
    dataset = datasets.Dataset.from_dict(encode(tokenizer, prompts, targets, kind))
    tmp = folder.with_name(f"{key}.{os.getpid()}.tmp")
    dataset.save_to_disk(str(tmp))
    if not folder.exists():  # another job may have cached the same data meanwhile: theirs is as good
        os.replace(tmp, folder)
    return datasets.load_from_disk(str(folder))


@dataclass(frozen=True)
class LengthReport:
    max_length: int
    max_target_length: int | None
    longest: int
    truncated_at: dict[int, int]  # fixed length → how many examples it would cut

    def describe(self) -> str:
        cuts = ", ".join(f"{n} at {length}" for length, n in self.truncated_at.items())
        return (
            f"longest example {self.longest} tokens; max_length {self.max_length}; would be truncated: {cuts}"
        )


def round_up(value: int, multiple: int = 8) -> int:
    return -(-value // multiple) * multiple


def choose_lengths(dataset: datasets.Dataset, spec: DataSpec, kind: str) -> LengthReport:
    lengths = dataset["length"]
    longest = max(lengths)
    max_length = round_up(longest) if spec.max_length == "auto" else spec.max_length
    target = None
    if kind == "seq2seq":
        longest_target = max(len(x) for x in dataset["labels"])
        target = round_up(longest_target) if spec.max_target_length == "auto" else spec.max_target_length
    truncated = {n: sum(1 for x in lengths if x > n) for n in FIXED_LENGTHS}
    return LengthReport(max_length, target, longest, truncated)


def truncate(dataset: datasets.Dataset, lengths: LengthReport) -> datasets.Dataset:
    if lengths.max_length >= lengths.longest and lengths.max_target_length is None:
        return dataset

    def cut(batch):
        batch["input_ids"] = [x[: lengths.max_length] for x in batch["input_ids"]]
        limit = lengths.max_target_length or lengths.max_length
        batch["labels"] = [x[:limit] for x in batch["labels"]]
        batch["length"] = [len(x) for x in batch["input_ids"]]
        return batch

    return dataset.map(cut, batched=True, keep_in_memory=True)


def padding_fraction(lengths: list[int], batch_size: int, grouped: bool) -> float:
    """Share of pad tokens if batches are formed in this order (sorted when length-grouped)."""
    order = sorted(lengths) if grouped else lengths
    padded = sum(
        max(order[i : i + batch_size]) * len(order[i : i + batch_size])
        for i in range(0, len(order), batch_size)
    )
    return 1 - sum(lengths) / padded if padded else 0.0
