"""Every metric name, in one place: what a config may ask for and what results.json holds.

Standard library only: core/config.py (the torch-free login-node schema) imports it, as do the scorers
and the report.
"""

from __future__ import annotations

TEXT_METRICS = ("rouge", "rouge_l", "bleu", "exact_match")
SQL_METRICS = ("sql_exec",)
MODEL_METRICS = ("bertscore",)  # scored by a model of their own (eval.bertscore_model)
METRICS = (*TEXT_METRICS, *SQL_METRICS, *MODEL_METRICS)  # what `eval.metrics` and `--metrics` accept
DEFAULT_METRICS = ("rouge", "bleu", "exact_match")  # `eval.metrics` and `--metrics` left out
# What a metric needs besides predictions and references: the input's name (eval.NAME in a config,
# --NAME on `python -m eval score`) and what it is.
METRIC_INPUTS = {
    "sql_exec": ("db", "the SQLite file the queries run against"),
    "bertscore": (
        "bertscore_model",
        "a local model folder, or a hub id such as roberta-large, the model bert-score uses for English",
    ),
}


def missing_inputs(metrics, given: dict) -> list[tuple[str, str, str]]:
    """(metric, input, what that input is) for each metric in `metrics` whose input `given` lacks."""
    wanted = [(metric, *METRIC_INPUTS[metric]) for metric in metrics if metric in METRIC_INPUTS]
    return [(metric, name, what) for metric, name, what in wanted if not given.get(name)]


# How long one SQL query may run (fetching its rows included) before it counts as wrong: the eval job's
# default (`eval.sql_timeout_s`) and `python -m eval score`'s (`--sql-timeout-s`), so both score the same
# predictions alike.
SQL_TIMEOUT_S = 5.0

# The scores results.json holds, in the order they are written and shown: fractions in [0, 1] (a rescaled
# bertscore_f1 can fall below 0: eval/bertscore.py).
SCORE_KEYS = (
    "exact_match",
    "rouge_1",
    "rouge_2",
    "rouge_l",
    "bleu",
    "bertscore_f1",
    "sql_exec_accuracy",
    "sql_record_f1",
    "sql_error_rate",
    # On preference pairs (eval/preference.py): the share of pairs whose chosen answer the model gives the
    # higher summed log-probability, and the mean chosen-minus-rejected margin (nats, not a fraction).
    "preference_accuracy",
    "preference_margin",
)
PREFERENCE_SCORES = ("preference_accuracy", "preference_margin")  # written when the eval data are pairs
# The scores each metric of `eval.metrics` writes into results.json (eval/metrics.py, eval/sql.py).
SCORES_OF = {
    "rouge": ("rouge_1", "rouge_2", "rouge_l"),
    "rouge_l": ("rouge_l",),
    "bleu": ("bleu",),
    "exact_match": ("exact_match",),
    "sql_exec": ("sql_exec_accuracy", "sql_record_f1", "sql_error_rate"),
    "bertscore": ("bertscore_f1",),
}
# The report's column for each score: published tables call BERTScore F1 just "bertscore"
# (configs/baselines.yaml), and our rows must land in the same column as theirs.
REPORT_COLUMNS = {key: {"bertscore_f1": "bertscore"}.get(key, key) for key in SCORE_KEYS}
# Splits an eval job may score: the eval data, or (opted into knowingly) the training data.
SPLITS = ("eval", "train")
# How examples are written (data.format, core/conversations.py): fields, or one of the conversations.
CONVERSATIONS = ("messages", "sharegpt", "alpaca")
# `preference`: {prompt, chosen, rejected} pairs for a train.method: dpo stage (core/preferences.py).
PREFERENCE = "preference"
DATA_FORMATS = ("fields", *CONVERSATIONS, PREFERENCE)
# TRL's DPOTrainer loss variants (train.dpo.loss_type), as trl 1.16's DPOTrainer names them.
DPO_LOSSES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sigmoid_norm",
)

# A GRPO stage's rewards (the `score` of a reward in train.grpo): per-example scores the eval writes, computed by the
# eval's own per-example code (eval/rewards.py), so that a reward of 1 means what the report's 1 means.
# sql_executes is 1 for a completion that runs (the eval's sql_error_rate is 1 minus its mean).
SQL_REWARD_SCORES = ("sql_exec_accuracy", "sql_record_f1", "sql_executes")
REWARD_SCORES = ("exact_match", "rouge_1", "rouge_2", "rouge_l", *SQL_REWARD_SCORES)
# Scores of results.json that are no reward, and why (refused at the key's line).
NOT_A_REWARD = {
    "bleu": "corpus BLEU has no per-completion value equal to the report's (a mean of sentence BLEU is "
    "another metric); use rouge_l or exact_match",
    "bertscore_f1": "it would load a second model into the training job; use rouge_l, or a function",
    "sql_error_rate": "a reward rises with quality: use sql_executes (1 - error)",
}
# TRL's GRPO losses whose step does not depend on the split of the step into micro-batches and ranks (each
# micro-batch holds as many completions: grpo and dr_grpo are means over completions of a per-completion
# or constant-normalised sum; dapo divides by the step's global token count). The others, and why not.
GRPO_LOSSES = ("dapo", "grpo", "dr_grpo")
NOT_A_GRPO_LOSS = {
    "bnpo": "it normalises by each micro-batch's own tokens, so the step changes with micro_batch and the "
    "world size (TRL documents it as local-batch dependent); use dapo, its global-batch form",
}

# A model folder has a tokenizer when it has one of these (the hub cache check, the speed book's stamp).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "spiece.model", "tokenizer.model", "vocab.json")
