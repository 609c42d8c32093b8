"""Preference pairs → token ids, by the trainer's rule (train/preference.py says it) and for preflight's lengths:
the prompt shared, each answer as the SFT stage labels it, fitted to max_length by keeping each answer whole
and cutting the prompt's start, or dropping a pair whose answer alone does not fit. No torch here."""

from __future__ import annotations

import logging

import datasets

from core import preferences
from train import chat
from train import data as data_lib

log = logging.getLogger("train.pairs")


def encode_pair(tokenizer, row: dict, spec) -> dict[str, list[int]]:
    """{prompt_ids, chosen_ids, rejected_ids}: the prompt shared, each answer as SFT labels it."""
    turns, chosen, rejected = preferences.pair(row)
    if data_lib.plain_prompt(row, spec):  # as `fields` are rendered
        encoded = data_lib.encode(tokenizer, [turns[0]["content"]] * 2, [chosen, rejected], "causal")
        sides = list(zip(encoded["input_ids"], encoded["labels"], strict=True))
    else:
        sides = [
            (e.input_ids, e.labels)
            for e in (
                chat.encode(tokenizer, [*turns, {"role": "assistant", "content": answer}])
                for answer in (chosen, rejected)
            )
        ]
    (chosen_prompt, chosen_ids), (rejected_prompt, rejected_ids) = (last_answer(*side) for side in sides)
    shared = common_prefix(chosen_prompt, rejected_prompt)
    return {
        "prompt_ids": chosen_prompt[:shared],
        "chosen_ids": chosen_prompt[shared:] + chosen_ids,
        "rejected_ids": rejected_prompt[shared:] + rejected_ids,
    }


def last_answer(ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
    """(the ids before the last labelled span, that span): the prompt and the answer, as SFT labels them."""
    stop = max(i for i, label in enumerate(labels) if label != -100) + 1
    start = stop
    while start > 0 and labels[start - 1] != -100:
        start -= 1
    return ids[:start], ids[start:stop]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def pair_length(example: dict) -> int:
    """What one side of the pair costs at most: the prompt and the longer answer (the batch pads to it)."""
    return len(example["prompt_ids"]) + max(len(example["chosen_ids"]), len(example["rejected_ids"]))


def encoded_pairs(source: str, spec, tokenizer) -> datasets.Dataset:
    rows = data_lib.read_rows(source, spec)
    chat.within_bounds(  # each pair's conversations, as encode_pair renders them
        tokenizer,
        [
            [*preferences.pair(row)[0], {"role": "assistant", "content": answer}]
            for row in rows
            if not data_lib.plain_prompt(row, spec)
            for answer in preferences.pair(row)[1:]
        ],
    )
    encoded = [encode_pair(tokenizer, row, spec) for row in rows]
    columns = {key: [e[key] for e in encoded] for key in ("prompt_ids", "chosen_ids", "rejected_ids")}
    return datasets.Dataset.from_dict({**columns, "length": [pair_length(e) for e in encoded]})


def fitted(dataset: datasets.Dataset, limit: int, source: str = "") -> tuple[datasets.Dataset, int, int]:
    """Pairs within `limit` tokens by our rule (module docstring): (the pairs, prompts cut, pairs dropped).
    `source`: the file, named when none fits (the eval pairs' refusal read as the training pairs', L12)."""
    answers = [
        max(len(c), len(r)) for c, r in zip(dataset["chosen_ids"], dataset["rejected_ids"], strict=True)
    ]
    too_long = [n > limit for n in dataset["length"]]
    dropped = sum(1 for long, answer in zip(too_long, answers, strict=True) if long and answer >= limit)
    if not any(too_long):
        return dataset, 0, 0

    def cut(example):
        if example["length"] > limit:
            room = limit - max(len(example["chosen_ids"]), len(example["rejected_ids"]))
            example["prompt_ids"] = example["prompt_ids"][-room:] if room > 0 else []
            example["length"] = pair_length(example)
        return example

    kept = dataset.map(cut, keep_in_memory=True).filter(lambda ids: len(ids) > 0, input_columns="prompt_ids")
    if len(kept) == 0:
        raise ValueError(
            f"{source + ': ' if source else ''}max_length {limit} holds not even the answers of any pair: "
            "raise data.max_length or use 'auto'"
        )
    cut_prompts = sum(too_long) - dropped
    log.warning(
        "%d of %d pairs are longer than max_length %d: %d kept with the prompt's start cut, %d dropped "
        "(an answer alone does not fit)",
        sum(too_long),
        len(dataset),
        limit,
        cut_prompts,
        dropped,
    )
    return kept, cut_prompts, dropped


def lengths_of(dataset: datasets.Dataset, spec, positions: int | None) -> data_lib.LengthReport:
    lengths = dataset["length"]
    answers = [
        max(len(c), len(r)) for c, r in zip(dataset["chosen_ids"], dataset["rejected_ids"], strict=True)
    ]
    max_length = data_lib.pick_length(spec.max_length, max(lengths), positions, "max_length")
    truncated = {n: sum(1 for x in lengths if x > n) for n in data_lib.FIXED_LENGTHS}
    cut = sum(1 for x in lengths if x > max_length)
    return data_lib.LengthReport(max_length, None, max(lengths), max(answers), cut, 0, truncated)
