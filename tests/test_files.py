"""The one writer of every file under runs/: whole or not at all."""

from __future__ import annotations

import pytest

from core.files import read_json, write_atomic, write_json_atomic


def test_replaces_the_file_and_leaves_no_temporary_behind(tmp_path):
    target = tmp_path / "deep" / "progress.json"
    write_json_atomic(target, {"step": 1})
    write_json_atomic(target, {"step": 2})
    assert read_json(target) == {"step": 2}
    assert [p.name for p in target.parent.iterdir()] == ["progress.json"]


def test_a_write_that_fails_midway_keeps_the_old_file(tmp_path):
    target = tmp_path / "results.json"
    write_atomic(target, '{"bleu": 0.5}\n')
    with pytest.raises(UnicodeEncodeError):  # fails while writing, after the temporary file was opened
        write_atomic(target, '{"bleu": "\udc80"}')
    assert read_json(target) == {"bleu": 0.5}
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_read_json_gives_the_default_for_a_missing_or_torn_file(tmp_path):
    torn = tmp_path / "summary.json"
    torn.write_text('{"global_step": 1')
    assert read_json(torn, {}) == {} and read_json(tmp_path / "absent.json") is None
