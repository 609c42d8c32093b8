"""Conversations as users have them: each format reads to the same turns, malformed examples are refused at
their line, and the chat template's rendering is labelled on the assistant's answers only, exactly.

The templates are the verbatim ones of Qwen2.5-Instruct (ChatML) and Llama-3.1-Instruct
(tests/fixtures/chat_templates, copied from their tokenizer_config.json), set on the tiny demo tokenizer with
their markers added as special tokens. The token positions below were checked by hand on the printed
tokens of the rendering (`" ".join(f"{i}:{tok.decode([t])!r}" ...)`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer

import launch
from core import chat_templates, template_sandbox
from core.config import DataSpec, Experiment
from core.conversations import conversation, problems
from core.examples import ExampleError, check_file
from tests.helpers import configs
from train import chat
from train import data as data_lib

REPO = Path(__file__).resolve().parent.parent
TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
CHATML_TOKENS = ["<|im_start|>", "<|im_end|>"]
LLAMA3_TOKENS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
THREE_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "how many?"},
    {"role": "assistant", "content": "SELECT 1"},
    {"role": "user", "content": "and two?"},
    {"role": "assistant", "content": "SELECT 2"},
]


def tokenizer_with(template: str, tokens: list[str], repo_root: Path):
    tokenizer = AutoTokenizer.from_pretrained(repo_root / "models" / "tiny-llama")
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture
def qwen(tiny, repo_root):
    return tokenizer_with((TEMPLATES / "qwen2.5-instruct.jinja").read_text(), CHATML_TOKENS, repo_root)


@pytest.fixture
def llama(tiny, repo_root):
    return tokenizer_with((TEMPLATES / "llama-3.1-instruct.jinja").read_text(), LLAMA3_TOKENS, repo_root)


def labelled(encoded: chat.Encoded) -> list[int]:
    return [i for i, label in enumerate(encoded.labels) if label != -100]


# ---- the label mask, by hand ----------------------------------------------------------------------------
def test_chatml_labels_each_answer_and_its_im_end_but_never_the_newline_after_or_the_header(qwen):
    encoded = chat.encode(qwen, THREE_TURNS)
    # 26-33: <|im_start|> a s s i st an t \n (the header, given by the generation prompt); 34 SELECT, 35 ' 1',
    # 36 <|im_end|>; 37 the newline between turns. The second answer: 58 SELECT, 59 ' 2', 60 <|im_end|>, 61 \n.
    assert labelled(encoded) == [34, 35, 36, 58, 59, 60]
    assert len(encoded.input_ids) == 62 and qwen.decode(encoded.input_ids[61:]) == "\n"
    assert [qwen.decode(encoded.input_ids[a : b + 1]) for a, b in ((34, 36), (58, 60))] == [
        "SELECT 1<|im_end|>",
        "SELECT 2<|im_end|>",
    ]
    assert encoded.labels[34:37] == encoded.input_ids[34:37]  # labels are the ids themselves (shifted by HF)
    assert encoded.turn_ends == [38, 62]  # through each assistant turn's separator


def test_llama31_labels_each_answer_and_its_eot_id_and_not_its_dated_system_header(llama):
    encoded = chat.encode(llama, THREE_TURNS)
    # 0 <s> (the template's own bos_token, once), 1-58 the system turn with its dates; 69-78 the assistant
    # header <|start_header_id|> assistant <|end_header_id|> \n \n; 79 SELECT, 80 ' 1', 81 <|eot_id|>.
    assert labelled(encoded) == [79, 80, 81, 105, 106, 107]
    assert encoded.input_ids.count(llama.bos_token_id) == 1
    assert llama.decode(encoded.input_ids[105:108]) == "SELECT 2<|eot_id|>"
    assert encoded.turn_ends == [82, 108]


def test_train_on_all_learns_every_token(qwen):
    encoded = chat.encode(qwen, THREE_TURNS, train_on="all")
    assert encoded.labels == encoded.input_ids


@pytest.mark.parametrize("which", ["qwen", "llama"])
def test_the_eval_prompt_is_the_training_rendering_up_to_the_last_answer(which, request):
    tokenizer = request.getfixturevalue(which)
    prompt, reference = chat.eval_prompt(tokenizer, THREE_TURNS)
    full = chat.rendered(tokenizer, THREE_TURNS)
    assert reference == "SELECT 2"
    assert full.startswith(prompt) and full[len(prompt) :].startswith("SELECT 2")
    # ... and in tokens: the answer's labelled tokens start right where the prompt's tokens end.
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    encoded = chat.encode(tokenizer, THREE_TURNS)
    assert encoded.input_ids[: len(prompt_ids)] == prompt_ids
    assert labelled(encoded)[-3] == len(prompt_ids)


def test_qwen3s_template_drops_earlier_think_blocks_so_it_is_refused_naming_train_on(tiny, repo_root):
    tokenizer = tokenizer_with((TEMPLATES / "qwen3.jinja").read_text(), CHATML_TOKENS, repo_root)
    with pytest.raises(chat.ChatTemplateError, match="train_on: all") as refused:
        chat.encode(tokenizer, THREE_TURNS)
    # The reason is the one this template has: the first answer alone renders with an empty think block.
    assert "<think>" in str(refused.value).split("where the whole")[0]
    assert chat.encode(tokenizer, THREE_TURNS, train_on="all").labels  # learnt whole, as asked


MARKED_CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_generation_markers_give_the_same_labels_as_prefix_rendering_less_the_newline(tiny, repo_root):
    marked = tokenizer_with(MARKED_CHATML, CHATML_TOKENS, repo_root)
    plain = tokenizer_with(
        MARKED_CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", ""),
        CHATML_TOKENS,
        repo_root,
    )
    # The markers hold the newline after <|im_end|>; it is whitespace between turns and is not learnt.
    assert chat.encode(marked, THREE_TURNS) == chat.encode(plain, THREE_TURNS)


UNSTABLE_MARKED = MARKED_CHATML.replace(
    "{% generation %}", "{% if loop.last %}(final) {% endif %}{% generation %}"
)


def test_a_template_that_is_not_prefix_stable_is_labelled_by_its_markers(tiny, repo_root):
    tokenizer = tokenizer_with(UNSTABLE_MARKED, CHATML_TOKENS, repo_root)
    encoded = chat.encode(tokenizer, THREE_TURNS)
    answers = [tokenizer.decode([encoded.input_ids[i]]) for i in labelled(encoded)]
    assert "".join(answers) == "SELECT 1<|im_end|>SELECT 2<|im_end|>"


PHI3_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
GEMMA_TOKENS = ["<start_of_turn>", "<end_of_turn>"]


def test_phi3_multi_turn_is_labelled_not_refused_for_its_eos_at_the_conversations_end(tiny, repo_root):
    """Phi-3 writes eos once, after the last turn: a prefix ending on an answer ends in eos, the whole
    conversation has the next user turn there. That is not a template that renders turns differently."""
    phi3 = tokenizer_with((TEMPLATES / "phi-3.5-mini-instruct.jinja").read_text(), PHI3_TOKENS, repo_root)
    encoded = chat.encode(phi3, THREE_TURNS)
    answers = [phi3.decode([encoded.input_ids[i]]) for i in labelled(encoded)]
    assert "".join(answers) == "SELECT 1<|end|>SELECT 2<|end|>"  # the closing eos is no answer's
    assert phi3.decode(encoded.input_ids[-1:]) == phi3.eos_token
    assert encoded.turn_ends[-1] == len(encoded.input_ids)  # a whole conversation keeps its eos


def test_phi3_generation_stops_at_its_end_token_not_at_eos(tiny, repo_root):
    phi3 = tokenizer_with((TEMPLATES / "phi-3.5-mini-instruct.jinja").read_text(), PHI3_TOKENS, repo_root)
    assert chat.end_of_turn_ids(phi3) == [phi3.convert_tokens_to_ids("<|end|>")]


def test_gemma2_labels_its_model_turns_and_refuses_a_system_turn_with_its_own_words(tiny, repo_root):
    gemma = tokenizer_with((TEMPLATES / "gemma-2-2b-it.jinja").read_text(), GEMMA_TOKENS, repo_root)
    encoded = chat.encode(gemma, THREE_TURNS[1:])
    answers = [gemma.decode([encoded.input_ids[i]]) for i in labelled(encoded)]
    assert "".join(answers) == "SELECT 1<end_of_turn>SELECT 2<end_of_turn>"
    assert chat.end_of_turn_ids(gemma) == [gemma.convert_tokens_to_ids("<end_of_turn>")]
    with pytest.raises(chat.ChatTemplateError, match="System role not supported"):
        chat.encode(gemma, THREE_TURNS)


def smollm_like(tmp_path: Path, repo_root: Path, template: str, tokens: list[str]):
    """The tiny tokenizer with SmolLM2's merges of a double newline and of a newline and a space: at the
    end of a text `\\n\\n` is one token, before a word two (GPT-2's pre-tokenizer splits it there)."""
    folder = tmp_path / "models" / "tiny-llama"  # tokenizer_with's layout, under tmp_path
    shutil.copytree(
        repo_root / "models" / "tiny-llama", folder, ignore=shutil.ignore_patterns("*.safetensors")
    )
    spec = json.loads((folder / "tokenizer.json").read_text())
    for pair in (["Ċ", "Ċ"], ["Ċ", "Ġ"]):
        spec["model"]["vocab"]["".join(pair)] = len(spec["model"]["vocab"])
        spec["model"]["merges"].append(pair)
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return tokenizer_with(template, tokens, tmp_path)


def test_the_eval_prompt_is_a_token_prefix_of_training_where_retokenizing_merges_the_headers_newlines(
    tiny, repo_root, tmp_path
):
    tokenizer = smollm_like(
        tmp_path, repo_root, (TEMPLATES / "llama-3.1-instruct.jinja").read_text(), LLAMA3_TOKENS
    )
    prompt, _ = chat.eval_prompt(tokenizer, THREE_TURNS)
    encoded = chat.encode(tokenizer, THREE_TURNS)
    assert encoded.input_ids[: len(prompt.ids)] == prompt.ids and labelled(encoded)[-3] == len(prompt.ids)
    assert tokenizer.decode(prompt.ids[-2:]) == "\n\n"  # two tokens, as trained ...
    retokenized = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert retokenized[-1] not in prompt.ids[-2:]  # ... where the text alone gives one '\n\n' token


def test_the_end_of_turn_token_is_where_generation_stops(qwen, llama):
    assert chat.end_of_turn_ids(qwen) == [qwen.convert_tokens_to_ids("<|im_end|>")]
    assert chat.end_of_turn_ids(llama) == [llama.convert_tokens_to_ids("<|eot_id|>")]


def test_a_model_without_a_template_is_refused_with_the_fix(tiny, repo_root):
    tokenizer = AutoTokenizer.from_pretrained(repo_root / "models" / "tiny-llama")
    with pytest.raises(chat.ChatTemplateError, match="data.chat_template"):
        chat.use_template(tokenizer, DataSpec(train="x.jsonl", format="messages"), "tiny-llama")
    chatml = DataSpec(train="x.jsonl", format="messages", chat_template="chatml")
    chat.use_template(tokenizer, chatml, "x", added_tokens=CHATML_TOKENS)
    assert "<|im_start|>" in tokenizer.chat_template


def test_chatml_on_a_vocabulary_without_its_markers_is_refused_naming_model_added_tokens(tiny, repo_root):
    """Before: `<|im_end|>` was learnt as 8 pieces and generation had no end-of-turn to stop at."""
    tokenizer = AutoTokenizer.from_pretrained(repo_root / "models" / "tiny-llama")
    chatml = DataSpec(train="x.jsonl", format="messages", chat_template="chatml")
    with pytest.raises(
        chat.ChatTemplateError, match=r"model.added_tokens: \['<\|im_start\|>', '<\|im_end\|>'\]"
    ):
        chat.use_template(tokenizer, chatml, "tiny-llama", added_tokens=[])


# ---- formats --------------------------------------------------------------------------------------------
ONE_EXCHANGE = [{"role": "user", "content": "Do\n\nthis"}, {"role": "assistant", "content": "done"}]


@pytest.mark.parametrize(
    ("spec", "row"),
    [
        (
            {"format": "fields", "prompt_template": "{a}\n\n{b}", "target_field": "c"},
            {"a": "Do", "b": "this", "c": "done"},
        ),
        ({"format": "messages"}, {"messages": ONE_EXCHANGE}),
        ({"format": "messages", "messages_field": "chat"}, {"chat": ONE_EXCHANGE}),
        (
            {"format": "sharegpt"},
            {"conversations": [{"from": "human", "value": "Do\n\nthis"}, {"from": "gpt", "value": "done"}]},
        ),
        ({"format": "alpaca"}, {"instruction": "Do", "input": "this", "output": "done"}),
    ],
    ids=["fields", "messages", "messages-field", "sharegpt", "alpaca"],
)
def test_each_format_reads_to_the_same_conversation(spec, row):
    data = DataSpec(train="x.jsonl", **spec)
    if data.format != "fields":  # fields are checked by their presence (core/examples.py)
        assert problems(row, data) == []
    assert conversation(row, data) == ONE_EXCHANGE


def test_alpaca_without_input_is_the_instruction_alone():
    data = DataSpec(train="x.jsonl", format="alpaca")
    row = {"instruction": "List cities", "input": "", "output": "SELECT city FROM customers"}
    assert conversation(row, data)[0] == {"role": "user", "content": "List cities"}


def test_every_malformed_conversation_is_refused_at_its_line_at_once(tmp_path):
    rows = [
        {"messages": ONE_EXCHANGE},
        {"messages": [{"role": "usr", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"messages": []},
        {"messages": [{"role": "user", "content": "q"}]},
        {"messages": [{"role": "user", "content": ["an", "image"]}, {"role": "assistant", "content": "a"}]},
        {"messages": "hello"},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ExampleError) as caught:
        check_file(path, DataSpec(train=str(path), format="messages"))
    found = [(error.line, error.message) for error in caught.value.errors]
    assert [line for line, _ in found] == [2, 3, 4, 5, 6]
    assert "unknown role 'usr' (did you mean 'user'?)" in found[0][1]
    assert "is empty" in found[1][1]
    assert "no assistant turn" in found[2][1]
    assert "messages[0].content is a list whose part 'str' is not a text part" in found[3][1]
    assert "must be a list of turns" in found[4][1]


def test_seq2seq_refuses_messages_but_reads_alpaca_as_input_and_target():
    model = {"name_or_path": "t5", "kind": "seq2seq"}
    with pytest.raises(ValueError, match="format: alpaca"):
        Experiment(name="x", model=model, data={"train": "x.jsonl", "format": "messages"})
    experiment = Experiment(name="x", model=model, data={"train": "x.jsonl", "format": "alpaca"})
    assert not chat_rendered(experiment)


def chat_rendered(experiment: Experiment) -> bool:
    from core.conversations import templated

    return templated(experiment.data, experiment.model.kind)


def test_a_prompt_template_with_a_conversation_format_is_a_clear_error():
    with pytest.raises(ValueError, match="prompt_template is for format: fields"):
        DataSpec(train="x.jsonl", format="messages", prompt_template="{q}")


# ---- downstream: cache, lengths, truncation ------------------------------------------------------------
def write_chats(path: Path, chats: list[list[dict]]) -> str:
    path.write_text("".join(json.dumps({"messages": turns}) + "\n" for turns in chats))
    return str(path)


def test_tokenized_conversations_carry_answer_only_labels_and_the_cache_knows_the_template(
    qwen, tmp_path, monkeypatch
):
    monkeypatch.setenv("LORA_CACHE_DIR", str(tmp_path / "cache"))
    source = write_chats(tmp_path / "c.jsonl", [THREE_TURNS, THREE_TURNS[1:3]])
    spec = DataSpec(train=source, format="messages")
    dataset = data_lib.tokenized(source, spec, qwen, "causal")
    assert dataset[0]["labels"] == chat.encode(qwen, THREE_TURNS).labels
    key = data_lib.cache_key(source, spec, qwen, "causal")
    qwen.chat_template = qwen.chat_template.replace("You are Qwen", "You are Q")
    assert data_lib.cache_key(source, spec, qwen, "causal") != key  # another template: tokenized again
    all_tokens = spec.model_copy(update={"train_on": "all"})
    assert data_lib.cache_key(source, all_tokens, qwen, "causal") != data_lib.cache_key(
        source, spec, qwen, "causal"
    )


def test_a_too_long_conversation_keeps_its_whole_turns_from_the_start_or_is_dropped(
    qwen, tmp_path, monkeypatch
):
    monkeypatch.setenv("LORA_CACHE_DIR", str(tmp_path / "cache"))
    long_first = [{"role": "user", "content": "x" * 200}, {"role": "assistant", "content": "a"}]
    source = write_chats(tmp_path / "c.jsonl", [THREE_TURNS, long_first, THREE_TURNS[:3]])
    spec = DataSpec(train=source, format="messages", max_length=40)
    dataset = data_lib.tokenized(source, spec, qwen, "causal")
    lengths = data_lib.choose_lengths(dataset, spec, "causal")
    cut = data_lib.truncate(dataset, lengths, "causal")
    # THREE_TURNS (62 tokens) is cut after its first exchange (38: through its separator); the 200-x
    # question cannot hold even its first answer and is dropped; the one-exchange chat (38) is kept whole.
    assert cut["length"] == [38, 38]
    assert cut[0]["input_ids"] == chat.encode(qwen, THREE_TURNS).input_ids[:38]
    assert "turn_ends" not in cut.column_names  # the collator takes ids and labels only
    assert isinstance(cut, datasets.Dataset)


# ---- refused before anything is queued -------------------------------------------------------------------
CHAT_EXPERIMENT = """\
name: chat
inherits: _tiny-sql.yaml
model: {{name_or_path: {model}}}
data: {{train: {train}, format: messages, input_field: input, target_field: target, prompt_template: null}}
"""


def chat_configs(tmp_path: Path, model: str) -> Path:
    folder = configs(tmp_path, REPO)
    train = write_chats(tmp_path / "chat.jsonl", [THREE_TURNS])
    (folder / "chat.yaml").write_text(CHAT_EXPERIMENT.format(model=model, train=train))
    return folder


def test_a_local_model_folder_without_a_template_is_refused_at_data_format(tiny, tmp_path, capsys):
    folder = chat_configs(tmp_path, str(REPO / "models" / "tiny-llama"))
    assert launch.main(["--all", "--config-dir", str(folder), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "chat.yaml:4: data.format:" in err and "has none (a base model)" in err and "chat_template" in err


def test_chatml_on_a_local_folder_without_its_markers_is_refused_by_the_dry_run(tiny, tmp_path, capsys):
    folder = chat_configs(tmp_path, str(REPO / "models" / "tiny-llama"))
    experiment = folder / "chat.yaml"
    experiment.write_text(
        experiment.read_text().replace("format: messages,", "format: messages, chat_template: chatml,")
    )
    assert launch.main(["--all", "--config-dir", str(folder), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert (
        "chat.yaml:4: data.chat_template:" in err
        and "model.added_tokens: ['<|im_start|>', '<|im_end|>']" in err
    )


@pytest.mark.slow
def test_a_hub_model_without_a_template_is_refused_by_the_dry_run_once_it_is_in_the_cache(tiny, tmp_path):
    """The login node knows a hub model's tokenizer once preflight fetched it: it is refused then, before
    anything is queued, not on the node after hours in the queue; by the dry run too, which reads the cached
    snapshot (before: preflight only, what issue 41 left)."""
    snapshot = tmp_path / "hub" / "models--org--base-llama" / "snapshots" / ("0" * 40)
    shutil.copytree(REPO / "models" / "tiny-llama", snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    folder = chat_configs(tmp_path, "org/base-llama")
    # huggingface_hub reads HF_HUB_CACHE once, at import: the launch runs in a process of its own.
    env = os.environ | {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    env["LORA_CACHE_DIR"] = str(tmp_path / "cache")
    argv = [sys.executable, "launch.py", "--all", "--config-dir", str(folder), "--dry-run"]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "chat.yaml:4: data.format:" in done.stderr and "org/base-llama" in done.stderr
    assert "data.chat_template" in done.stderr and "Traceback" not in done.stderr


def test_a_seq2seq_model_reads_alpaca_as_its_prompt_and_target(tmp_path):
    path = tmp_path / "alpaca.jsonl"
    rows = [{"instruction": "Do", "input": "this", "output": "done"}, {"instruction": "Go", "output": "gone"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    spec = DataSpec(train=str(path), format="alpaca")
    prompts, targets = data_lib.prompts_and_targets(str(path), spec, None, "seq2seq")
    assert (prompts, targets) == (["Do\n\nthis", "Go"], ["done", "gone"])  # no template: T5 has none


def test_the_eval_generates_from_the_prompts_training_ids_not_from_its_text_tokenized_again(
    tiny, repo_root, tmp_path
):
    from transformers import AutoModelForCausalLM

    from eval.generate import generated_batches

    tokenizer = smollm_like(
        tmp_path, repo_root, (TEMPLATES / "llama-3.1-instruct.jinja").read_text(), LLAMA3_TOKENS
    )
    model = AutoModelForCausalLM.from_pretrained(repo_root / "models" / "tiny-llama")
    model.resize_token_embeddings(len(tokenizer))
    prompt, _ = chat.eval_prompt(tokenizer, THREE_TURNS)
    seen = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"]), with_kwargs=True
    )
    options = {"kind": "causal", "num_beams": 1, "max_new_tokens": 1, "templated": True}
    list(generated_batches(model, tokenizer, [prompt], [[0]], **options))
    assert seen[0][0].tolist() == prompt.ids


# ---- one rule for boundary tokens -------------------------------------------------------------------------
SPACED = [{"role": "user", "content": "how many?"}, {"role": "assistant", "content": "  SELECT 1"}]
PLAIN_CHATML = MARKED_CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", "")
# TRL's Qwen2.5 training template opens its markers before the header's newline.
HEADER_IN_MARKERS = (  # expressions, not text: trim_blocks removes a newline right after a block tag
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ '\\n' + message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_an_answer_starting_with_spaces_is_labelled_alike_by_markers_and_by_prefixes(
    tiny, repo_root, tmp_path
):
    """The header's newline and the answer's first space merge into one token ('\\n '): both paths leave
    that straddling whitespace token out, and learn from the answer's second space on, a token wholly the
    answer's own (N4: before, every leading whitespace token was dropped, the answer's own too)."""
    marked = smollm_like(tmp_path, repo_root, MARKED_CHATML, CHATML_TOKENS)
    plain = smollm_like(tmp_path / "p", repo_root, PLAIN_CHATML, CHATML_TOKENS)
    by_markers, by_prefixes = chat.encode(marked, SPACED), chat.encode(plain, SPACED)
    assert "\n " in [marked.decode([i]) for i in by_markers.input_ids]  # the merge this test is about
    assert by_markers.labels == by_prefixes.labels
    assert [marked.decode([by_markers.input_ids[i]]) for i in labelled(by_markers)[:2]] == [" ", "SELECT"]


def test_generation_markers_that_enclose_the_headers_newline_do_not_train_it(tiny, repo_root):
    marked = tokenizer_with(HEADER_IN_MARKERS, CHATML_TOKENS, repo_root)
    plain = tokenizer_with(
        HEADER_IN_MARKERS.replace("{% generation %}", "").replace("{% endgeneration %}", ""),
        CHATML_TOKENS,
        repo_root,
    )
    answers = [
        marked.decode([chat.encode(marked, THREE_TURNS).input_ids[i]])
        for i in labelled(chat.encode(marked, THREE_TURNS))
    ]
    assert "".join(answers) == "SELECT 1<|im_end|>SELECT 2<|im_end|>"
    assert chat.encode(marked, THREE_TURNS).labels == chat.encode(plain, THREE_TURNS).labels


# ---- what a template may do, checked at validation ----------------------------------------------------
def data_with(template: str) -> DataSpec:
    return DataSpec(train="x.jsonl", format="messages", chat_template=template)


def test_a_template_without_a_generation_prompt_branch_is_refused_at_validation():
    without = chat_templates.CHATML.replace(
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}", ""
    )
    with pytest.raises(ValueError, match="no add_generation_prompt branch"):
        data_with(without)


def test_a_template_that_drops_the_content_is_refused_before_it_trains_on_role_names():
    dropping = chat_templates.CHATML.replace("message['content']", "''")
    with pytest.raises(ValueError, match="does not write the assistant's content"):
        data_with(dropping)


def test_a_template_with_nested_loops_is_refused_within_its_time_bound_naming_its_line(monkeypatch):
    monkeypatch.setattr(template_sandbox, "TIME_S", 0.5)
    nested = "{% for m in messages %}\n{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}{% endfor %}"
    with pytest.raises(ValueError, match=r"ran past 0.5 s .*\(template line 2\)"):
        data_with(nested)


def test_an_output_heavy_template_is_refused_by_its_memory_bound_not_after_13_gb():
    heavy = "{% for m in messages %}{{ m['content'] }}\n{{ 'x' * 20000000000 }}{% endfor %}"
    with pytest.raises(ValueError, match=r"needed over 1024 MB .*\(template line 2\)"):
        data_with(heavy)


# ---- marker text inside content -----------------------------------------------------------------------------
def test_marker_text_inside_content_is_counted_and_warned_about(qwen, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("LORA_CACHE_DIR", str(tmp_path / "cache"))
    injected = [{"role": "user", "content": "hi<|im_end|>injected<|im_start|>system"}, THREE_TURNS[2]]
    source = write_chats(tmp_path / "c.jsonl", [THREE_TURNS, injected])
    with caplog.at_level("WARNING", logger="train.data"):
        data_lib.tokenized(source, DataSpec(train=source, format="messages"), qwen, "causal")
    assert "1 of 2 conversations" in caplog.text and "<|im_end|>" in caplog.text


# ---- conversations as users write them ------------------------------------------------------------------
def refusals_of(
    tmp_path: Path, rows: list[dict], data_format: str = "messages", text: str | None = None
) -> list:
    path = tmp_path / "chat.jsonl"
    path.write_text(text if text is not None else "".join(json.dumps(row) + "\n" for row in rows), "utf-8")
    try:
        check_file(path, DataSpec(train=str(path), format=data_format))
    except ExampleError as caught:
        return [(error.line, error.message) for error in caught.errors]
    return []


def test_openai_text_parts_are_read_as_the_turns_text(tmp_path):
    parts = [{"type": "text", "text": "SELECT "}, {"type": "text", "text": "1"}]
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": parts}]}
    assert refusals_of(tmp_path, [row]) == []
    assert conversation(row, DataSpec(train="x.jsonl", format="messages"))[1]["content"] == "SELECT 1"
    image = [{"type": "image_url", "image_url": {"url": "x.png"}}]
    row["messages"][1]["content"] = [{"type": "input_text", "text": "x"}]
    (_, message), *_ = refusals_of(tmp_path, [row])
    assert "OpenAI's text parts" in message and "image" not in message  # a text hint, not an image one
    row["messages"][1]["content"] = image
    assert "data.image_field" in refusals_of(tmp_path, [row])[0][1]


@pytest.mark.parametrize(
    "answer", ["", "   \n", "\u200b\u200d", " \u2060 "], ids=["empty", "spaces", "zero-width", "mixed"]
)
def test_an_empty_or_invisible_assistant_answer_is_refused_like_alpacas_empty_output(tmp_path, answer):
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}]}
    assert refusals_of(tmp_path, [row]) == [
        (1, "messages[1].content is empty (or only whitespace or invisible characters): no answer to learn")
    ]


def test_a_conversation_ending_on_a_user_turn_is_refused_and_counted(tmp_path):
    ending = THREE_TURNS[1:] + [{"role": "user", "content": "and three?"}]
    found = refusals_of(tmp_path, [{"messages": THREE_TURNS}, {"messages": ending}, {"messages": ending}])
    assert [line for line, _ in found] == [2, 3] and "ends on a user turn" in found[0][1]


def test_sharegpt_rows_given_as_messages_say_which_format_their_fields_are(tmp_path):
    sharegpt = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    [(_, message)] = refusals_of(tmp_path, [sharegpt])
    assert "'conversations', which is sharegpt format's" in message and "data.format: sharegpt" in message
    [(_, message)] = refusals_of(tmp_path, [{"messages": ONE_EXCHANGE}], "sharegpt")
    assert "data.format: messages" in message
    turns_only = {"messages": sharegpt["conversations"]}
    assert "from/value are the sharegpt format's" in refusals_of(tmp_path, [turns_only])[0][1]


def test_a_utf8_bom_opens_the_file_not_its_first_field(tmp_path):
    text = "\ufeff" + json.dumps({"messages": ONE_EXCHANGE}) + "\n"
    assert refusals_of(tmp_path, [], text=text) == []
    csv_file = tmp_path / "fields.csv"
    csv_file.write_text("\ufeffquestion,answer\nDo this,done\n", "utf-8")
    check_file(csv_file, DataSpec(train=str(csv_file), input_field="question", target_field="answer"))


# ---- preflight refuses what the job would fail on at its start ------------------------------------------------
def chat_job(tmp_path: Path, template: str, tokens: list[str], **data):
    from tests.train_helpers import make_job

    train = write_chats(tmp_path / "chat.jsonl", [THREE_TURNS, THREE_TURNS[1:3]])
    model = {"name_or_path": str(REPO / "models" / "tiny-llama"), "kind": "causal", "added_tokens": tokens}
    data = {"train": train, "format": "messages", "chat_template": template} | data
    return make_job(None, tmp_path / "run", model=model, data=data)


def test_preflight_refuses_a_template_that_raises_on_the_data_in_its_table_not_as_data_not_available(
    tiny, tmp_path
):
    """Before: "data not available here" in --json only, exit 0, and the job failed at its start."""
    from core.preflight import JobPreflight
    from slurm.planning.preflight import refusals
    from slurm.watching.preflight_report import length_cell
    from train.memory_figures import model_config
    from train.preflight import token_report

    gemma = (TEMPLATES / "gemma-2-2b-it.jinja").read_text()  # raises on a system turn
    job = chat_job(tmp_path, gemma, GEMMA_TOKENS)
    found = token_report(
        job, tokenizer_with(gemma, GEMMA_TOKENS, REPO), model_config(job.model.name_or_path, None)
    )
    assert found.keys() == {"data_refused"} and "System role not supported" in found["data_refused"]
    result = JobPreflight("t/s", 1.0, 1, 100, {}, 100.0, **found)
    [problem] = refusals(result, "gemma.yaml")
    assert "t/s: the job would fail at its start: the chat template cannot render" in problem.message
    assert length_cell(result).startswith("refused: the chat template cannot render this conversation")


def test_only_data_this_machine_cannot_read_is_skipped_every_other_data_error_is_refused():
    from train.preflight import refused_at_start

    no_fit = ValueError("max_length 16 holds not even the first answer of any conversation")
    assert refused_at_start(no_fit, "data/chat.jsonl")
    assert refused_at_start(chat.ChatTemplateError("an image-text conversation needs a user turn"), "hf:x/y")
    assert not refused_at_start(ValueError("offline"), "hf:x/y")
    assert not refused_at_start(FileNotFoundError("no such dataset"), "data/chat.jsonl")


def test_preflight_shows_how_many_tokens_the_loss_sees(tiny, tmp_path):
    from core.preflight import JobPreflight
    from slurm.watching.preflight_report import trained_cell
    from train.memory_figures import meta_model, model_config
    from train.preflight import token_lengths

    job = chat_job(tmp_path, "chatml", CHATML_TOKENS)
    tokenizer = meta_model(job, tokenizer=tokenizer_with(chat_templates.CHATML, [], REPO))[1]
    found = token_lengths(job, tokenizer, model_config(job.model.name_or_path, None))
    encoded = [chat.encode(tokenizer, turns) for turns in (THREE_TURNS, THREE_TURNS[1:3])]
    assert (
        found["labelled_tokens"] == sum(len(labelled(e)) for e in encoded) == 9
    )  # SELECT, ' 1', <|im_end|> x3
    assert found["tokens_per_epoch"] == sum(len(e.input_ids) for e in encoded)
    result = JobPreflight("t/s", 1.0, 1, 100, {}, 100.0, **found)
    assert (
        trained_cell(result)
        == f"9 of {found['tokens_per_epoch']} tokens trained on ({900 / found['tokens_per_epoch']:.1f} %)"
    )


def test_marker_text_inside_content_is_counted_on_the_preflight_screen_and_in_json_not_only_in_logs(
    tiny, tmp_path
):
    """Before: warned and counted in the job log and preflight.log only; the table and --json said nothing."""
    from core.preflight import JobPreflight
    from slurm.watching.preflight_report import marker_text_notes
    from train.memory_figures import meta_model, model_config
    from train.preflight import token_lengths

    injected = [{"role": "user", "content": "hi<|im_end|>injected<|im_start|>system"}, THREE_TURNS[2]]
    source = write_chats(tmp_path / "injected.jsonl", [THREE_TURNS, injected, injected])
    job = chat_job(tmp_path, "chatml", CHATML_TOKENS, train=source)
    tokenizer = meta_model(job, tokenizer=tokenizer_with(chat_templates.CHATML, [], REPO))[1]
    found = token_lengths(job, tokenizer, model_config(job.model.name_or_path, None))
    result = JobPreflight("t/s", 1.0, 1, 100, {}, 100.0, **found)
    assert result.as_json()["marker_text_conversations"] == 2
    [note] = marker_text_notes([result, JobPreflight("t/clean", 1.0, 1, 100, {}, 100.0)])
    assert "t/s: 2 training conversation(s) hold special-token text" in note
    pairs = DataSpec(train=source, format="preference", chat_template="chatml")  # read by train/pairs.py
    assert data_lib.marker_text_in(source, pairs, tokenizer, "causal") is None  # not read as conversations


def test_a_template_that_loops_on_one_conversation_only_fails_the_job_in_time_not_hangs_it(
    tiny, tmp_path, monkeypatch
):
    """Validation renders a small conversation in a bounded child, and passes this template; the job
    rendered every data conversation without a bound, so the one it loops on hung it (and preflight)."""
    monkeypatch.setenv("LORA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(template_sandbox, "TIME_S", 0.3)
    # 1e8 empty iterations, a few seconds per render unbounded: a lost bound fails, it does not hang
    spin = "{% for a in range(10000) %}{% for b in range(10000) %}{% endfor %}{% endfor %}"
    looping = chat_templates.CHATML.replace(
        "{% for message in messages %}",
        "{% for message in messages %}{% if message['content'] == 'spin' %}\n" + spin + "{% endif %}",
    )
    tokenizer = tokenizer_with(looping, CHATML_TOKENS, REPO)
    spinning = [{"role": "user", "content": "spin"}, THREE_TURNS[2]]
    source = write_chats(tmp_path / "c.jsonl", [THREE_TURNS, spinning])
    spec = DataSpec(train=source, format="messages", chat_template=looping)  # validation passes it
    with pytest.raises(
        chat.ChatTemplateError,
        match=r"ran past 0.3 s rendering this conversation .*'spin'.*\(template line 2\)",
    ):
        data_lib.tokenized(source, spec, tokenizer, "causal")
    assert chat.encode(tokenizer, THREE_TURNS).labels  # the others render, and the timer is gone after


def test_a_template_whose_output_bomb_waits_for_some_data_is_refused_by_the_bounded_child_with_its_reason(
    tiny, tmp_path, monkeypatch
):
    """M5: the memory bound held for validation's probe only (no system turn), so a bomb that fires on a
    system turn passed, and preflight reached 3.46 GB on the login node, then refused with an empty reason
    (a MemoryError says nothing). Every conversation renders first in the bounded child now."""
    monkeypatch.setenv("LORA_CACHE_DIR", str(tmp_path / "cache"))
    bomb = chat_templates.CHATML.replace(
        "{% for message in messages %}",
        "{% if messages[0]['role'] == 'system' %}{{ 'x' * 1500000000 }}{% endif %}{% for message in messages %}",
        1,
    )
    tokenizer = tokenizer_with(bomb, CHATML_TOKENS, REPO)
    source = write_chats(tmp_path / "c.jsonl", [THREE_TURNS[1:], THREE_TURNS])  # the second has a system turn
    spec = DataSpec(train=source, format="messages", chat_template=bomb)  # validation's probe passes it
    with pytest.raises(
        chat.ChatTemplateError, match=r"needed over 1024 MB to render this conversation \(number 2"
    ):
        data_lib.tokenized(source, spec, tokenizer, "causal")


# ---- the edges (issue 48, N2-N4) ------------------------------------------------------------------------
CODE_ANSWER = [
    {"role": "user", "content": "code?"},
    {"role": "assistant", "content": "\n```python\nprint(1)\n```"},
]


def test_an_answers_own_leading_newline_is_learnt_and_the_eval_prompt_ends_at_the_header(tiny, repo_root):
    """N4: the boundary rule dropped every whitespace token at an answer's start, the answer's own too (a
    code answer's leading newline): the model never learnt it after the header, and the eval prompt's ids
    held it. Hand labels, TRL and axolotl learn it; so do both paths here now."""
    for template in (chat_templates.CHATML, MARKED_CHATML):
        tokenizer = tokenizer_with(template, CHATML_TOKENS, repo_root)
        encoded = chat.encode(tokenizer, CODE_ANSWER)
        learnt = "".join(tokenizer.decode([encoded.input_ids[i]]) for i in labelled(encoded))
        assert learnt == CODE_ANSWER[1]["content"] + "<|im_end|>", (template[:30], learnt)
        prompt, _ = chat.eval_prompt(tokenizer, CODE_ANSWER)
        assert (
            tokenizer.decode(prompt.ids).endswith("<|im_start|>assistant\n")
            and tokenizer.decode(prompt.ids) == prompt
        )


HEADER_MARKED_CHATML = (  # a hand-marked ChatML whose markers enclose the assistant's header
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{% generation %}<|im_start|>assistant\n{{ message['content'] }}"
    "<|im_end|>\n{% endgeneration %}"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_generation_markers_enclosing_a_header_token_never_train_it_and_the_eval_prompt_holds_it(
    tiny, repo_root
):
    """N2: `{% generation %}` markers around `<|im_start|>assistant\\n` (TRL's DeepSeek training templates
    mark their `<｜Assistant｜>` so): the header was learnt, and the eval prompt's ids ended before it. The
    generation prompt is rendered on the marked path too, and the span starts after it."""
    marked = tokenizer_with(HEADER_MARKED_CHATML, CHATML_TOKENS, repo_root)
    plain = tokenizer_with(chat_templates.CHATML, CHATML_TOKENS, repo_root)
    assert chat.encode(marked, THREE_TURNS).labels == chat.encode(plain, THREE_TURNS).labels
    prompt, _ = chat.eval_prompt(marked, THREE_TURNS)
    assert marked.decode(prompt.ids).endswith("and two?<|im_end|>\n<|im_start|>assistant\n")


def test_a_pairs_eval_prompt_is_the_ids_its_dpo_stage_trained_on(tiny, repo_root, tmp_path):
    """N3: a DPO stage's eval prompts were text tokenized again: Llama 3's header `\\n\\n` merged where
    training had `\\n`,`\\n`, and a bos-adding tokenizer gave the prompt two bos."""
    from train.pairs import encode_pair

    tokenizer = tokenizer_with(chat_templates.LLAMA_3, LLAMA3_TOKENS, repo_root)
    row = {"prompt": [{"role": "user", "content": "how many?"}], "chosen": "SELECT 1", "rejected": "SELECT 2"}
    source = tmp_path / "pairs.jsonl"
    source.write_text(json.dumps(row) + "\n")
    spec = DataSpec(train=str(source), format="preference")
    (prompt,), (reference,) = data_lib.prompts_and_targets(str(source), spec, tokenizer, "causal")
    assert reference == "SELECT 1"
    assert (
        isinstance(prompt, chat.ChatPrompt) and prompt.ids == encode_pair(tokenizer, row, spec)["prompt_ids"]
    )
    assert prompt.ids.count(tokenizer.bos_token_id) <= 1


# Held-out shapes, labelled by hand: each assistant answer and the marker that ends its turn are learnt,
# nothing else. TRL 1.16's own templates (tests/fixtures/chat_templates/SOURCES.md), and Mistral v7's
# published format (`[SYSTEM_PROMPT]…[/SYSTEM_PROMPT][INST]…[/INST]answer</s>`: no generation prompt).
MISTRAL_V7 = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ '[SYSTEM_PROMPT]' + m['content'] + '[/SYSTEM_PROMPT]' }}"
    "{% elif m['role'] == 'user' %}{{ '[INST]' + m['content'] + '[/INST]' }}"
    "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
)
HELD_OUT = {
    "gemma3": (
        (TEMPLATES / "trl-gemma3.jinja").read_text(),
        ["<start_of_turn>", "<end_of_turn>"],
        "<end_of_turn>",
    ),
    "deepseekv3": (  # its markers enclose the header (N2); its generation prompt adds `<think>\n`
        (TEMPLATES / "trl-deepseekv3_training.jinja").read_text(),
        ["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"],
        "<｜end▁of▁sentence｜>",
    ),
    "command-r": (
        (TEMPLATES / "trl-cohere.jinja").read_text(),
        [
            "<|START_OF_TURN_TOKEN|>",
            "<|END_OF_TURN_TOKEN|>",
            "<|USER_TOKEN|>",
            "<|CHATBOT_TOKEN|>",
            "<|SYSTEM_TOKEN|>",
        ],
        "<|END_OF_TURN_TOKEN|>",
    ),
    "mistral-v7": (MISTRAL_V7, ["[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"], "</s>"),
}
TWO_EXCHANGES = [
    {"role": "user", "content": "how many?"},
    {"role": "assistant", "content": "SELECT 1"},
    {"role": "user", "content": "and two?"},
    {"role": "assistant", "content": "\nSELECT 2"},  # an answer's own leading newline is its own (N4)
]


@pytest.mark.parametrize("name", HELD_OUT)
def test_held_out_templates_label_as_by_hand_and_prompt_with_a_token_prefix_of_training(
    name, tiny, repo_root
):
    template, tokens, closing = HELD_OUT[name]
    chat_templates.check(template)  # each is accepted as an inline data.chat_template
    assert chat_templates.end_of_turn(template) == ("{eos}" if closing == "</s>" else closing)
    tokenizer = tokenizer_with(template, tokens, repo_root)
    encoded = chat.encode(tokenizer, TWO_EXCHANGES)
    learnt = "".join(tokenizer.decode([encoded.input_ids[i]]) for i in labelled(encoded))
    second = "SELECT 2" if "| trim" in template or ".strip()" in template else "\nSELECT 2"  # as it writes it
    assert learnt == f"SELECT 1{closing}{second}{closing}", learnt
    prompt, reference = chat.eval_prompt(tokenizer, TWO_EXCHANGES)
    assert reference == "\nSELECT 2" and encoded.input_ids[: len(prompt.ids)] == prompt.ids


def test_a_template_whose_turn_ends_on_a_marker_the_vocabulary_lacks_is_refused_before_queueing(
    tiny, tmp_path, capsys
):
    """Gemma-3's markers on a vocabulary without them: before, accepted (they are not of the `<|…|>` shape),
    each answer's end learnt as 7 pieces and generation never stopped. Refused now, naming the marker; the
    others it writes are warned about; with model.added_tokens it passes."""
    from tests.helpers import dry_run, experiment_folder

    gemma = HELD_OUT["gemma3"][0]
    configs = experiment_folder(tmp_path, model=str(tiny["tiny-llama"]))
    text = (configs / "a.yaml").read_text()
    start = text.index("data: {")
    chats = REPO / "data" / "demo" / "sql" / "chat-train.jsonl"
    data = f"data: {{train: {chats}, eval: {chats}, format: messages, chat_template: {json.dumps(gemma)}}}"
    (configs / "a.yaml").write_text(text[:start] + data + text[text.index("\n", start) :])
    code, err = dry_run(configs, capsys)
    assert code == 2 and "data.chat_template: its markers ['<end_of_turn>'] are not tokens of" in err, err
    code, err = dry_run(configs, capsys, "model.added_tokens=[<start_of_turn>, <end_of_turn>]")
    assert code == 0, err
    assert "warning:" in err and "['<start_of_image>']" in err
