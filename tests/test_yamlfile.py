"""YAML reading on the login node: one parse per file per command, line numbers kept, no shared state."""

from __future__ import annotations

import os

import pytest

from slurm import yamlfile
from slurm.yamlfile import YamlProblem, load_chain, read_yaml


def test_a_shared_fragment_is_parsed_once_and_each_reader_gets_its_own_copy(tmp_path, monkeypatch):
    fragment = tmp_path / "_shared.yaml"
    fragment.write_text("train:\n  epochs: 2\n  batch_size: 8\n")
    parses = []
    real_parse = yamlfile._parse
    monkeypatch.setattr(yamlfile, "_parse", lambda path: parses.append(path) or real_parse(path))
    first, second = read_yaml(fragment), read_yaml(fragment)
    assert len(parses) == 1
    first.data["train"]["epochs"] = 99  # what merging an experiment into it could do
    assert second.data["train"]["epochs"] == 2 and read_yaml(fragment).data["train"]["epochs"] == 2
    assert first.lines[("train", "batch_size")] == 3


def test_an_edited_file_is_read_again(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("a: 1\n")
    assert read_yaml(path).data == {"a": 1}
    path.write_text("a: 22\n")
    os.utime(path, ns=(1, 1))  # even if the clock did not move, size or mtime differ
    assert read_yaml(path).data == {"a": 22}


def test_inherits_chain_does_not_consume_the_cached_inherits_key(tmp_path):
    (tmp_path / "base.yaml").write_text("train: {epochs: 3}\n")
    (tmp_path / "_mid.yaml").write_text("inherits: base.yaml\ntrain: {batch_size: 4}\n")
    for name in ("one", "two"):  # the second experiment must still see _mid.yaml's parent
        (tmp_path / f"{name}.yaml").write_text(f"name: {name}\ninherits: _mid.yaml\n")
        merged, chain = load_chain(tmp_path / f"{name}.yaml", stop=tmp_path)
        assert merged["train"] == {"epochs": 3, "batch_size": 4}
        assert [f.path.name for f in chain] == [f"{name}.yaml", "_mid.yaml", "base.yaml"]


def test_bad_yaml_points_at_the_line_where_the_mapping_started(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\ntrain: {epochs: 2\nbatch_size: 4\n")
    with pytest.raises(YamlProblem) as caught:
        read_yaml(path)
    assert caught.value.problem.line == 2 and "not valid YAML" in caught.value.problem.message
