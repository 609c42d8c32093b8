"""A model scored as a preference model, on preference pairs (data.format: preference).

For every eval row alike (the base model, an SFT adapter, a DPO adapter): each pair's chosen and rejected
answer tokens are tokenized as the DPO stage tokenizes them (train/pairs.py encode_pair: the prompt shared,
each answer as its SFT labels) and scored by the model's summed log-probability of the answer given the
prompt (TRL's `logps`, no reference subtracted: a figure the base row has too). Written into results.json:

- preference_accuracy: the share of pairs whose chosen answer has the higher summed log-probability;
- preference_margin: the mean of chosen minus rejected summed log-probability (nats).

An SFT stage's eval in a curriculum with a preference stage scores that stage's pairs too
(EvalJob.preference_pairs, slurm/planning/plan.py), so base, SFT and DPO rows hold the same figure. No truncation: a
pair is scored whole (the eval loads no max_length).
"""

from __future__ import annotations

import torch


def answer_logp(model, prompt_ids: list[int], answer_ids: list[int]) -> float:
    """The summed log-probability of `answer_ids` after `prompt_ids`."""
    ids = torch.tensor([prompt_ids + answer_ids], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    answer = ids[0, len(prompt_ids) :, None]
    return torch.log_softmax(logits, -1).gather(1, answer).sum().item()


def pair_scores(model, pairs) -> dict[str, float]:
    """{preference_accuracy, preference_margin} over `pairs` ({prompt_ids, chosen_ids, rejected_ids})."""
    margins = [
        answer_logp(model, pair["prompt_ids"], pair["chosen_ids"])
        - answer_logp(model, pair["prompt_ids"], pair["rejected_ids"])
        for pair in pairs
    ]
    return {
        "preference_accuracy": sum(m > 0 for m in margins) / len(margins),
        "preference_margin": sum(margins) / len(margins),
    }


def pairs_of(job):
    """(file, DataSpec) of the pairs the eval job scores: its own data when they are pairs, else a later
    preference stage's (EvalJob.preference_pairs), from the split eval.split names; None: no pairs."""
    from core.names import PREFERENCE

    spec = job.data if job.data.format == PREFERENCE else job.preference_pairs
    if spec is None:
        return None
    source = spec.eval if job.eval.split == "eval" else spec.train
    return (source, spec) if source else None


def preference_scores(model, tokenizer, job) -> dict[str, float]:
    """The eval job's pairs (pairs_of; the first eval.limit of them) scored by `model`; {}: none."""
    from train.pairs import encoded_pairs

    found = pairs_of(job)
    if found is None:
        return {}
    pairs = encoded_pairs(*found, tokenizer)
    if job.eval.limit is not None:
        pairs = pairs.select(range(min(job.eval.limit, len(pairs))))
    return pair_scores(model, pairs)
