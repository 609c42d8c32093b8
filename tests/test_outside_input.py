"""Issue 31, rule 7: outside input never crashes or hangs the login node. FIFOs and devices where a config
or a state file belongs are refused without being opened for a blocking read; a scheduler tool's odd bytes
and digits are read as text and refused as numbers. Real files, real FIFOs, a real subprocess; sacctmgr's
odd output is a recorded line (a real cluster does not print it on request)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.config import ascii_int
from core.durations import read_duration
from core.files import read_json, read_jsonl, read_text
from core.rundir import UNREADABLE, done_hash
from slurm.cluster import limits
from slurm.cluster.client import run_client
from slurm.watching.status import elapsed_seconds, tres_gpus
from tests.conftest import write_cluster_yaml

ROOT = Path(__file__).resolve().parent.parent


def launch(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """launch.py in its own process, with a time limit: a hang fails the test instead of the suite."""
    return subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_fifo_named_like_a_config_is_refused_not_waited_on(tmp_path):
    """Before: the launch opened it and waited for a writer, for ever."""
    configs = tmp_path / "configs"
    configs.mkdir()
    write_cluster_yaml(configs, tmp_path)
    os.mkfifo(configs / "trap.yaml")
    done = launch(["--all", "--config-dir", str(configs), "--dry-run"], ROOT)
    assert done.returncode == 2, done.stderr
    assert "trap.yaml" in done.stderr and "not a regular file" in done.stderr


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder"])
def test_a_done_that_is_not_a_regular_file_is_unreadable_at_once(tmp_path, kind, capsys):
    """A FIFO DONE hung --status and the launch; a DONE linked to /dev/zero was read without end."""
    run_dir = tmp_path / "stage"
    run_dir.mkdir()
    done = run_dir / "DONE"
    {"fifo": os.mkfifo, "dev-zero": lambda p: p.symlink_to("/dev/zero"), "folder": Path.mkdir}[kind](done)
    assert done_hash(run_dir) == UNREADABLE
    assert "DONE" in capsys.readouterr().err


def test_state_and_log_readers_refuse_fifos_and_say_so(tmp_path, capsys):
    for name in ("summary.json", "metrics.jsonl"):
        os.mkfifo(tmp_path / name)
    assert read_json(tmp_path / "summary.json", {}) == {}
    assert read_jsonl(tmp_path / "metrics.jsonl") == []
    assert capsys.readouterr().err.count("not a regular file") == 2


def test_a_state_file_over_its_bound_is_not_read_into_memory(tmp_path, capsys):
    big = tmp_path / "job.json"
    with big.open("wb") as fh:
        fh.truncate(17 * 10**6)  # sparse: 17 MB that cost nothing to make
    assert read_text(big) is None
    assert "larger than 16,000,000 bytes" in capsys.readouterr().err


def test_a_scheduler_tools_bytes_that_are_not_utf8_are_read_as_text():
    """Before: `caf\\351` in sacctmgr's output raised UnicodeDecodeError in launch and --status."""
    assert run_client(["printf", "caf\\351|12\\n"]) == "caf\ufffd|12\n"


@pytest.mark.parametrize("odd", ["²", "1²", "٣", " 12 x", "", "-1"])
def test_only_ascii_digits_are_numbers(odd):
    """Before: '²'.isdigit() is True and int('²') raises ValueError: a limit with it crashed the launch."""
    assert ascii_int(odd) is None
    assert limits.number(odd) is None
    assert elapsed_seconds(odd) is None
    assert tres_gpus(f"cpu=4,gres/gpu={odd}") == 0


def test_odd_tres_and_durations_read_as_no_limit_not_a_crash():
    assert limits.gpus_of("cpu=16,gres/gpu=2²") is None
    assert limits.gpus_of("cpu=16,gres/gpu:a100=2") == 2
    assert read_duration("1-0²:00:00") is None
    assert read_duration("1-02:00:00") == 93_600
    assert ascii_int(" 42 ") == 42
