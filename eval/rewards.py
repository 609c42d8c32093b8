"""A GRPO stage's rewards (`rewards` in `train.grpo`): each completion's reward is the eval's own per-example score
of it, so that a reward of 1 means what the report's 1 means. Torch-free: the launch checks the rewards on
the login node (slurm/planning/rewards.py) with the very code the training job runs.

- Score rewards (`score: KEY`) call eval/metrics.py's and eval/sql.py's per-example functions, whose means
  are the report's scores. The completion is scored as its text after the eval's cleaning (the GRPO module
  decodes it as eval/generate.py decodes a prediction, then hands it here).
- The SQL scores run each completion read-only under their own per-query limit (`timeout_s`); each gold
  query runs once per job and is kept (a gold that fails scores its completions None: TRL leaves them out,
  as the eval leaves such examples out of its means).
- A user's function (`function: "module:name"`) is imported from the config's folder and called as TRL
  calls a reward function: (prompts, completions, completion_ids, reference=..., **columns) -> floats.
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from core.config import RewardSpec
from core.names import SQL_REWARD_SCORES
from eval.metrics import exact_match_each, rouge_each


class ScoreReward:
    """An eval score as a reward: `each(completions, references)` -> one float (or None) per completion."""

    def __init__(self, spec: RewardSpec, db: str | None):
        self.name, self.timeout_s = spec.score, spec.timeout_s
        self.db_path = db if spec.score in SQL_REWARD_SCORES else None
        self.database = None
        self.golds: dict[str, object] = {}  # gold query -> its ExecResult, run once per job

    def each(self, completions: Sequence[str], references: Sequence[str]) -> list[float | None]:
        if self.name == "exact_match":
            return exact_match_each(completions, references)
        if self.name in ("rouge_1", "rouge_2", "rouge_l"):
            return rouge_each(completions, references)[self.name]
        return [
            self.sql_score(completion, gold) for completion, gold in zip(completions, references, strict=True)
        ]

    def sql_score(self, completion: str, gold_query: str) -> float | None:
        from eval.sql import pair_scores

        gold = self.gold(gold_query)
        if gold.error is not None:  # a data bug (preflight refuses it): no score, as in the eval's means
            return None
        return pair_scores(self.database.execute(completion, self.timeout_s), gold, gold_query)[self.name]

    def gold(self, gold_query: str):
        """The gold query's ExecResult, run once per job (the database opened at the first)."""
        from eval.sql import ReadOnlyDB

        if self.database is None:
            self.database = ReadOnlyDB(self.db_path)
        if gold_query not in self.golds:
            self.golds[gold_query] = self.database.execute(gold_query, self.timeout_s)
        return self.golds[gold_query]

    def gold_error(self, gold_query: str) -> str | None:
        """What running the gold query said, if it failed (the launch's check); no completion is run."""
        return self.gold(gold_query).error


def user_function(spec: RewardSpec, folder: str | Path) -> Callable:
    """The function `module:name` of a reward entry, imported with the config's folder first on the path."""
    module_name, _, name = spec.function.partition(":")
    folder = str(Path(folder).resolve())
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module = importlib.import_module(module_name)
    function = getattr(module, name, None)
    if not callable(function):
        raise ImportError(f"{module_name}.py in {folder} has no function {name}")
    return function


def finite_or_none(value) -> float | None:
    """A reward as TRL takes it: a finite float, or None (no reward for this completion)."""
    if value is None:
        return None
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"a reward must be a finite number, not {value}")
    return value
