"""train/data.py: prompts, prompt masking, lengths, truncation and the tokenization cache."""

from __future__ import annotations

import json

import pytest

from core.config import DataSpec, ModelSpec
from tests.train_helpers import PROMPT, SQL, model_spec, sql_data
from train import data as data_lib
from train.model import load_tokenizer


def tokenizer_of(tiny, kind="causal"):
    spec = ModelSpec(**model_spec(tiny, kind))
    return load_tokenizer(spec.name_or_path, spec)


def cache_entries(token_cache) -> set[str]:
    folder = token_cache / "tokenized"
    return {p.name for p in folder.iterdir() if not p.name.endswith(".tmp")} if folder.is_dir() else set()


def test_causal_labels_are_minus_100_exactly_on_the_prompt(tiny):
    tokenizer = tokenizer_of(tiny)
    spec = DataSpec(**sql_data())
    dataset = data_lib.tokenized(spec.train, spec, tokenizer, "causal")
    rows = [json.loads(line) for line in (SQL / "easy.jsonl").read_text().splitlines()]
    assert len(dataset) == len(rows)
    for row, ids, labels in zip(rows, dataset["input_ids"], dataset["labels"], strict=True):
        prompt = tokenizer(PROMPT.format(**row))["input_ids"]
        target = tokenizer(row["sql"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        assert ids == prompt + target  # input = prompt + target + eos
        assert labels == [-100] * len(prompt) + target


def test_seq2seq_keeps_prompt_and_target_apart(tiny):
    tokenizer = tokenizer_of(tiny, "seq2seq")
    encoded = data_lib.encode(tokenizer, ["list cities"], ["SELECT city FROM customers"], "seq2seq")
    assert encoded["input_ids"][0] == tokenizer("list cities")["input_ids"]
    assert encoded["labels"][0][-1] == tokenizer.eos_token_id and -100 not in encoded["labels"][0]


def test_template_fills_every_field_and_no_template_takes_the_input_as_is():
    row = {"question": "how many?", "schema": "t(a)", "sql": "SELECT 1"}
    assert data_lib.prompt_of(row, DataSpec(**sql_data())) == "t(a) | how many? | SQL: "
    assert data_lib.prompt_of(row, DataSpec(**sql_data(prompt_template=None))) == "how many?"


def test_csv_and_parquet_give_the_same_examples_as_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (SQL / "easy.jsonl").read_text().splitlines()][:5]
    columns = ["question", "schema", "sql"]
    pq.write_table(pa.Table.from_pylist([{c: r[c] for c in columns} for r in rows]), tmp_path / "x.parquet")
    import csv

    with open(tmp_path / "x.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows({c: r[c] for c in columns} for r in rows)
    expected = data_lib.prompts_and_targets(
        str(SQL / "easy.jsonl"), DataSpec(**sql_data()), None, "causal", 5
    )
    for name in ("x.parquet", "x.csv"):
        spec = DataSpec(**sql_data(train=str(tmp_path / name)))
        assert data_lib.prompts_and_targets(spec.train, spec, None, "causal") == expected, name


def test_max_length_auto_is_the_smallest_multiple_of_8_that_cuts_nothing(tiny):
    tokenizer = tokenizer_of(tiny)
    spec = DataSpec(**sql_data("train"))
    dataset = data_lib.tokenized(spec.train, spec, tokenizer, "causal")
    report = data_lib.choose_lengths(dataset, spec, "causal")
    longest = max(dataset["length"])
    assert report.longest == longest
    assert report.max_length % 8 == 0 and longest <= report.max_length < longest + 8
    assert report.truncated_at == {
        n: sum(1 for x in dataset["length"] if x > n) for n in (128, 256, 512, 1024, 2048)
    }
    assert data_lib.truncate(dataset, report, "causal") is dataset  # nothing to cut
    assert str(longest) in report.describe()


def test_explicit_max_length_truncates_and_drops_examples_left_without_target(tiny):
    tokenizer = tokenizer_of(tiny)
    spec = DataSpec(**sql_data("train"))
    dataset = data_lib.tokenized(spec.train, spec, tokenizer, "causal")
    prompt_lengths = [labels.count(-100) for labels in dataset["labels"]]
    limit = sorted(dataset["length"])[len(dataset) // 2] // 8 * 8  # cuts about half the examples
    fixed = spec.model_copy(update={"max_length": limit})
    cut = data_lib.truncate(dataset, data_lib.choose_lengths(dataset, fixed, "causal"), "causal")
    assert max(cut["length"]) <= limit and all(len(x) <= limit for x in cut["labels"])
    assert len(cut) == sum(1 for p in prompt_lengths if p < limit)
    with pytest.raises(ValueError, match="no target token"):
        tiny_limit = spec.model_copy(update={"max_length": 8})
        data_lib.truncate(dataset, data_lib.choose_lengths(dataset, tiny_limit, "causal"), "causal")


def test_examples_cut_at_the_chosen_lengths_are_counted(tiny):
    # Counted at the length actually used, not only at the fixed 128..2048 (which all cut nothing here).
    causal = DataSpec(**sql_data("train", max_length=72))
    dataset = data_lib.tokenized(causal.train, causal, tokenizer_of(tiny), "causal")
    report = data_lib.choose_lengths(dataset, causal, "causal")
    longer = sum(1 for x in dataset["length"] if x > 72)
    assert (report.inputs_truncated, report.targets_truncated) == (longer, 0) and longer > 0
    assert set(report.truncated_at.values()) == {0}
    assert f"at max_length 72: {longer} examples cut;" in report.describe()

    seq2seq = DataSpec(**sql_data("train", max_length=56, max_target_length=16))
    dataset = data_lib.tokenized(seq2seq.train, seq2seq, tokenizer_of(tiny, "seq2seq"), "seq2seq")
    report = data_lib.choose_lengths(dataset, seq2seq, "seq2seq")
    inputs = sum(1 for x in dataset["length"] if x > 56)
    targets = sum(1 for x in data_lib.target_lengths(dataset) if x > 16)
    assert (report.inputs_truncated, report.targets_truncated) == (inputs, targets) and inputs and targets
    assert f"at max_length 56: {inputs} examples cut; at max_target_length 16: {targets} targets cut;" in (
        report.describe()
    )

    auto = data_lib.choose_lengths(
        dataset, seq2seq.model_copy(update={"max_target_length": "auto"}), "seq2seq"
    )
    assert auto.targets_truncated == 0


def test_auto_length_is_capped_at_the_model_positions(tiny, caplog):
    spec = DataSpec(**sql_data("easy"))
    dataset = data_lib.tokenized(spec.train, spec, tokenizer_of(tiny), "causal")
    assert max(dataset["length"]) > 64
    with caplog.at_level("WARNING", logger="train.data"):
        report = data_lib.choose_lengths(dataset, spec, "causal", max_positions=64)
    assert report.max_length == 64
    assert report.inputs_truncated == sum(1 for x in dataset["length"] if x > 64) > 0
    assert "max_length auto: the longest example has" in caplog.text and "capped at 64" in caplog.text

    # Relative positions (T5: max_positions None) cap nothing; a seq2seq target is capped like an input.
    spec = DataSpec(**sql_data("train"))
    dataset = data_lib.tokenized(spec.train, spec, tokenizer_of(tiny, "seq2seq"), "seq2seq")
    longest_target = max(data_lib.target_lengths(dataset))
    uncapped = data_lib.choose_lengths(dataset, spec, "seq2seq", max_positions=None)
    assert uncapped.max_target_length == data_lib.round_up(longest_target) > 32
    capped = data_lib.choose_lengths(dataset, spec, "seq2seq", max_positions=32)
    assert capped.max_target_length == 32
    assert capped.targets_truncated == sum(1 for x in data_lib.target_lengths(dataset) if x > 32) > 0


def test_seq2seq_truncation_keeps_the_final_eos(tiny):
    tokenizer = tokenizer_of(tiny, "seq2seq")
    spec = DataSpec(**sql_data("train", max_length=16, max_target_length=8))
    dataset = data_lib.tokenized(spec.train, spec, tokenizer, "seq2seq")
    cut = data_lib.truncate(dataset, data_lib.choose_lengths(dataset, spec, "seq2seq"), "seq2seq")
    assert all(len(x) <= 16 and x[-1] == tokenizer.eos_token_id for x in cut["input_ids"])
    assert all(len(x) <= 8 and x[-1] == tokenizer.eos_token_id for x in cut["labels"])


def test_cache_is_reused_until_the_tokenizer_or_the_data_changes(tiny, tmp_path, token_cache):
    tokenizer = tokenizer_of(tiny)
    lines = (SQL / "easy.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "easy.jsonl").write_text("".join(lines[:20]))  # content no other test has cached
    spec = DataSpec(**sql_data(train=str(tmp_path / "easy.jsonl")))
    before = cache_entries(token_cache)
    first = data_lib.tokenized(spec.train, spec, tokenizer, "causal")
    after_first = cache_entries(token_cache) - before
    assert len(after_first) == 1
    again = data_lib.tokenized(spec.train, spec.model_copy(update={"max_length": 64}), tokenizer, "causal")
    assert cache_entries(token_cache) - before == after_first and again["input_ids"] == first["input_ids"]

    tokenizer.add_special_tokens({"additional_special_tokens": ["<sql>"]})
    changed = data_lib.tokenized(spec.train, spec, tokenizer, "causal")
    assert len(cache_entries(token_cache) - before) == 2
    # The same data through a changed tokenizer: the added token now appears as one id.
    edited = tmp_path / "easy.jsonl"
    edited.write_text(edited.read_text().replace('"question": "', '"question": "<sql> ', 1))
    reread = data_lib.tokenized(spec.train, spec, tokenizer, "causal")
    assert len(cache_entries(token_cache) - before) == 3
    sql_id = tokenizer.convert_tokens_to_ids("<sql>")
    assert sql_id in reread["input_ids"][0] and sql_id not in changed["input_ids"][0]


def test_padding_fraction_of_the_batches_actually_formed():
    lengths = [2, 8, 2, 8]
    assert data_lib.padding_fraction(lengths, [0, 2, 1, 3], batch_size=2) == 0.0
    assert data_lib.padding_fraction(lengths, [0, 1, 2, 3], batch_size=2) == pytest.approx(1 - 20 / 32)
    assert data_lib.padding_fraction(lengths, [1, 3, 0, 2], batch_size=2, multiple=8) == pytest.approx(
        1 - 20 / 32
    )


def test_the_job_logs_length_line_does_not_read_as_a_contradiction():
    """Before: "truncated: 0 inputs; examples truncated at fixed lengths: 2 at 128" (auto chose 152)."""
    report = data_lib.LengthReport(152, None, 150, 30, 0, 0, {128: 2, 256: 0})
    said = report.describe()
    assert (
        "at max_length 152: 0 examples cut; a fixed max_length instead would cut: 2 at 128, 0 at 256" in said
    )
    assert "truncated: 0 inputs" not in said
