"""Conversations (core/conversations.py) → text with the model's chat template → token ids, labels on the
assistant's answers only.

What an answer is: each assistant turn's content and the end-of-turn token the template closes it with
(ChatML's `<|im_end|>`, Llama 3's `<|eot_id|>`), in every turn of a conversation, not only the last; never the
whitespace the template puts between turns (ChatML's newline after `<|im_end|>`), nor the header that opens a
turn (the model is given that by the chat endpoint's generation prompt, exactly as the eval gives it here).

How it is found: a template with `{% generation %}` markers says so itself (`return_assistant_tokens_mask`;
trailing whitespace tokens inside the markers are left out, as above). Any other is rendered prefix by prefix: the conversation up to an assistant turn with the generation prompt,
then through that turn; the answer lies between, when both renderings are prefixes of the whole one. A
template for which they are not (Qwen3's drops earlier turns' `<think>` blocks) and that has no markers is
refused: mislabelling silently is the one outcome not allowed. Labels fall on tokens by their character
offsets in the whole rendering, which is tokenized once without added special tokens (a template writes its
own `bos_token`; the tokenizer adding another would double it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from core import chat_templates
from core.config import DataSpec
from core.conversations import last_answer, no_template_message

MARKERS = re.compile(r"{%-?\s*generation\s*-?%}")
ASSISTANT = "assistant"


class ChatTemplateError(ValueError):
    """A conversation the chat template cannot render, or whose answers it does not let us find."""


@dataclass(frozen=True)
class Encoded:
    """One conversation as trained: its rendering, its ids, labels (-100 but on answers) and, for each
    assistant turn, the number of ids through its end (where a too-long conversation may be cut whole)."""

    text: str
    input_ids: list[int]
    labels: list[int]
    turn_ends: list[int]


def use_template(tokenizer, spec: DataSpec, model: str) -> None:
    """Give the tokenizer (or processor) the template the data asks for, or check it has its own. The
    tokenizer is saved with the adapter, so later stages, the eval job and the export render the same way."""
    if spec.chat_template is not None:
        text = chat_templates.text(spec.chat_template)
        tokenizer.chat_template = text
        if hasattr(tokenizer, "tokenizer"):  # a processor: its tokenizer renders the text-only prompts
            tokenizer.tokenizer.chat_template = text
    elif not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(f"data.format: {no_template_message(model, spec.format)}")


def with_image(turns: list[dict]) -> list[dict]:
    """An image-text example's turns: its image (data.image_field) leads its first user turn, in the
    content-list form vision-language chat templates render as the image placeholder."""
    first = next((i for i, turn in enumerate(turns) if turn["role"] == "user"), None)
    if first is None:
        raise ChatTemplateError("an image-text conversation needs a user turn to hold its image")
    content = [{"type": "image"}, {"type": "text", "text": turns[first]["content"]}]
    return [*turns[:first], {"role": "user", "content": content}, *turns[first + 1 :]]


def text_tokenizer(tokenizer_or_processor):
    """The text tokenizer, whether given a tokenizer or a processor holding one."""
    return getattr(tokenizer_or_processor, "tokenizer", tokenizer_or_processor)


def rendered(tokenizer, turns: list[dict], generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # jinja2's errors, and the templates' own raise_exception(...)
        raise ChatTemplateError(f"the chat template cannot render this conversation: {exc}") from None


def eval_prompt(tokenizer, turns: list[dict]) -> tuple[str, str]:
    """(prompt, reference): the conversation up to its last assistant turn with the generation prompt, as a
    chat endpoint sends it, and that turn's content. The prompt is the training rendering's prefix."""
    last = last_answer(turns)
    return rendered(tokenizer, turns[:last], generation_prompt=True), turns[last]["content"]


def encode(tokenizer, turns: list[dict], train_on: str = ASSISTANT) -> Encoded:
    """Ids and labels of one conversation (see the module's docstring)."""
    full = rendered(tokenizer, turns)
    tokens = text_tokenizer(tokenizer)(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = tokens["input_ids"], tokens["offset_mapping"]
    if MARKERS.search(template_of(tokenizer)) and not hasattr(tokenizer, "tokenizer"):
        token_spans = marked_spans(tokenizer, turns, ids)
    elif (spans := char_spans(tokenizer, turns, full)) is not None:
        token_spans = [on_tokens(span, offsets) for span in spans]
    elif train_on == ASSISTANT:
        raise ChatTemplateError(
            "the chat template renders earlier turns differently once later turns follow (as Qwen3's drops "
            "earlier turns' <think> blocks), so the assistant's answers cannot be found by rendering prefixes, "
            "and it has no {% generation %} markers to say where they are: set data.train_on: all, or a "
            "data.chat_template with {% generation %}...{% endgeneration %} around each assistant content"
        )
    else:  # everything is learnt; a too-long conversation can only be dropped whole
        return Encoded(full, list(ids), list(ids), [len(ids)])
    if train_on != ASSISTANT:
        return Encoded(full, list(ids), list(ids), [end for _, _, end in token_spans])
    labels = [-100] * len(ids)
    for start, stop, _ in token_spans:
        labels[start:stop] = ids[start:stop]
    if all(label == -100 for label in labels):
        raise ChatTemplateError("no assistant token in this conversation once rendered (empty answers?)")
    return Encoded(full, list(ids), labels, [end for _, _, end in token_spans])


def template_of(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return template if isinstance(template, str) else ""


def char_spans(tokenizer, turns: list[dict], full: str) -> list[tuple[int, int, int]] | None:
    """For each assistant turn (answer start, answer end, turn end) in characters of `full`; None when the
    template is not prefix-stable. The answer ends before the whitespace that separates turns."""
    spans = []
    for index, turn in enumerate(turns):
        if turn["role"] != ASSISTANT:
            continue
        before = rendered(tokenizer, turns[:index], generation_prompt=True) if index else ""
        through = rendered(tokenizer, turns[: index + 1])
        if not (full.startswith(before) and full.startswith(through) and len(through) > len(before)):
            return None
        spans.append((len(before), len(through.rstrip()), len(through)))
    return spans


def on_tokens(span: tuple[int, int, int], offsets) -> tuple[int, int, int]:
    """Character span → token span: tokens that start inside the answer; the turn's end, as a count."""
    start, stop, end = span
    starts = [first for first, _ in offsets]
    first = next((i for i, s in enumerate(starts) if s >= start), len(starts))
    after_answer = next((i for i, s in enumerate(starts) if s >= stop), len(starts))
    through = next((i for i, s in enumerate(starts) if s >= end), len(starts))
    return first, after_answer, through


def marked_spans(tokenizer, turns: list[dict], ids: list[int]) -> list[tuple[int, int, int]]:
    """Token spans of the template's own {% generation %} markers, less trailing whitespace tokens."""
    encoded = tokenizer.apply_chat_template(
        turns, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    if list(encoded["input_ids"]) != list(ids):
        raise ChatTemplateError("the chat template renders differently with return_assistant_tokens_mask")
    mask, spans, index = encoded["assistant_masks"], [], 0
    while index < len(mask):
        if not mask[index]:
            index += 1
            continue
        start = index
        while index < len(mask) and mask[index]:
            index += 1
        stop = index
        while stop > start and not text_tokenizer(tokenizer).decode(ids[stop - 1 : stop]).strip():
            stop -= 1
        spans.append((start, stop, index))
    return spans


def end_of_turn_ids(tokenizer) -> list[int]:
    """The id closing an answer (ChatML's <|im_end|>), when it is a token of its own: generation stops
    there, as a chat endpoint stops. Found by encoding a two-turn conversation."""
    encoded = encode(tokenizer, [{"role": "user", "content": "?"}, {"role": ASSISTANT, "content": "!"}])
    answer = [label for label in encoded.labels if label != -100]
    tok = text_tokenizer(tokenizer)
    special = set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}))
    return [answer[-1]] if answer and answer[-1] in special else []
