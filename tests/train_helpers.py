"""Helpers for the trainer's tests (tests/test_train_*.py): small jobs over the demo data on the tiny models
(the `tiny` fixture in conftest.py). Everything runs offline on the CPU."""

from __future__ import annotations

import json
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SQL = ROOT / "data" / "demo" / "sql"
PROMPT = "{schema} | {question} | SQL: "


def sql_data(split: str = "easy", eval_split: str | None = None, **extra) -> dict:
    """A DataSpec (as a dict) over the demo text-to-SQL files: schema and question in every prompt."""
    return {
        "train": str(SQL / f"{split}.jsonl"),
        "eval": str(SQL / f"{eval_split}.jsonl") if eval_split else None,
        "input_field": "question",
        "target_field": "sql",
        "prompt_template": PROMPT,
    } | extra


def model_spec(tiny: dict[str, Path], kind: str = "causal", **extra) -> dict:
    name = "tiny-t5" if kind == "seq2seq" else "tiny-llama"
    return {"name_or_path": str(tiny[name]), "kind": kind} | extra


def make_job(tiny, run_dir: Path, kind: str = "causal", *, model=None, adapter=None, data=None, **train):
    """A small TrainJob: LoRA r8 without dropout (deterministic), 3 steps, a log row per step, no eval."""
    from train.config import TrainJob

    return TrainJob(
        experiment="t",
        stage="s",
        model=model or model_spec(tiny, kind),
        adapter={"rank": 8, "alpha": 16, "dropout": 0.0, "max_trainable_percent": 30} | (adapter or {}),
        data=data or sql_data(),
        train={
            "max_steps": 3,
            "learning_rate": 3e-3,
            "batch_size": 8,
            "logging_steps": 1,
            "eval_every_epochs": None,
            "warmup_ratio": 0.0,
        }
        | train,
        run_dir=str(run_dir),
    )


class StopAfter(threading.Event):
    """A stop flag that sets itself after `steps` checks (the trainer checks once per step end), as the job
    wrapper's flag does when SLURM's signal arrives during that step."""

    def __init__(self, steps: int):
        super().__init__()
        self.steps, self.calls = steps, 0

    def is_set(self) -> bool:
        self.calls += 1
        return self.calls > self.steps


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
