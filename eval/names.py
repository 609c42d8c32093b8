"""Every metric name, in one place: what a config may ask for and what results.json holds.

Standard library only: train/config.py (the torch-free login-node schema) imports it, as do the scorers
and the report.
"""

from __future__ import annotations

TEXT_METRICS = ("rouge", "rouge_l", "bleu", "exact_match")
SQL_METRICS = ("sql_exec",)
METRICS = (*TEXT_METRICS, *SQL_METRICS)  # what `eval.metrics` and `--metrics` accept

# The scores results.json holds, in the order they are written and shown (fractions in [0, 1]).
SCORE_KEYS = (
    "exact_match",
    "rouge_1",
    "rouge_2",
    "rouge_l",
    "bleu",
    "sql_exec_accuracy",
    "sql_record_f1",
    "sql_error_rate",
)
# Splits an eval job may score: the eval data, or (opted into knowingly) the training data.
SPLITS = ("eval", "train")
