"""`data.chat_template`: a named template shipped here, or the user's own Jinja; and whether a local model
folder carries a template of its own. Torch-free: the launcher checks both before anything is queued.

The named templates are for models that ship none (base models) and are the forms their families' instruct
models use. A template's special markers (ChatML's `<|im_start|>`, `<|im_end|>`) must be tokens of the
model's vocabulary to be learnt as one token each: add them with `model.added_tokens` when they are not.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

from core.problems import did_you_mean

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Meta-Llama-3-Instruct's own (the 3.1 one adds tools and a dated system turn).
LLAMA_3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + "
    "message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
NAMED = {"chatml": CHATML, "llama-3": LLAMA_3}
# Template files a model folder may keep its template in (transformers 5 writes chat_template.jinja).
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def is_jinja(value: str) -> bool:
    return "{{" in value or "{%" in value


def check(value: str) -> None:
    """Raise ValueError unless `value` names a shipped template or is Jinja that parses, renders a small
    conversation within the sandbox's bounds (core/template_sandbox.py) and keeps the rules of `behaves`."""
    if not is_jinja(value):
        if value not in NAMED:
            raise ValueError(
                f"{value!r} is neither a named template ({', '.join(NAMED)}){did_you_mean(value, NAMED)} nor "
                "a Jinja template (one holds {{ }} or {% %}, e.g. a tokenizer_config.json's chat_template)"
            )
        return
    checked(value)


@lru_cache(maxsize=64)  # a DataSpec is validated many times in a process; the child runs once per template
def checked(value: str) -> None:
    behaves(probe(value))


@lru_cache(maxsize=64)
def probe(value: str) -> dict[tuple[int, bool], str]:
    """The probe conversation's renderings (PROBE_CALLS), in the bounded child; ValueError if the template
    does not parse or render within the bounds."""
    from jinja2 import TemplateSyntaxError

    from core.template_sandbox import environment, render_bounded

    try:  # the environment transformers renders chat templates in
        environment().parse(value)
    except TemplateSyntaxError as exc:
        raise ValueError(
            f"the Jinja template does not parse: {exc.message} (template line {exc.lineno})"
        ) from None
    calls = [
        {"messages": PROBE[:end], "add_generation_prompt": prompt, **SPECIALS} for end, prompt in PROBE_CALLS
    ]
    return dict(zip(PROBE_CALLS, render_bounded(value, calls), strict=True))


# A template's special markers, of every shape templates use: `<|im_end|>` (ChatML, Llama 3, Phi-3,
# Cohere), `<｜end▁of▁sentence｜>` (DeepSeek), `<end_of_turn>` (Gemma), `</s>`, `[/INST]` (Mistral).
ANY_MARKER = re.compile(r"<\|[^|<>\s]+\|>|<｜[^｜\s]+｜>|</?[A-Za-z_][A-Za-z0-9_▁]*>|\[/?[A-Z][A-Z_]*\]")


def end_of_turn(value: str) -> str | None:
    """The marker that ends an assistant turn (`<|im_end|>`, `<end_of_turn>`, the eos `</s>`): what the
    template writes right after the answer, where generation must stop. None when it writes no marker there
    (a plain-text format) or cannot render the probe (validation says why)."""
    try:
        full = probe(text(value))[(len(PROBE), False)]
    except (ValueError, KeyError):
        return None
    answer = PROBE[1]["content"]
    after = full[full.index(answer) + len(answer) :] if answer in full else ""
    found = ANY_MARKER.match(after)
    return found.group(0).replace(SPECIALS["eos_token"], "{eos}") if found else None


def missing_markers(
    value: str, vocabulary: set[str] | dict, added: list[str] | tuple, eos: str | None
) -> tuple[list[str], list[str]]:
    """(refused, warned): the markers of `value` that are not tokens of `vocabulary` nor among `added`
    (model.added_tokens). Refused: the `<|...|>` ones and the end of an assistant turn, whatever its shape
    (Gemma-3's `<end_of_turn>` on a vocabulary without it: each answer's end learnt as 7 pieces, and
    generation never stops); warned: the other shapes, which the tokenizer splits (`[INST]` on Mistral's
    first vocabulary is text by design)."""
    known = lambda marker: marker in vocabulary or marker in added  # noqa: E731
    refused = [m for m in markers(text(value)) if not known(m)]
    closing = end_of_turn(value)
    if closing == "{eos}":
        closing = None  # the tokenizer's own eos: a token of its vocabulary
    if closing and not known(closing) and closing not in refused:
        refused.append(closing)
    warned = [
        m
        for m in dict.fromkeys(ANY_MARKER.findall(text(value)))
        if not known(m) and m not in refused and m not in SPECIALS.values() and m != eos
    ]
    return refused, warned


# A small conversation every template renders (no system turn: Gemma's refuses one), with answers that
# cannot be mistaken for a template's own text.
PROBE = [
    {"role": "user", "content": "Q1q"},
    {"role": "assistant", "content": "A1a"},
    {"role": "user", "content": "Q2q"},
    {"role": "assistant", "content": "A2a"},
]
PROBE_CALLS = [(len(PROBE), False), (1, True), (1, False), (2, False), (3, True), (3, False)]
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}


def behaves(texts: dict[tuple[int, bool], str]) -> None:
    """What a template may do (README, chat data): (1) its generation prompt extends the conversation so far
    (the turn header the model is given, never learnt), or, with no generation prompt by design (Mistral's:
    `[/INST]` ends the user's turn and the answer follows it), the answer follows the conversation so far
    with nothing of the template's between; (2) each assistant content lies in its turn, between the
    generation prompt and the end of that turn, where the labels fall. The eos token once at a
    conversation's end (Phi-3's) is allowed. A template whose earlier turns render differently once later
    turns follow (Qwen3's) is judged by the trainer instead (train/chat.py)."""
    full = texts[(len(PROBE), False)].removesuffix(SPECIALS["eos_token"])
    for index in (1, 3):
        so_far = texts[(index, False)].removesuffix(SPECIALS["eos_token"])
        prompt = texts[(index, True)]
        through = texts[(index + 1, False)].removesuffix(SPECIALS["eos_token"])
        extends = prompt.startswith(so_far) and len(prompt) > len(so_far)
        answer_follows = (
            prompt == so_far
            and through.startswith(prompt)
            and through[len(prompt) :].lstrip().startswith(PROBE[index]["content"])
        )
        if not (extends or answer_follows):
            raise ValueError(
                "the chat template has no add_generation_prompt branch (with it, the conversation so far "
                f"renders as {prompt[-40:]!r}, without it as {so_far[-40:]!r}) and the assistant's turn "
                f"starts with the template's own text ({through[len(so_far) :][:40]!r}): that header would be "
                "learnt as part of the answer and the eval would prompt without it; end the template with "
                "{% if add_generation_prompt %}<the assistant turn's header>{% endif %}"
            )
        stable = full.startswith(prompt) and full.startswith(through)
        if stable and PROBE[index]["content"] not in full[len(prompt) : len(through)]:
            raise ValueError(
                "the chat template does not write the assistant's content inside its turn (rendering "
                f"{PROBE[index]['content']!r} gave {full[len(prompt) : len(through)]!r}): the labels would "
                "fall on the template's own text; write message['content'] for every role"
            )


def markers(template: str) -> list[str]:
    """The special markers a template writes in `<|...|>` form (ChatML's, Llama 3's, Phi-3's), in order."""
    return list(dict.fromkeys(re.findall(r"<\|[A-Za-z0-9_]+\|>", template)))


def text(value: str) -> str:
    """The Jinja of `data.chat_template` (a name or the template itself)."""
    return value if is_jinja(value) else NAMED[value]


# The most a model folder's tokenizer files may hold when the launcher reads them (Gemma-3's tokenizer.json
# is 33 MB, the largest met): a link to /dev/zero there filled the login node's memory (M4).
MAX_TOKENIZER_BYTES = 64 * 10**6


def read_folder_json(path: Path) -> dict | None:
    """A model folder's JSON file, bounded (core/files.py read_regular); None when missing, unreadable,
    over the bound or not an object: then what it would say is not known here, and preflight judges."""
    from core.files import read_regular

    try:
        value = json.loads(read_regular(path, MAX_TOKENIZER_BYTES))
    except (OSError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def folder_vocabulary(folder: Path) -> set[str] | None:
    """The tokens of a local model folder's tokenizer.json (its vocabulary and added tokens); None when it
    is no local folder or has no readable tokenizer.json."""
    spec = read_folder_json(folder / "tokenizer.json")
    try:
        vocabulary = spec["model"]["vocab"]
        if not isinstance(vocabulary, dict):  # a Unigram list of pieces: not read here, preflight judges it
            return None
        return set(vocabulary) | {token["content"] for token in spec.get("added_tokens") or []}
    except (KeyError, TypeError):
        return None


def folder_template(folder: Path) -> str | None:
    """A local model folder's own chat template ('' when it carries none); None when it is no local folder
    (a hub id, known only on the node) or its template cannot be read here (preflight reads it)."""
    from core.files import read_regular

    if not folder.is_dir():
        return None
    jinja = folder / TEMPLATE_FILES[0]
    if jinja.is_file():
        try:
            return read_regular(jinja, MAX_TOKENIZER_BYTES).decode("utf-8")
        except (OSError, UnicodeDecodeError):
            return None
    for name in (TEMPLATE_FILES[1], "tokenizer_config.json"):
        if not (folder / name).exists():
            continue
        config = read_folder_json(folder / name)
        if config is None:
            return None
        template = config.get("chat_template")
        if isinstance(template, list):  # several named templates: the one transformers uses by default
            template = next(
                (t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                None,
            )
        if isinstance(template, str) and template:
            return template
    return ""


def folder_has_template(folder: Path) -> bool | None:
    """Does a local model folder carry a chat template? None when it is no local folder (a hub id, known
    only on the node), or when its files cannot be read here."""
    template = folder_template(folder)
    return None if template is None else bool(template)
