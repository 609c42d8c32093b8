"""launch.py's flags are checked at the door (slurm/planning/request.py): before the config folder is read, every
flag that cannot work is named at once, exit 2."""

from __future__ import annotations

import pytest

import launch
from slurm.planning.request import request_from


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--status", "--rank", "1"], ["--rank: picks the task of a multi-GPU job whose log --tail follows"]),
        (["--all", "--calibrate", "--calibrate-steps", "0"], ["--calibrate-steps: must be at least 1"]),
        (
            ["--all", "--dry-run", "--pack", "2", "--budget", "six hours"],
            ["--budget: 'six hours' must look like HH:MM:SS"],
        ),
        (["--calibrate"], ["say which experiments: --all or --exp NAME"]),
        (
            ["--tail", "a/train", "--rank", "-1", "--calibrate-steps", "0"],
            [
                "--rank: must be 0 or more",
                "--calibrate-steps: does nothing for --tail: it is for --calibrate",
            ],
        ),
    ],
)
def test_a_flag_that_cannot_work_is_named_before_anything_is_read(argv, named, tmp_path, capsys):
    missing = tmp_path / "no-such-folder"  # never read: the door comes first
    code = launch.main([*argv, "--config-dir", str(missing)])
    err = capsys.readouterr().err
    assert code == 2, err
    for text in named:
        assert text in err, err
    assert str(missing) not in err and f"{len(named)} problem(s)" in err


def test_the_request_says_what_the_flags_asked_for(tmp_path):
    args = launch.parse_args(["--exp", "a", "b", "--dry-run", "--json", "train.epochs=2"])
    request = request_from(args)
    assert (request.action, request.experiments, request.overrides, request.as_json) == (
        "dry_run",
        ("a", "b"),
        ("train.epochs=2",),
        True,
    )
    assert not request.submits and request_from(launch.parse_args(["--all"])).action == "launch"


def test_an_override_right_after_the_exp_names_is_an_override_not_a_third_name():
    """Before: `--exp a b train.learning_rate=1e-4` (the docs' own example) took the override for an
    experiment name and failed "no experiment named 'train.learning_rate=1e-4'"."""
    args = launch.parse_args(["--exp", "a", "b", "train.learning_rate=1e-4", "data.max_length=512"])
    request = request_from(args)
    assert request.experiments == ("a", "b")
    assert request.overrides == ("train.learning_rate=1e-4", "data.max_length=512")


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--status", "--json"], "--json"),
        (["--report", "--exp", "a"], "--exp"),
        (["--all", "--export", "--pack", "2"], "--pack"),
        (["--all", "--export", "--pack", "0"], "--pack"),
        (["--all", "--dry-run", "--wait"], "--wait"),
        (["--status", "--rank", "0"], "--rank"),
        (["--all", "--export-format", "gguf"], "--export-format"),
        (["--cancel", "--budget-basis", "worst"], "--budget-basis"),
        (["--sync", "train.epochs=2"], "KEY=VALUE"),
        (["--all", "--preflight", "--no-preflight"], "--no-preflight"),
        (["--report", "--backend", "local"], "--backend"),
    ],
)
def test_a_flag_the_verb_does_not_use_is_refused_not_silently_ignored(argv, flag, tmp_path, capsys):
    """Before: some were refused (--rank without --tail) and others ignored: `--report --exp a` reported
    every experiment, `--export --pack 2` made no pack, `--status --json` printed a table."""
    code = launch.main([*argv, "--config-dir", str(tmp_path / "never-read")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"command line: {flag}: " in err and "1 problem(s)" in err, err


@pytest.mark.parametrize(
    "argv",
    [
        [
            "--all",
            "--dry-run",
            "--backend",
            "local",
            "--force",
            "--json",
            "--pack",
            "2",
            "--budget",
            "01:00:00",
        ],
        ["--all", "--preflight", "--json", "train.epochs=2"],
        ["--tail", "a/train", "--rank", "1"],
        ["--cancel", "--removed"],
        ["--all", "--export", "--export-format", "gguf", "--no-preflight", "--wait", "--backend", "local"],
    ],
)
def test_the_flags_a_verb_uses_pass_the_door(argv):
    request_from(launch.parse_args(argv))
