"""Conversations (core/conversations.py) → text with the model's chat template → token ids, labels on the
assistant's answers only.

What an answer is: each assistant turn's content and the end-of-turn token the template closes it with
(ChatML's `<|im_end|>`, Llama 3's `<|eot_id|>`), in every turn of a conversation, not only the last; never the
whitespace the template puts between turns (ChatML's newline after `<|im_end|>`), nor the header that opens a
turn (the model is given that by the chat endpoint's generation prompt, exactly as the eval gives it here).

How it is found: a template with `{% generation %}` markers says so itself (`return_assistant_tokens_mask`).
Any other is rendered prefix by prefix: the conversation up to an assistant turn with the generation prompt,
then through that turn; the answer lies between, when both renderings are prefixes of the whole one (less
the eos a template writes once at a conversation's end, as Phi-3's does: no turn's, never learnt). A
template for which they are not (Qwen3's drops earlier turns' `<think>` blocks) and that has no markers is
refused, saying where the renderings differ: mislabelling silently is the one outcome not allowed. One rule
for boundary tokens on both paths (`trimmed`): a token holding answer text is learnt, a whitespace-only one
at either end of the span is not. Labels fall on tokens by their character offsets in the whole rendering,
which is tokenized once without added special tokens (a template writes its own `bos_token`; the tokenizer
adding another would double it). The eval's prompt is those ids up to the answer (`ChatPrompt`).
"""

from __future__ import annotations

import os
import re
import signal
import threading
from dataclasses import dataclass

from core import chat_templates, template_sandbox
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
    answer_starts: list[int]  # each assistant answer's first labelled id (all ids learnt: [0])


def use_template(tokenizer, spec: DataSpec, model: str, added_tokens: list[str] | tuple = ()) -> None:
    """Give the tokenizer (or processor) the template the data asks for, or check it has its own. The
    tokenizer is saved with the adapter, so later stages, the eval job and the export render the same way.
    A template of data.chat_template whose markers (`<|im_end|>`) are neither tokens of the vocabulary nor
    among `added_tokens` (model.added_tokens) is refused: each would be learnt as a dozen pieces, and
    generation would have no end-of-turn token to stop at."""
    if spec.chat_template is not None:
        text = chat_templates.text(spec.chat_template)
        tok = text_tokenizer(tokenizer)
        missing, _ = chat_templates.missing_markers(text, tok.get_vocab(), added_tokens, tok.eos_token)
        if missing:
            raise ChatTemplateError(
                f"data.chat_template: its markers {missing} are not tokens of {model}'s vocabulary: add them "
                f"with model.added_tokens: {missing} (else each is learnt as several pieces and generation "
                "has no end-of-turn token to stop at)"
            )
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
        return bounded(
            lambda: tokenizer.apply_chat_template(
                turns, tokenize=False, add_generation_prompt=generation_prompt
            ),
            turns,
        )
    except ChatTemplateError:
        raise
    except Exception as exc:  # jinja2's errors, and the templates' own raise_exception(...)
        why = str(exc) or type(exc).__name__  # a refusal always says its reason (a MemoryError says nothing)
        raise ChatTemplateError(f"the chat template cannot render this conversation: {why}") from None


# Conversations one bounded child renders at a time (its own memory holds them as well as the renders).
BOUNDED_CHUNK = 2000


def within_bounds(tokenizer, conversations: list[list[dict]]) -> None:
    """Every conversation rendered once through the template in the bounded child (core/template_sandbox.py:
    its memory and time capped), before any is rendered in this process: a template whose output bomb waits
    for some data (a system turn) passed validation's probe and then took 3.46 GB of the login node in
    preflight (M5), and a job's process, which will hold CUDA, takes no RLIMIT_AS. Raises ChatTemplateError
    naming the conversation and the bound."""
    template = getattr(text_tokenizer(tokenizer), "chat_template", None)
    if not isinstance(template, str) or not conversations:
        return
    specials = {k: v for k, v in text_tokenizer(tokenizer).special_tokens_map.items() if isinstance(v, str)}
    calls = [
        {
            "messages": turns,
            "add_generation_prompt": prompt,
            **specials,
            "what": what_conversation(index, turns),
        }
        for index, turns in enumerate(conversations)
        for prompt in (False, True)
    ]
    for start in range(0, len(calls), BOUNDED_CHUNK):
        try:
            template_sandbox.render_bounded(template, calls[start : start + BOUNDED_CHUNK], keep=False)
        except template_sandbox.TemplateBoundError as exc:
            raise ChatTemplateError(str(exc)) from None


def what_conversation(index: int, turns: list[dict]) -> str:
    first = next((str(t.get("content"))[:40] for t in turns if t.get("content")), "")
    return f"this conversation (number {index + 1} of the data, the one beginning {first!r})"


class RenderTimeout(Exception):  # an Exception, so jinja2 maps its traceback onto the template's lines
    pass


def bounded(render, turns: list[dict]):
    """`render()` (one conversation through the chat template) under the time bound validation gave the
    template (core/template_sandbox.py TIME_S), in this process: a template that loops on some conversation
    only (validation rendered a small one in a bounded child) fails here naming it, instead of hanging the job
    or preflight. Limits: SIGALRM interrupts Python between bytecodes, so one long C call (a huge string
    repeat) ends first, and no memory bound applies here (the job's own limit does; validation refused the
    output-heavy templates); only the main thread can take the signal, elsewhere the render runs unbounded,
    as it does when another timer is already running."""
    if threading.current_thread() is not threading.main_thread() or signal.getitimer(signal.ITIMER_REAL)[0]:
        return render()

    def out_of_time(signum, frame):
        raise RenderTimeout

    previous = signal.signal(signal.SIGALRM, out_of_time)
    signal.setitimer(signal.ITIMER_REAL, template_sandbox.TIME_S)
    try:
        return render()
    except RenderTimeout as exc:
        first = next((str(t.get("content"))[:40] for t in turns if t.get("content")), "")
        raise ChatTemplateError(
            f"the chat template ran past {template_sandbox.TIME_S:g} s rendering one conversation "
            f"(the one beginning {first!r}){template_sandbox.template_line(exc)}"
        ) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class ChatPrompt(str):
    """An eval prompt: its text (for predictions.jsonl and logs), and `ids`, the training tokenization of the
    conversation up to the answer's first labelled token. Tokenizing the text again can merge across that
    boundary (SmolLM2's tokenizer makes Llama 3's header end `\\n\\n` one token, where training had two), so
    generation is prompted with `ids`: a token prefix of what was trained."""

    ids: list[int]

    def __new__(cls, text: str, ids: list[int] = ()):  # ids default: a copy or an unpickling has its own
        prompt = super().__new__(cls, text)
        prompt.ids = list(ids)
        return prompt


def eval_prompt(tokenizer, turns: list[dict]) -> tuple[str, str]:
    """(prompt, reference): the conversation up to its last assistant turn with the generation prompt, as a
    chat endpoint sends it, and that turn's content. For a text model the prompt is a ChatPrompt, whose ids
    are the training ids before that answer; an image-text prompt stays text (its processor expands the
    image placeholder)."""
    last = last_answer(turns)
    text, reference = rendered(tokenizer, turns[:last], generation_prompt=True), turns[last]["content"]
    if hasattr(tokenizer, "tokenizer"):
        return text, reference
    try:
        encoded = encode(tokenizer, turns[: last + 1])
    except ChatTemplateError:  # not labelled by answers (train_on: all): the rendering's own tokens
        return ChatPrompt(text, tokenizer(text, add_special_tokens=False)["input_ids"]), reference
    return ChatPrompt(text, encoded.input_ids[: encoded.answer_starts[-1]]), reference


def encode(tokenizer, turns: list[dict], train_on: str = ASSISTANT) -> Encoded:
    """Ids and labels of one conversation (see the module's docstring): the whole rendering tokenized once,
    its answers found (`answer_spans`), then labelled (`labelled`)."""
    full = rendered(tokenizer, turns)
    tokens = text_tokenizer(tokenizer)(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(tokens["input_ids"])
    spans = answer_spans(tokenizer, turns, full, ids, tokens["offset_mapping"])
    if isinstance(spans, list):
        return labelled(full, ids, spans, train_on)
    if train_on == ASSISTANT:
        raise ChatTemplateError(
            f"{spans}, so the assistant's answers cannot be found by rendering prefixes, and the template "
            "has no {% generation %} markers to say where they are: set data.train_on: all, or a "
            "data.chat_template with {% generation %}...{% endgeneration %} around each assistant content"
        )
    return Encoded(full, ids, list(ids), [len(ids)], [0])  # everything learnt; too long: dropped whole


def answer_spans(tokenizer, turns: list[dict], full: str, ids: list[int], offsets) -> list[tuple] | str:
    """(answer start, answer stop, turn end) in tokens of each assistant turn, by one of two strategies:
    the template's own `{% generation %}` markers (`marked_spans`), else rendering prefixes (`char_spans`,
    then `on_tokens`); or why neither can say. A processor (image-text) takes the prefix path: `ids` are its
    text tokenizer's, and a mask from the processor's own tokenization need not line up with them."""
    if MARKERS.search(template_of(tokenizer)) and not hasattr(tokenizer, "tokenizer"):
        return marked_spans(tokenizer, turns, full, ids, offsets)
    spans = char_spans(tokenizer, turns, full)
    if isinstance(spans, str):
        return spans
    return [on_tokens(span, full, offsets, ids, text_tokenizer(tokenizer)) for span in spans]


def labelled(full: str, ids: list[int], spans: list[tuple], train_on: str) -> Encoded:
    """The labels: the answers' tokens (train_on: assistant), or every token (all), with each turn's end
    and answer start kept for cutting a too-long conversation at a turn boundary."""
    ends, starts = [end for _, _, end in spans], [start for start, _, _ in spans]
    if train_on != ASSISTANT:
        return Encoded(full, ids, list(ids), ends, starts)
    labels = [-100] * len(ids)
    for start, stop, _ in spans:
        labels[start:stop] = ids[start:stop]
    if all(label == -100 for label in labels):
        raise ChatTemplateError("no assistant token in this conversation once rendered (empty answers?)")
    return Encoded(full, ids, labels, ends, starts)


def template_of(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return template if isinstance(template, str) else ""


def closing_text(tokenizer, turns: list[dict], full: str) -> str:
    """The eos token a template writes once at a conversation's end (Phi-3's, after the last `<|end|>`): no
    turn's, so not learnt. Found as what `full` has and the same conversation with a user turn more has not."""
    eos = text_tokenizer(tokenizer).eos_token
    if not eos or not full.endswith(eos):
        return ""
    try:
        longer = rendered(tokenizer, [*turns, {"role": "user", "content": "?"}])
    except ChatTemplateError:
        return ""
    return eos if longer.startswith(full[: -len(eos)]) and not longer.startswith(full) else ""


def char_spans(tokenizer, turns: list[dict], full: str) -> list[tuple[int, int, int]] | str:
    """For each assistant turn (answer start, answer end, turn end) in characters of `full`; or, when the
    template is not prefix-stable, why (the first place where a prefix's rendering and the whole differ).
    The answer ends before the whitespace that separates turns; the last turn ends with the conversation."""
    closing = closing_text(tokenizer, turns, full)
    spans = []
    for index, turn in enumerate(turns):
        if turn["role"] != ASSISTANT:
            continue
        before = rendered(tokenizer, turns[:index], generation_prompt=True) if index else ""
        through = rendered(tokenizer, turns[: index + 1])
        through = through[: len(through) - len(closing)] if closing and through.endswith(closing) else through
        for prefix in (before, through):
            if not full.startswith(prefix):
                at = next(i for i, (a, b) in enumerate(zip(prefix, full, strict=False)) if a != b)
                return (
                    f"the chat template renders the conversation up to turn {index} as "
                    f"{prefix[max(0, at - 20) : at + 30]!r}, where the whole conversation has "
                    f"{full[max(0, at - 20) : at + 30]!r}"
                )
        if len(through) <= len(before):
            return f"the chat template writes nothing for the assistant turn {index}"
        spans.append((len(before), len(through.rstrip()), len(through)))
    if spans and turns[-1]["role"] == ASSISTANT:
        spans[-1] = (*spans[-1][:2], len(full))
    return spans


def on_tokens(
    span: tuple[int, int, int], full: str, offsets, ids: list[int], tokenizer
) -> tuple[int, int, int]:
    """Character span → token span: the tokens holding a character of the answer, less whitespace-only
    tokens at its ends (`trimmed`); the turn's end, as a count."""
    start, stop, end = span
    first = next((i for i, (_, e) in enumerate(offsets) if e > start), len(offsets))
    after_answer = next((i for i, (s, _) in enumerate(offsets) if s >= stop), len(offsets))
    through = next((i for i, (s, _) in enumerate(offsets) if s >= end), len(offsets))
    return (*trimmed(first, after_answer, ids, tokenizer, full, offsets, start), through)


def trimmed(
    start: int, stop: int, ids: list[int], tokenizer, full: str, offsets, first_char: int
) -> tuple[int, int]:
    """The one rule for boundary tokens, on both labelling paths. At the start, a token that begins before
    the answer's first character (`first_char`: where the generation prompt ends) is learnt only if it
    holds answer text that is not whitespace (one merging the header's newline with the answer's first
    word); the header's own tokens and a whitespace token straddling the boundary are not. A token wholly
    inside the answer is learnt, whitespace too: a code answer's leading newline, as hand labels, TRL and
    axolotl learn it (N4). At the end, a whitespace-only token is not learnt (ChatML's newline after
    <|im_end|>)."""
    while stop > start and not tokenizer.decode(ids[stop - 1 : stop]).strip():
        stop -= 1
    while (
        start < stop and offsets[start][0] < first_char and not full[first_char : offsets[start][1]].strip()
    ):
        start += 1
    return start, stop


def marked_spans(
    tokenizer, turns: list[dict], full: str, ids: list[int], offsets
) -> list[tuple[int, int, int]]:
    """Token spans of the template's own {% generation %} markers, cut by the one boundary rule (`trimmed`)
    at the end of each answer's generation prompt: markers that enclose the turn's header (TRL's DeepSeek
    training templates, a hand-marked ChatML) made the header learnt and the eval prompt's ids end before
    it (N2). An answer starts where its generation prompt stops agreeing with the whole rendering (all of
    it, or up to DeepSeek's `<think>` that the training rendering leaves out)."""
    encoded = bounded(
        lambda: tokenizer.apply_chat_template(
            turns, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        ),
        turns,
    )
    if list(encoded["input_ids"]) != list(ids):
        raise ChatTemplateError("the chat template renders differently with return_assistant_tokens_mask")
    prompts = iter(  # where each answer starts: as far as its generation prompt agrees with the whole
        len(os.path.commonprefix([rendered(tokenizer, turns[:at], generation_prompt=True), full]))
        for at, turn in enumerate(turns)
        if turn["role"] == ASSISTANT
    )
    mask, spans, index = encoded["assistant_masks"], [], 0
    while index < len(mask):
        if not mask[index]:
            index += 1
            continue
        start = index
        while index < len(mask) and mask[index]:
            index += 1
        first_char = next(prompts, 0)
        spans.append(
            (*trimmed(start, index, ids, text_tokenizer(tokenizer), full, offsets, first_char), index)
        )
    return spans


def end_of_turn_ids(tokenizer) -> list[int]:
    """The id closing an answer (ChatML's <|im_end|>), when it is a token of its own: generation stops
    there, as a chat endpoint stops. Found by encoding a two-turn conversation."""
    encoded = encode(tokenizer, [{"role": "user", "content": "?"}, {"role": ASSISTANT, "content": "!"}])
    answer = [label for label in encoded.labels if label != -100]
    tok = text_tokenizer(tokenizer)
    special = set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}))
    return [answer[-1]] if answer and answer[-1] in special else []
