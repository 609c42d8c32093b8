"""User mistakes, collected and shown together, each pointing at a file, a line and a key."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Problem:
    file: str
    key: str
    message: str
    line: int | None = None
    warning: bool = False

    def __str__(self) -> str:
        where = f"{short_path(self.file)}:{self.line}" if self.line else short_path(self.file)
        key = f" {self.key}:" if self.key else ""
        return f"{where}:{key} {self.message}"


class ConfigError(Exception):
    """Raised with every problem found; the CLI prints them and exits 2, never a traceback."""

    def __init__(self, problems: list[Problem]):
        unique = list(dict.fromkeys(problems))  # a shared fragment's mistake is reported once, not per file
        self.problems = [p for p in unique if not p.warning]
        self.warnings = [p for p in unique if p.warning]
        super().__init__("\n".join(str(p) for p in self.problems))


class LaunchError(Exception):
    """A launch stopped midway; the message says what it left queued or running. Exit code 1."""

    exit_code = 1


class Interrupted(LaunchError):
    """Ctrl-C during a launch; the message says what it left queued and what it stopped."""

    exit_code = 130


def short_path(path: str) -> str:
    """Paths under the current folder are shown relative to it, as the user typed them."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return path


def did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


# How pydantic names the member of a union (`int | Literal['auto']`) a failed check belongs to, at the end
# of an error's place: `literal['auto']`, `function-after[...]`, `int`, `list[str]`, a model's name.
UNION_MEMBER = re.compile(r"(literal|function-\w+|list|dict|tuple|set)\[.*|int|float|str|bool|none|[A-Z]\w*")


def one_per_value(errors: list[dict]) -> list[dict]:
    """pydantic's errors with a union's members folded into one error per value: `micro_batch: eight` is one
    problem ("should be 'auto' or a valid integer"), not one per type it could have been. A member's own
    message (a value_error, e.g. "true is a yes/no") says more than the others' "should be", and wins."""
    folded: dict[tuple, list[dict]] = {}
    for error in errors:
        loc = tuple(error["loc"])
        while loc and isinstance(loc[-1], str) and UNION_MEMBER.fullmatch(loc[-1]):
            loc = loc[:-1]
        folded.setdefault(loc, []).append({**error, "loc": loc})
    return [merged(group) for group in folded.values()]


def merged(group: list[dict]) -> dict:
    if len(group) == 1:
        return group[0]
    own = [error for error in group if error["type"] in ("value_error", "assertion_error")]
    if own:
        return own[0]
    wants = [error["msg"].removeprefix("Input should be ") for error in group]
    return {**group[-1], "msg": "Input should be " + " or ".join(dict.fromkeys(wants))}
