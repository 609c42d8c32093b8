"""Issue 38, rule 9: one experiment is not held hostage by a sibling. `--exp NAME` is judged on what it
needs (its file, what that inherits, what it waits on with `after:`); the others' problems are warnings.
`--all` stays all-or-nothing. The real loader through `launch.py --dry-run` (no cluster needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

import launch
from tests.helpers import experiment_folder


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """a (good), b (its eval file is malformed JSON), c (waits on b), d (inherits a broken fragment)."""
    configs = experiment_folder(tmp_path)
    good = (configs / "a.yaml").read_text()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "sql": \n')
    (configs / "b.yaml").write_text(
        good.replace("name: a", "name: b").replace("eval: " + str(tmp_path / "train.jsonl"), f"eval: {bad}")
    )
    (configs / "c.yaml").write_text(good.replace("name: a", "name: c\nafter: b"))
    (configs / "_shared.yaml").write_text("train: {epochs: -1}\n")
    (configs / "d.yaml").write_text(
        good.replace("name: a", "name: d\ninherits: _shared.yaml").replace(
            "train: {epochs: 1, learning_rate: 2.0e-4, eval_every_epochs: 1}\n", ""
        )
    )
    return configs


def dry_run(configs: Path, capsys, *selection: str) -> tuple[int, str]:
    code = launch.main([*selection, "--config-dir", str(configs), "--dry-run", "--backend", "local"])
    return code, capsys.readouterr().err


def test_a_named_experiment_is_not_refused_for_a_siblings_malformed_eval_file(folder, capsys):
    """Before: `--dry-run --exp chatx` was refused for another experiment's malformed eval file."""
    code, err = dry_run(folder, capsys, "--exp", "a")
    assert code == 0, err
    assert (
        "warning: " in err and "bad.jsonl:1: not valid JSON" in err and "b.yaml: not needed by --exp" in err
    )
    assert "d.yaml: not needed by --exp" in err  # its broken fragment too
    assert "error:" not in err


def test_a_named_experiment_is_refused_for_the_experiment_it_waits_on(folder, capsys):
    code, err = dry_run(folder, capsys, "--exp", "c")
    assert code == 2
    assert "error: " in err and "bad.jsonl:1: not valid JSON" in err


def test_a_named_experiment_is_refused_for_the_fragment_it_inherits(folder, capsys):
    code, err = dry_run(folder, capsys, "--exp", "d")
    assert code == 2
    assert "_shared.yaml:1: train.epochs" in err
    assert "d.yaml: not needed" not in err  # an error of d, not a skipped sibling's warning
    assert "b.yaml: not needed by --exp, skipped" in err


def test_all_stays_all_or_nothing(folder, capsys):
    code, err = dry_run(folder, capsys, "--all")
    assert code == 2
    assert "bad.jsonl:1" in err and "_shared.yaml:1: train.epochs" in err and "skipped" not in err
