"""Reading example files and checking their fields, with the standard library only.

Both the launcher (before anything is queued, on the login node) and the trainer (on the node) use this,
so a malformed line is reported the same way, with its file and line, wherever it is found.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from train.config import DataSpec, placeholders

TABLE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


class ExampleError(ValueError):
    """A mistake in a data file, with the file and (where there is one) the line."""

    def __init__(self, path: Path | str, message: str, line: int | None = None):
        self.path, self.message, self.line = str(path), message, line
        super().__init__(f"{path}:{line}: {message}" if line else f"{path}: {message}")


@dataclass(frozen=True)
class TextSize:
    """How much text a data file holds: what the launcher's time estimates start from (slurm/estimate.py)."""

    examples: int
    chars: int  # prompt (template filled in) + target, summed over the examples


def needed_fields(spec: DataSpec) -> list[str]:
    inputs = placeholders(spec.prompt_template) if spec.prompt_template else [spec.input_field]
    images = [spec.image_field] if spec.image_field else []
    return list(dict.fromkeys([*inputs, spec.target_field, *images]))


def image_path(row: dict, spec: DataSpec, data_file: Path | str) -> Path:
    """An example's image: its path as written, relative to the data file that names it."""
    return Path(data_file).parent / str(row[spec.image_field])


def read_jsonl(path: Path) -> list[dict]:
    return [row for _, row in numbered_jsonl(path)]


def numbered_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, example) pairs; blank lines are skipped."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ExampleError(path, f"not valid JSON ({exc.args[0]})", number) from None
            if not isinstance(row, dict):
                raise ExampleError(path, "each line must be a JSON object {...}", number)
            rows.append((number, row))
    return rows


def numbered_csv(path: Path) -> list[tuple[int, dict]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return [(number, row) for number, row in enumerate(csv.DictReader(fh), 2)]  # line 1 is the header


def prompt_of(row: dict, spec: DataSpec) -> str:
    if spec.prompt_template is None:
        return str(row[spec.input_field])
    return spec.prompt_template.format(**row)


def text_size(rows: list[dict], spec: DataSpec) -> TextSize:
    chars = sum(len(prompt_of(row, spec)) + len(str(row[spec.target_field])) for row in rows)
    return TextSize(len(rows), chars)


def check_rows(rows: list[tuple[int, dict]], spec: DataSpec, path: Path) -> None:
    """Every example has every field the prompt template and the target need."""
    if not rows:
        raise ExampleError(path, "has no examples (the file is empty)")
    needed = needed_fields(spec)
    for number, row in rows:
        missing = [field for field in needed if field not in row or row[field] is None]
        if missing:
            raise ExampleError(
                f"{path}:{number}", f"no field {missing} in this example (it has {sorted(row)})"
            )
        if spec.image_field and not image_path(row, spec, path).is_file():
            raise ExampleError(
                f"{path}:{number}",
                f"image file not found: {image_path(row, spec, path)} (data.image_field "
                f"{spec.image_field!r} = {row[spec.image_field]!r}, a path relative to the data file)",
            )


def check_file(path: Path, spec: DataSpec) -> TextSize:
    """Raise ExampleError for the first problem of a local JSONL/CSV/Parquet file; else its size, measured
    in the same read (the launcher reads each data file once per command)."""
    suffix = path.suffix.lower()
    if suffix not in TABLE_SUFFIXES:
        raise ExampleError(path, f"unknown file type '{suffix}' (use .jsonl, .csv or .parquet)")
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        columns = set(pq.read_schema(path).names)
        missing = [f for f in needed_fields(spec) if f not in columns]
        if missing:
            raise ExampleError(path, f"has no column {missing} (it has {sorted(columns)})")
        rows = list(enumerate(pq.read_table(path, columns=needed_fields(spec)).to_pylist(), 1))
    else:
        rows = numbered_csv(path) if suffix == ".csv" else numbered_jsonl(path)
    check_rows(rows, spec, path)
    return text_size([row for _, row in rows], spec)
