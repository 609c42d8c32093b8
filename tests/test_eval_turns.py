"""Issue 38, rule 11: multi-turn eval data. `eval.turns: last` (the default) scores a conversation's last
assistant turn; `all` scores every assistant turn, each given the conversation before it as written, and
the report says which turns were scored. Real tokenizer (the tiny Llama's, with ChatML) and real files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from core.config import DataSpec, EvalJob
from eval.report_rows import turns_marker
from slurm.planning.estimate import eval_answers, tokens_from_characters
from tests.helpers import dry_run, experiment_folder
from train import chat
from train import data as data_lib

TEMPLATE = Path(__file__).parent / "fixtures" / "chat_templates" / "qwen2.5-instruct.jinja"
TWO_EXCHANGES = [
    {"role": "system", "content": "Answer in JSON."},
    {"role": "user", "content": "first?"},
    {"role": "assistant", "content": '{"a": 1}'},
    {"role": "user", "content": "second?"},
    {"role": "assistant", "content": '{"b": 2}'},
]


@pytest.fixture
def chats(tmp_path) -> tuple[str, DataSpec]:
    path = tmp_path / "dev.jsonl"
    path.write_text("".join(json.dumps({"messages": t}) + "\n" for t in (TWO_EXCHANGES, TWO_EXCHANGES[:3])))
    return str(path), DataSpec(train=str(path), eval=str(path), format="messages")


@pytest.fixture
def tokenizer(tiny, repo_root):
    found = AutoTokenizer.from_pretrained(repo_root / "models" / "tiny-llama")
    found.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    found.chat_template = TEMPLATE.read_text()
    return found


def test_turns_all_scores_the_first_answer_of_a_two_exchange_chat_which_last_never_did(tokenizer, chats):
    """Before: only the last assistant turn was scored, so a newcomer's main answer (the first turn's JSON)
    never was."""
    source, spec = chats
    last = data_lib.prompts_and_targets(source, spec, tokenizer, "causal")
    every = data_lib.prompts_and_targets(source, spec, tokenizer, "causal", turns="all")
    assert last[1] == ['{"b": 2}', '{"a": 1}']
    assert every[1] == ['{"a": 1}', '{"b": 2}', '{"a": 1}']
    # Each prompt is the conversation before that answer as written, with the generation prompt.
    assert every[0][0] == chat.eval_prompt(tokenizer, TWO_EXCHANGES[:3])[0]
    assert every[0][1] == last[0][0] and '{"a": 1}' in every[0][1] and "second?" in every[0][1]
    assert data_lib.prompts_and_targets(source, spec, tokenizer, "causal", limit=1, turns="all")[1] == [
        '{"a": 1}',
        '{"b": 2}',
    ]


@pytest.mark.parametrize("turns", ["last", "all"])
@pytest.mark.parametrize("limit", [None, 1])
def test_the_estimate_counts_the_answers_the_eval_generates_its_limit_on_conversations(
    tokenizer, chats, turns, limit
):
    """The time estimate (torch-free, from validation's read of the file) counts what the eval job
    generates: one answer per prompt of prompts_and_targets, eval.limit applied to conversations."""
    source, spec = chats
    job = EvalJob(
        experiment="e",
        stage="s",
        model={"name_or_path": "org/m", "kind": "causal"},
        adapter={},
        data=spec,
        eval={"turns": turns, "limit": limit},
        adapter_dir="a",
        out_dir="o",
    )
    prompts, _ = data_lib.prompts_and_targets(source, spec, tokenizer, "causal", limit, turns)
    answers, _ = eval_answers(job, tokens_from_characters(source, spec))
    assert (
        answers
        == len(prompts)
        == {("last", None): 2, ("all", None): 3, ("last", 1): 1, ("all", 1): 2}[turns, limit]
    )


def test_the_report_says_which_turns_were_scored():
    assert turns_marker({"turns": "all", "answers_scored": 57}) == "all (57 answers)"
    assert turns_marker({"turns": "last"}) == "last"
    assert turns_marker({"split": "eval"}) is None  # no conversation: nothing to say


def test_turns_all_on_data_with_one_answer_per_example_is_refused_at_its_line(tmp_path, capsys):
    folder = experiment_folder(tmp_path)
    code, err = dry_run(folder, capsys, "eval.turns=all")
    assert code == 2 and "eval.turns: all scores every assistant turn of a conversation" in err
    code, err = dry_run(folder, capsys, "eval.turns=every")
    assert code == 2 and "eval.turns: Input should be 'last' or 'all'" in err
