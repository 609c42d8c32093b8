"""An eval job's predictions, kept as they are made: a requeued or killed eval goes on from them.

Each generated batch's rows are appended to `predictions.partial.jsonl`, flushed and synced before the next
batch starts, so a kill at any moment leaves whole rows and at most one torn last line. The file opens with
a header holding the fingerprint of what the predictions depend on (eval/job.py `fingerprint`: model,
adapter files, data, decoding settings, device and precision). The next run of the same job cuts the torn
tail, keeps the rows and generates only the batches not all there; a file of another job starts over. Once
every example has its prediction, `predictions.jsonl` is written whole, in id order (as an uninterrupted
run writes it), and the partial file is deleted.

Torch-free and standard library only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from core.files import open_append, write_atomic
from core.rundir import RunDir


def rows(
    ids: list[int],
    texts: list[str],
    prompts: list[str],
    references: list[str],
    images: list[str] | None = None,
) -> list[dict]:
    """predictions.jsonl's row of each example `ids[k]`, whose prediction is `texts[k]`."""
    made = []
    for i, text in zip(ids, texts, strict=True):
        row = {"id": i, "input": prompts[i], "reference": references[i], "prediction": text}
        if images:
            row["image"] = images[i]
        made.append(row)
    return made


def write_final(folder: Path, made: list[dict], root: Path | None = None) -> None:
    """predictions.jsonl, in id order (with `root`, reached from it without following a link)."""
    ordered = sorted(made, key=lambda row: row["id"])
    text = "".join(json.dumps(row) + "\n" for row in ordered)
    write_atomic(RunDir.of(folder).predictions, text, root=root)


class PartialPredictions:
    """`predictions.partial.jsonl` of one eval job: `resume()` once, then `append()` per batch."""

    def __init__(self, folder: Path, fingerprint: str, root: Path | None = None):
        """`root`: what its writes are reached from without following a link (core/below.py): the run
        root for an eval in the plan's layout, so a linked experiment or eval folder is never written
        through; the folder itself otherwise (a link at the file is never followed either way)."""
        self.path = RunDir.of(folder).partial_predictions
        self.fingerprint = fingerprint
        self.root = root

    def resume(self, prompts: list[str]) -> dict[int, dict]:
        """The rows an earlier run of this same job wrote, by id; the file is left holding exactly them.
        Rows of another job (other adapter, data or settings) are dropped and the file starts over."""
        kept = self._read(prompts)
        if kept is None:
            write_atomic(self.path, json.dumps({"fingerprint": self.fingerprint}) + "\n", root=self.root)
            return {}
        return kept

    def append(self, made: list[dict]) -> None:
        """One batch's rows, on disk before this returns: a kill after it cannot lose them."""
        with open_append(self.path, root=self.root) as fh:
            fh.write("".join(json.dumps(row) + "\n" for row in made))
            fh.flush()
            os.fsync(fh.fileno())

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)

    def _read(self, prompts: list[str]) -> dict[int, dict] | None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        whole = data[: data.rfind(b"\n") + 1]  # a kill mid-append leaves one torn last line
        lines = whole.decode("utf-8", errors="replace").splitlines()
        if not lines or _parsed(lines[0]) != {"fingerprint": self.fingerprint}:
            return None
        if len(whole) < len(data):  # cut it off, or the next append would be glued to it
            with open(self.path, "r+b") as fh:
                fh.truncate(len(whole))
                os.fsync(fh.fileno())
        kept = {}
        for row in map(_parsed, lines[1:]):
            i = row.get("id") if isinstance(row, dict) else None
            if isinstance(i, int) and 0 <= i < len(prompts) and row.get("input") == prompts[i]:
                kept[i] = row
        return kept


def _parsed(line: str):
    try:
        return json.loads(line)
    except ValueError:
        return None
