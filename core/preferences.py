"""Preference pairs (`data.format: preference`, a `train.method: dpo` stage), read onto one shape.

    strings        {prompt: text, chosen: text, rejected: text}
    conversations  {prompt: [{role, content}, ...], chosen: [{role: assistant, content}],
                    rejected: [{role: assistant, content}]}          (TRL's conversational preference format)

A pair becomes (prompt turns, chosen text, rejected text): the prompt as the conversation before the answer
(a string prompt is one user turn), each answer the assistant turn that follows it. The trainer renders both
sides exactly as an SFT example (train/preference.py). Torch-free, standard library only: the launcher checks
every pair with `problems` before anything is queued, every mistake of a file at once.
"""

from __future__ import annotations

from core.names import CONVERSATIONS

SIDES = ("chosen", "rejected")
FIELDS = ("prompt", *SIDES)
SFT_FIELDS = ("input", "target", "instruction", "output", "messages", "conversations")


def is_conversation(value) -> bool:
    return isinstance(value, list)


def problems(row: dict) -> list[str]:
    """What is wrong with one pair, each said with what was expected."""
    missing = [name for name in FIELDS if name not in row]
    if missing:
        sft = [name for name in SFT_FIELDS if name in row]
        hint = (
            f"; this looks like an SFT example ({', '.join(sft)}): give it to an SFT stage "
            f"(data.format: fields or {', '.join(CONVERSATIONS)})"
            if sft
            else ""
        )
        return [f"no field {missing} in this pair: a pair is {{prompt, chosen, rejected}}{hint}"]
    found = prompt_problems(row["prompt"])
    answers = {}
    for side in SIDES:
        text, why = answer_text(row[side], side)
        if why:
            found.append(why)
        else:
            answers[side] = text
    if len(answers) == 2 and answers["chosen"].strip() == answers["rejected"].strip():
        found.append("chosen == rejected: a pair must prefer one answer over a different one")
    return found


def prompt_problems(prompt) -> list[str]:
    if isinstance(prompt, str):
        return [] if prompt.strip() else ["prompt is empty"]
    if not isinstance(prompt, list):
        return [f"prompt must be text or a list of turns, not {type(prompt).__name__}"]
    if not prompt:
        return ["prompt is an empty list: it needs at least a user turn"]
    found = []
    for index, turn in enumerate(prompt):
        if not (isinstance(turn, dict) and isinstance(turn.get("role"), str)):
            found.append(f"prompt[{index}] must be an object {{role, content}}")
        elif not isinstance(turn.get("content"), str):
            found.append(f"prompt[{index}].content is not text ({type(turn.get('content')).__name__})")
        elif turn["role"] not in ("system", "user", "assistant"):
            found.append(
                f"prompt[{index}]: unknown role {turn['role']!r}; expected system, user or assistant"
            )
    return found


def answer_text(value, side: str) -> tuple[str, str | None]:
    """(the answer's text, None), or ("", what is wrong)."""
    if isinstance(value, list):
        if len(value) != 1 or not isinstance(value[0], dict) or value[0].get("role") != "assistant":
            return "", f"{side} must be one assistant turn [{{role: assistant, content}}] or text"
        value = value[0].get("content")
    if not isinstance(value, str):
        return "", f"{side} is not text ({type(value).__name__})"
    if not value.strip():
        return "", f"{side} is empty: an empty answer teaches nothing"
    return value, None


def pair(row: dict) -> tuple[list[dict], str, str]:
    """(prompt turns, chosen, rejected) of a pair whose `problems` are none."""
    prompt = row["prompt"]
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return turns, answer_text(row["chosen"], "chosen")[0], answer_text(row["rejected"], "rejected")[0]


def chars(row: dict) -> int:
    """Characters of text in a pair (the estimates' measure of its size): the prompt once, both answers."""
    turns, chosen, rejected = pair(row)
    return sum(len(turn["content"]) for turn in turns) + len(chosen) + len(rejected)
