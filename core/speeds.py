"""The speed book, `RUN_ROOT/speeds.jsonl`: one row per finished training stage, appended by its rank 0,
and one per finished eval job (`"kind": "eval"`).

The launcher's time estimates (slurm/planning/estimate.py) read it before they guess: a model that has trained here
once is estimated from what it did. Torch-free, so the launcher can read what the trainer writes.

Tokens are prompt + target tokens of the examples trained on (a causal model's one sequence, a seq2seq
model's encoder input and labels), padding not counted: the unit the estimates count data in.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import get_args, get_type_hints

from core.config import TrainJob
from core.files import append_json_line, read_jsonl, warn_unreadable
from core.rundir import RunDir, RunRoot


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
    # train.method: a DPO step runs two sequences per example and a reference forward, so its speed is its
    # own; rows written before it was kept are SFT's
    objective: str = "sft"
    # A GRPO stage's sampling, apart from its training (tokens_per_s is then the training's alone): seconds
    # per decoding step of a generation of `decode_batch` completions. None in every other row.
    decode_step_s: float | None = None
    decode_batch: int | None = None


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
    return RunRoot.of(RunDir(run_dir).run_root).speed_book


def eval_book_of(out_dir: str, experiment: str) -> Path | None:
    """RUN_ROOT/speeds.jsonl for an eval job in the plan's layout (RUN_ROOT/EXP/eval*), else None."""
    folder = Path(out_dir)
    return RunRoot.of(RunDir(folder).run_root).speed_book if folder.parent.name == experiment else None


def append(book: Path, record: SpeedRecord | EvalSpeedRecord) -> None:
    """One line of strict JSON in append mode (core/files.py append_json_line): a row shorter than the
    filesystem's atomic append never interleaves, a row cut by a kill is skipped by the reader, and the
    next row starts a line of its own."""
    try:
        append_json_line(book, asdict(record), root=book.parent)  # the run root: nothing between
    except OSError as exc:  # a FIFO, a folder or a link where the book belongs: the job's work stands
        why = f"cannot be appended to ({exc.strerror or exc})"
        warn_unreadable(book, why, "this job's speed row is not recorded")


def read_book(book: Path) -> list[SpeedRecord]:
    """Every readable training row; broken or foreign rows are skipped (a missing book is an empty one)."""
    return _rows(book, SpeedRecord, lambda row: row.get("kind", "train") == "train")


def read_eval_book(book: Path) -> list[EvalSpeedRecord]:
    return _rows(book, EvalSpeedRecord, lambda row: row.get("kind") == "eval")


# Numbers the estimates divide by or take the logarithm of (slurm/planning/estimate.py): a row with one at 0 or below
# would crash them, so it is skipped with a warning, as a row of another shape is.
POSITIVE = ("world_size", "batch_size", "grad_accum", "max_length", "tokens_per_s", "batches")


def _rows(book: Path, record_type, wanted) -> list:
    """Rows of `record_type`: keys of another kind, rows without a required key and rows with a number
    that is not finite, negative or, of POSITIVE, zero are skipped, the book named in a warning."""
    kinds = field_kinds(record_type)
    records, wrong = [], []
    for row in read_jsonl(book, kinds):
        if not wanted(row):
            continue
        try:
            record = record_type(**{k: v for k, v in row.items() if k in kinds})
        except TypeError:
            wrong.append(f"a row without {', '.join(sorted(required(record_type) - set(row)))}")
            continue
        if bad := insane(record):
            wrong.append(f"a row with {bad}")
            continue
        records.append(record)
    if wrong:
        warn_unreadable(book, f"{wrong[0]}" + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""))
    return records


def field_kinds(record_type) -> dict:
    """Field name → the kind read_jsonl checks (`float | None` → float: a null is always let through)."""
    hints = get_type_hints(record_type)
    return {
        name: next(k for k in get_args(hint) or (hint,) if k is not type(None))
        for name, hint in hints.items()
    }


def required(record_type) -> set[str]:
    return {f.name for f in fields(record_type) if f.default is MISSING and f.default_factory is MISSING}


def insane(record) -> str | None:
    """`key value (why)` for the first number the estimates cannot use; None when all can be."""
    for name, value in asdict(record).items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not math.isfinite(value) or value < 0 or (value == 0 and name in POSITIVE):
            return f"{name} {value} (must be {'above' if name in POSITIVE else 'at least'} 0)"
    return None
