"""The eval job scores a model as a preference model when its data are preference pairs (eval/preference.py):
the share of pairs whose chosen answer gets the higher summed log-probability, and the mean margin, for a
base row as for an adapter's. Checked against log-probabilities computed here by hand from the model's
logits, on 2 demo pairs and the tiny Llama."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.config import EvalJob
from tests.train_helpers import SQL, model_spec


def pairs_file(tmp_path: Path) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join((SQL / "pairs-dev.jsonl").read_text().splitlines(keepends=True)[:2]))
    return path


def base_eval(tiny, tmp_path: Path) -> EvalJob:
    pairs = str(pairs_file(tmp_path))
    return EvalJob(
        experiment="t",
        stage="eval",
        model=model_spec(tiny),
        adapter={"rank": 8},
        data={"train": pairs, "eval": pairs, "format": "preference"},
        eval={"metrics": ["exact_match"], "max_new_tokens": 4, "batch_size": 2},
        adapter_dir=None,
        out_dir=str(tmp_path / "eval"),
    )


def by_hand(job: EvalJob) -> list[float]:
    """Each pair's chosen minus rejected log-probability, summed over the answer's tokens only."""
    from core.examples import read_jsonl
    from train.device import current
    from train.model import load_base, load_tokenizer
    from train.pairs import encode_pair

    model = load_base(job.model, job.adapter, current("auto")).eval()
    tokenizer = load_tokenizer(job.model.name_or_path, job.model, job.data)
    margins = []
    for row in read_jsonl(Path(job.data.eval)):
        pair, summed = encode_pair(tokenizer, row, job.data), {}
        for side in ("chosen", "rejected"):
            ids = pair["prompt_ids"] + pair[f"{side}_ids"]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0].float()
            logps = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
            summed[side] = logps[len(pair["prompt_ids"]) - 1 :].sum().item()
        margins.append(summed["chosen"] - summed["rejected"])
    return margins


def test_the_base_row_on_preference_pairs_has_the_chosen_answers_share_and_margin(tiny, tmp_path):
    """Not the prompt's tokens, not chosen and rejected swapped, not a mean over tokens: the summed
    log-probability of each answer, as the DPO stage's logps are."""
    from eval.job import run_eval

    job = base_eval(tiny, tmp_path)
    results = run_eval(job)
    margins = by_hand(job)
    assert results["preference_margin"] == pytest.approx(sum(margins) / 2, abs=1e-4)
    assert results["preference_accuracy"] == sum(m > 0 for m in margins) / 2
    assert results["exact_match"] is not None  # generation is scored as for any stage


def test_the_report_has_a_column_for_each_preference_score():
    from core.names import PREFERENCE_SCORES, REPORT_COLUMNS
    from eval.report_rows import COLUMNS, SCORE_COLUMNS

    for key in PREFERENCE_SCORES:
        assert REPORT_COLUMNS[key] in COLUMNS and REPORT_COLUMNS[key] in SCORE_COLUMNS


def test_an_sft_stages_eval_scores_the_curriculums_pairs_from_the_split_it_scores(tiny, tmp_path):
    """The SFT row's eval data are its own SQL examples; the pairs come from EvalJob.preference_pairs (the
    DPO stage's data, slurm/planning/plan.py), from the file eval.split names, and an eval without them has none."""
    from eval.preference import pairs_of
    from tests.train_helpers import sql_data

    pairs = base_eval(tiny, tmp_path).data.model_copy(update={"train": str(SQL / "pairs-train.jsonl")})
    sft = EvalJob(
        experiment="t",
        stage="eval-sft",
        model=model_spec(tiny),
        adapter={"rank": 8},
        data=sql_data("easy", eval_split="dev"),
        eval={"metrics": ["exact_match"]},
        preference_pairs=pairs,
        adapter_dir=str(tmp_path / "adapter"),
        out_dir=str(tmp_path / "eval-sft"),
    )
    assert pairs_of(sft) == (pairs.eval, pairs)
    on_train = sft.model_copy(update={"eval": sft.eval.model_copy(update={"split": "train"})})
    assert pairs_of(on_train) == (str(SQL / "pairs-train.jsonl"), pairs)
    assert pairs_of(sft.model_copy(update={"preference_pairs": None})) is None
