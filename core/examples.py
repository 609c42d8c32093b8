"""Reading example files and checking their fields, with the standard library only.

Both the launcher (before anything is queued, on the login node) and the trainer (on the node) use this,
so a malformed line is reported the same way, with its file and line, wherever it is found.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from core import conversations
from core.config import DataSpec, placeholders

TABLE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


class ExampleError(ValueError):
    """A mistake in a data file, with the file and (where there is one) the line."""

    def __init__(self, path: Path | str, message: str, line: int | None = None):
        self.path, self.message, self.line = str(path), message, line
        super().__init__(f"{path}:{line}: {message}" if line else f"{path}: {message}")

    @property
    def errors(self) -> list[ExampleError]:
        return [self]


class ExampleErrors(ExampleError):
    """Every malformed example of a file at once (conversations: each turn's mistakes, line by line)."""

    def __init__(self, errors: list[ExampleError]):
        first = errors[0]
        super().__init__(first.path, first.message, first.line)
        self.args = ("\n".join(str(e) for e in errors),)
        self._errors = errors

    @property
    def errors(self) -> list[ExampleError]:
        return self._errors


# The most malformed examples one refusal lists; the count of the rest follows.
MOST_LISTED = 20


@dataclass(frozen=True)
class TextSize:
    """How much text a data file holds: what the launcher's time estimates start from (slurm/planning/estimate.py)."""

    examples: int
    chars: int  # prompt (template filled in) + target, summed over the examples
    # Assistant turns of each conversation in file order (messages, sharegpt): the answers an eval with
    # `eval.turns: all` generates for it (conversations.scored_turns); () for data of one answer an example.
    answers: tuple[int, ...] = ()
    # Preference pairs: the line of the first whose prompt is a conversation (a list of turns), rendered with
    # the model's chat template when data.chat_template names none; None: every prompt is text.
    conversation_line: int | None = None
    # Preference pairs: the line of the first whose prompt is text; None: every prompt is a conversation.
    text_line: int | None = None


def needed_fields(spec: DataSpec) -> list[str]:
    if spec.format == "preference":  # a missing side is one of a pair's problems, listed with the others
        return []
    if spec.format == "alpaca":
        texts = list(conversations.ALPACA_FIELDS)
    elif spec.format != "fields":
        texts = [spec.conversation_field]
    else:
        inputs = placeholders(spec.prompt_template) if spec.prompt_template else [spec.input_field]
        texts = [*inputs, spec.target_field]
    images = [spec.image_field] if spec.image_field else []
    return list(dict.fromkeys([*texts, *images]))


def image_path(row: dict, spec: DataSpec, data_file: Path | str) -> Path:
    """An example's image: its path as written, relative to the data file that names it."""
    return Path(data_file).parent / str(row[spec.image_field])


def read_jsonl(path: Path) -> list[dict]:
    return [row for _, row in numbered_jsonl(path)]


def numbered_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, example) pairs, one line read at a time; blank lines are skipped."""
    for number, line in numbered_lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ExampleError(path, f"not valid JSON ({exc.args[0]})", number) from None
        except RecursionError:
            raise ExampleError(path, "not valid JSON (nested too deeply)", number) from None
        if not isinstance(row, dict):
            raise ExampleError(path, "each line must be a JSON object {...}", number)
        yield number, row


def numbered_csv(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, example) pairs, one at a time; the line is where the example ends (a quoted field may
    span lines)."""
    csv.field_size_limit(max(csv.field_size_limit(), MAX_EXAMPLE_BYTES))  # csv's own is 128 KB a field
    reader = csv.reader(line for _, line in numbered_lines(path))
    try:
        header = next(reader, [])
        for values in filter(None, reader):  # blank lines are no examples
            if len(values) != len(header):
                raise ExampleError(
                    path,
                    f"this line has {len(values)} values for the header's {len(header)} columns",
                    reader.line_num,
                )
            yield reader.line_num, dict(zip(header, values, strict=True))
    except csv.Error as exc:
        why = f"not valid CSV ({exc})"
        if "field limit" in str(exc):
            why = f"a field longer than {MAX_EXAMPLE_BYTES:,} characters, the most an example may have"
        raise ExampleError(path, why, reader.line_num) from None


# The longest line (one example of a .jsonl, a line of a .csv) validation accepts: far beyond any
# max_length, and what --preflight and the trainer would otherwise tokenize whole, in memory.
MAX_EXAMPLE_BYTES = 1_000_000


def numbered_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line, read a bounded line at a time: a line longer than
    MAX_EXAMPLE_BYTES or not UTF-8 is an ExampleError at its line, before it is read whole."""
    with open(path, "rb") as fh:
        for number, raw in enumerate(iter(lambda: fh.readline(MAX_EXAMPLE_BYTES + 1), b""), 1):
            if len(raw) > MAX_EXAMPLE_BYTES:
                raise ExampleError(
                    path,
                    f"this line is longer than {MAX_EXAMPLE_BYTES:,} bytes, the most an example may have "
                    "(it would be tokenized whole, in memory, and cut at max_length anyway): shorten it",
                    number,
                )
            try:
                # A UTF-8 BOM (Excel, Notepad) opens the file, not its first column's name.
                yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise ExampleError(
                    path, f"not UTF-8 text (byte {exc.start + 1} of the line): save the file as UTF-8", number
                ) from None


def unreadable_example(
    row: dict, needed: list[str], spec: DataSpec, where: str, path: Path
) -> ExampleError | None:
    """What makes one example unusable whatever its format: a field the prompt or target needs is missing
    or null, it is too big, or its image file is not there; None when it is usable. `where`: file:line."""
    missing = [field for field in needed if field not in row]
    if missing:
        other = conversations.other_format(row, spec)  # ShareGPT's `conversations` as messages, or back
        pair = "chosen" in row and "rejected" in row
        hint = (
            "; this looks like a preference pair: give it to a DPO stage (train.method: dpo, "
            "data.format: preference)"
            if pair
            else ""
        )
        return ExampleError(
            where,
            other or f"no field {missing} in this example (it has {sorted(row)}){hint}",
        )
    if nulls := [field for field in needed if row[field] is None]:
        return ExampleError(
            where,
            f"field {nulls} is null: null is not allowed here (the prompt or target needs a value)",
        )
    if (size := sum(len(str(row[field]).encode()) for field in needed)) > MAX_EXAMPLE_BYTES:
        return ExampleError(
            where,
            f"this example holds {size:,} bytes, more than the {MAX_EXAMPLE_BYTES:,} an example may have",
        )
    if spec.image_field and not image_path(row, spec, path).is_file():
        return ExampleError(
            where,
            f"image file not found: {image_path(row, spec, path)} (data.image_field "
            f"{spec.image_field!r} = {row[spec.image_field]!r}, a path relative to the data file)",
        )
    return None


def check_rows(rows: Iterable[tuple[int, dict]], spec: DataSpec, path: Path) -> TextSize:
    """Every example has every field the prompt template and the target need; the file's size, measured in
    the same pass. One example at a time: a file of millions is checked in the memory of one (M3: a 172 MB
    pairs file held whole took 2.0 GB on the login node)."""
    needed = needed_fields(spec)
    listed: list[ExampleError] = []
    unlisted, count, chars, answers, conversation_line, text_line = 0, 0, 0, [], None, None
    for number, row in rows:
        if (refused := unreadable_example(row, needed, spec, f"{path}:{number}", path)) is not None:
            raise refused
        count += 1
        wrong = conversations.problems(row, spec) if spec.format != "fields" else []
        if wrong:
            kept = wrong[: max(0, MOST_LISTED + 1 - len(listed))]
            listed += [ExampleError(path, why, number) for why in kept]
            unlisted += len(wrong) - len(kept)
            continue
        if listed:
            continue  # refused below: its size is no longer needed
        chars += conversations.chars(row, spec)
        if spec.format in ("messages", "sharegpt"):
            answers.append(len(conversations.scored_turns(conversations.conversation(row, spec), "all")))
        if spec.format == "preference":
            if conversation_line is None and isinstance(row.get("prompt"), list):
                conversation_line = number
            if text_line is None and isinstance(row.get("prompt"), str):
                text_line = number
    if not count:
        raise ExampleError(path, "has no examples (the file is empty)")
    if listed:
        shown = listed[:MOST_LISTED]
        if len(listed) > MOST_LISTED or unlisted:
            more = f"and {len(listed) - MOST_LISTED + unlisted} more mistakes in this file"
            shown.append(ExampleError(path, more, listed[min(MOST_LISTED, len(listed) - 1)].line))
        raise ExampleErrors(shown)
    return TextSize(count, chars, tuple(answers), conversation_line, text_line)


def check_file(path: Path, spec: DataSpec) -> TextSize:
    """Raise ExampleError for the first problem of a local JSONL/CSV/Parquet file; else its size, measured
    in the same read (the launcher reads each data file once per command)."""
    suffix = path.suffix.lower()
    if suffix not in TABLE_SUFFIXES:
        raise ExampleError(
            path, f"unknown file type '{suffix}' (use .jsonl, .json (JSON Lines), .csv or .parquet)"
        )
    if path.exists() and not path.is_file():  # a FIFO would block the launch at its open
        raise ExampleError(path, "is not a regular file (a FIFO, a socket, a device or a folder)")
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        columns = set(pq.read_schema(path).names)
        missing = [f for f in needed_fields(spec) if f not in columns]
        if missing:
            raise ExampleError(path, f"has no column {missing} (it has {sorted(columns)})")
        optional = ["input"] if spec.format == "alpaca" and "input" in columns else []
        rows = enumerate(pq.read_table(path, columns=needed_fields(spec) + optional).to_pylist(), 1)
    else:
        rows = numbered_csv(path) if suffix == ".csv" else numbered_jsonl(path)
    return check_rows(rows, spec, path)
