"""User mistakes, collected and shown together, each pointing at a file, a line and a key."""

from __future__ import annotations

import difflib
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


def short_path(path: str) -> str:
    """Paths under the current folder are shown relative to it, as the user typed them."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return path


def did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""
