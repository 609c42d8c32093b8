"""The speed book, `RUN_ROOT/speeds.jsonl`: one row per finished training stage, appended by its rank 0,
and one per finished eval job (`"kind": "eval"`).

The launcher's time estimates (slurm/estimate.py) read it before they guess: a model that has trained here
once is estimated from what it did. Torch-free, so the launcher can read what the trainer writes.

Tokens are prompt + target tokens of the examples trained on (a causal model's one sequence, a seq2seq
model's encoder input and labels), padding not counted: the unit the estimates count data in.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from train.config import TrainJob

FILE = "speeds.jsonl"


@dataclass(frozen=True)
class SpeedRecord:
    model: str  # model.name_or_path as the YAML wrote it: what a later job is matched on
    method: str  # lora | qlora
    precision: str  # what ran: bf16 | fp16 | fp32
    device_name: str  # the GPU's name as torch gives it ("NVIDIA H100 80GB HBM3"), or "cpu"
    world_size: int
    batch_size: int  # per device
    grad_accum: int
    max_length: int  # the longest sequence the stage allowed (auto: what it chose)
    tokens_per_s: float  # the whole job's (all ranks), from first to last step end, evals and saves out
    startup_s: float  # process start to the end of the first optimizer step
    eval_s: float | None  # per in-training eval (loss only), None when none ran
    eval_examples: int | None  # in the in-training eval set: eval_s scales with it
    save_s: float | None  # per checkpoint save, None when none was timed
    data: str  # data.train: an `hf:` dataset's size is known from here before it is read again
    examples: int  # in data.train, as trained (after examples cut whole were dropped)
    tokens_per_example: float
    time: float  # when it was written (Unix seconds): the newest of equally near rows wins
    calibration: bool = False  # written by a `launch.py --calibrate` run (a few dozen steps), not a stage
    # train.gradient_checkpointing (one more forward per step); None in rows written before it was kept
    gradient_checkpointing: bool | None = None


@dataclass(frozen=True)
class EvalSpeedRecord:
    """An eval job's row (`"kind": "eval"` in the same book): what generating and scoring took."""

    model: str
    device_name: str
    num_beams: int
    batch_size: int
    max_new_tokens: int
    batches: int
    startup_s: float  # process start to the model loaded, adapter included
    decode_step_s: float  # generation seconds ÷ (batches x max_new_tokens): early stops included
    scoring_s: float  # metrics after generation (SQL execution, BERTScore...)
    time: float
    kind: str = "eval"


def book_of(job: TrainJob) -> Path | None:
    """RUN_ROOT/speeds.jsonl for a stage in the plan's layout (RUN_ROOT/EXP/STAGE); a stage run by hand
    in another folder writes no speed book (it would land in some unrelated parent folder)."""
    run_dir = Path(job.run_dir)
    if (run_dir.parent.name, run_dir.name) != (job.experiment, job.stage):
        return None
    return run_dir.parent.parent / FILE


def eval_book_of(out_dir: str, experiment: str) -> Path | None:
    """RUN_ROOT/speeds.jsonl for an eval job in the plan's layout (RUN_ROOT/EXP/eval*), else None."""
    folder = Path(out_dir)
    return folder.parent.parent / FILE if folder.parent.name == experiment else None


def append(book: Path, record: SpeedRecord | EvalSpeedRecord) -> None:
    """One line in append mode: a row shorter than the filesystem's atomic append never interleaves, and
    a row cut by a kill is skipped by the reader."""
    with open(book, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(asdict(record)) + "\n")


def read_book(book: Path) -> list[SpeedRecord]:
    """Every readable training row; broken or foreign rows are skipped (a missing book is an empty one)."""
    return _rows(book, SpeedRecord, lambda row: row.get("kind", "train") == "train")


def read_eval_book(book: Path) -> list[EvalSpeedRecord]:
    return _rows(book, EvalSpeedRecord, lambda row: row.get("kind") == "eval")


def _rows(book: Path, record_type, wanted) -> list:
    try:
        lines = book.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    names = {f.name for f in fields(record_type)}
    records = []
    for line in lines:
        try:
            row = json.loads(line)
            if wanted(row):
                records.append(record_type(**{k: v for k, v in row.items() if k in names}))
        except (ValueError, TypeError, AttributeError):
            continue
    return records
