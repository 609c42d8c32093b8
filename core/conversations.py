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
        return [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in turns]
    return [{"role": t["role"], "content": t["content"]} for t in turns]


def last_answer(turns: list[dict]) -> int:
    """Index of the last assistant turn: an eval's reference; the turns before it are its prompt."""
    return max(i for i, turn in enumerate(turns) if turn["role"] == "assistant")


def problems(row: dict, spec: DataSpec) -> list[str]:
    """What is wrong with one example of a conversation format, each said with what was expected."""
    if spec.format == PREFERENCE:
        return preferences.problems(row)
    if spec.format == "alpaca":
        return alpaca_problems(row)
    field = spec.conversation_field
    turns = row.get(field)
    if not isinstance(turns, list):
        return [f"{field} must be a list of turns, not {type(turns).__name__}"]
    if not turns:
        return [f"{field} is empty: a conversation needs a user turn and an assistant turn"]
    role_key, text_key = ("from", "value") if spec.format == "sharegpt" else ("role", "content")
    roles = SHAREGPT_ROLES if spec.format == "sharegpt" else {role: role for role in ROLES}
    found, seen = [], set()
    for index, turn in enumerate(turns):
        where = f"{field}[{index}]"
        if not isinstance(turn, dict):
            found.append(f"{where} must be an object {{{role_key}, {text_key}}}, not {type(turn).__name__}")
            continue
        if missing := [key for key in (role_key, text_key) if key not in turn]:
            found.append(f"{where} has no {' or '.join(missing)} (it has {sorted(turn)})")
            continue
        role = turn[role_key] if isinstance(turn[role_key], str) else repr(turn[role_key])
        if role not in roles:
            hint = did_you_mean(str(role), roles)
            found.append(f"{where}: unknown {role_key} {role!r}{hint}; expected one of {', '.join(roles)}")
        seen.add(roles.get(role))
        if not isinstance(turn[text_key], str):
            found.append(
                f"{where}.{text_key} is not text ({type(turn[text_key]).__name__}); an image goes in "
                "data.image_field, a path per example"
            )
    if not found and "assistant" not in seen:
        found.append(f"{field} has no assistant turn: there is no answer to learn or score")
    return found


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
