"""Examples as users have them (`data.format`), read onto one shape: a conversation, a list of turns
`{"role": system | user | assistant, "content": text}`, which the model's chat template renders (train/chat.py).

    fields     {input_field or prompt_template's fields, target_field}  → user: prompt, assistant: target
    messages   {messages: [{role, content}, ...]}                         (OpenAI, TRL)
    sharegpt   {conversations: [{from: human | gpt | system, value}, ...]} (roles mapped)
    alpaca     {instruction, input (optional), output}                      → user: instruction + input,
                                                                              assistant: output

A seq2seq model has no chat template: it reads `fields`, or an alpaca example as its prompt (instruction and
input) and target (output). Torch-free, standard library only: the launcher checks every example with
`problems` before anything is queued, and the trainer reads them with `conversation`.
"""

from __future__ import annotations

from core import preferences
from core.config import DataSpec
from core.names import CONVERSATIONS, PREFERENCE
from core.problems import did_you_mean

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}
ALPACA_FIELDS = ("instruction", "output")  # and `input`, which may be missing or empty


def templated(spec: DataSpec, kind: str) -> bool:
    """Is an example rendered with the model's chat template? Conversations are, but for seq2seq; preference
    pairs when data.chat_template names one (else a string pair is rendered as `fields`, a conversation
    pair with the model's own template)."""
    chat_pairs = spec.format == PREFERENCE and spec.chat_template is not None
    return (spec.format in CONVERSATIONS or chat_pairs) and kind != "seq2seq"


def no_template_message(model: str, data_format: str) -> str:
    """Why a model without a chat template cannot read conversations, and the fixes."""
    return (
        f"{data_format} examples are rendered with the model's chat template, and {model} has none (a base "
        "model): set data.chat_template (chatml, llama-3, or inline Jinja; its markers need model.added_tokens "
        "if the vocabulary lacks them), or use format: fields"
    )


def prompt_of(row: dict, spec: DataSpec) -> str:
    """The prompt of a `fields` example (its template filled in) or of an alpaca one."""
    if spec.format == "alpaca":
        given = str(row.get("input") or "").strip()
        return f"{row['instruction']}\n\n{given}" if given else str(row["instruction"])
    if spec.prompt_template is None:
        return str(row[spec.input_field])
    return spec.prompt_template.format(**row)


def target_of(row: dict, spec: DataSpec) -> str:
    return str(row["output"] if spec.format == "alpaca" else row[spec.target_field])


def conversation(row: dict, spec: DataSpec) -> list[dict]:
    """The example as turns; `problems(row, spec)` must be empty."""
    if spec.format in ("fields", "alpaca"):
        return [
            {"role": "user", "content": prompt_of(row, spec)},
            {"role": "assistant", "content": target_of(row, spec)},
        ]
    turns = row[spec.conversation_field]
    if spec.format == "sharegpt":
        return [{"role": SHAREGPT_ROLES[t["from"]], "content": text_of(t["value"])} for t in turns]
    return [{"role": t["role"], "content": text_of(t["content"])} for t in turns]


def text_of(content: str | list) -> str:
    """A turn's text: a string, or OpenAI's list of parts `[{"type": "text", "text": ...}, ...]` joined."""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)


def parts_problem(content: list) -> str | None:
    """Why a list content is not OpenAI text parts, or None when it is."""
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind in ("image", "image_url", "input_image"):
                return "an image part: an image goes in data.image_field, a path per example"
            return (
                f"a list whose part {kind!r} is not a text part: a list content is read as OpenAI's text "
                'parts, [{"type": "text", "text": "..."}, ...]'
            )
    return None


# Characters that show nothing: an answer of only these (and whitespace) is empty.
INVISIBLE = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff\u00ad"))


def is_blank(text: str) -> bool:
    return not text.translate(INVISIBLE).strip()


def last_answer(turns: list[dict]) -> int:
    """Index of the last assistant turn: an eval's reference; the turns before it are its prompt."""
    return max(i for i, turn in enumerate(turns) if turn["role"] == "assistant")


def scored_turns(whole: list[dict], turns: str) -> list[list[dict]]:
    """The conversation cut after each assistant turn the eval scores (eval.turns): its last only, or every
    one. One answer is generated per cut: the eval's prompts (train/data.py) and the estimate's count of
    them (slurm/planning/estimate.py) both come from here."""
    if turns == "last":
        return [whole]
    return [whole[: i + 1] for i, turn in enumerate(whole) if turn["role"] == "assistant"]


def problems(row: dict, spec: DataSpec) -> list[str]:
    """What is wrong with one example of a conversation format, each said with what was expected."""
    if spec.format == PREFERENCE:
        return preferences.problems(row)
    if spec.format == "alpaca":
        return alpaca_problems(row)
    field = spec.conversation_field
    turns = row.get(field)
    if turns is None and (other := other_format(row, spec)):
        return [other]
    if not isinstance(turns, list):
        return [f"{field} must be a list of turns, not {type(turns).__name__}"]
    if not turns:
        return [f"{field} is empty: a conversation needs a user turn and an assistant turn"]
    role_key, text_key = ("from", "value") if spec.format == "sharegpt" else ("role", "content")
    roles = SHAREGPT_ROLES if spec.format == "sharegpt" else {role: role for role in ROLES}
    found, seen = [], []
    for index, turn in enumerate(turns):
        where = f"{field}[{index}]"
        if not isinstance(turn, dict):
            found.append(f"{where} must be an object {{{role_key}, {text_key}}}, not {type(turn).__name__}")
            continue
        if missing := [key for key in (role_key, text_key) if key not in turn]:
            found.append(
                f"{where} has no {' or '.join(missing)} (it has {sorted(turn)}){turn_keys_hint(turn, spec)}"
            )
            continue
        role = turn[role_key] if isinstance(turn[role_key], str) else repr(turn[role_key])
        if role not in roles:
            hint = did_you_mean(str(role), roles)
            found.append(f"{where}: unknown {role_key} {role!r}{hint}; expected one of {', '.join(roles)}")
        seen.append(roles.get(role))
        found += content_problems(where, text_key, turn[text_key], roles.get(role))
    if not found and "assistant" not in seen:
        found.append(f"{field} has no assistant turn: there is no answer to learn or score")
    elif not found and seen[-1] == "user":
        found.append(
            f"{field} ends on a user turn: its last answer would be scored as the reply to an earlier question, "
            "and the question after it is learnt from nothing; remove the last turn or add its answer"
        )
    return found


def content_problems(where: str, text_key: str, content, role: str | None) -> list[str]:
    if isinstance(content, list) and (why := parts_problem(content)) is None:
        content = text_of(content)
    elif isinstance(content, list):
        return [f"{where}.{text_key} is {why}"]
    if not isinstance(content, str):
        return [
            f"{where}.{text_key} is not text ({type(content).__name__}); a text, or OpenAI's text parts "
            '[{"type": "text", "text": "..."}]; an image goes in data.image_field, a path per example'
        ]
    if role == "assistant" and is_blank(content):
        return [
            f"{where}.{text_key} is empty (or only whitespace or invisible characters): no answer to learn"
        ]
    return []


FIELDS_OF = {"messages": ("messages", "role", "content"), "sharegpt": ("conversations", "from", "value")}


def other_format(row: dict, spec: DataSpec) -> str | None:
    """When the row's list is the other conversation format's (ShareGPT's `conversations` given as
    messages, or the reverse): which format its fields are."""
    other = "sharegpt" if spec.format == "messages" else "messages"
    field = FIELDS_OF[other][0]
    if spec.format in FIELDS_OF and isinstance(row.get(field), list):
        return (
            f"no field {spec.conversation_field!r}; the row has {field!r}, which is {other} format's "
            f"({FIELDS_OF[other][1]}/{FIELDS_OF[other][2]} turns): set data.format: {other}"
        )
    return None


def turn_keys_hint(turn: dict, spec: DataSpec) -> str:
    other = "sharegpt" if spec.format == "messages" else "messages"
    _, role_key, text_key = FIELDS_OF[other]
    if spec.format in FIELDS_OF and role_key in turn and text_key in turn:
        return f": {role_key}/{text_key} are the {other} format's turn fields, set data.format: {other}"
    return ""


def alpaca_problems(row: dict) -> list[str]:
    found = [
        f"no field {name!r} (alpaca: instruction, input, output)" for name in ALPACA_FIELDS if name not in row
    ]
    for name in ("instruction", "input", "output"):
        value = row.get(name)
        if value is not None and not isinstance(value, str):
            found.append(f"{name} is not text ({type(value).__name__})")
        elif name != "input" and name in row and not str(value or "").strip():
            found.append(f"{name} is empty")
    return found


def chars(row: dict, spec: DataSpec) -> int:
    """Characters of text in an example (the estimates' measure of its size)."""
    if spec.format == PREFERENCE:
        return preferences.chars(row)
    if spec.format in ("fields", "alpaca"):
        return len(prompt_of(row, spec)) + len(target_of(row, spec))
    return sum(len(turn["content"]) for turn in conversation(row, spec))
