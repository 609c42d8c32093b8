"""Tables fit the terminal they are shown in: in an 80-column SSH session the dry run's box is whole, its
least important columns left out (and named), never wrapped by the terminal into broken lines."""

from __future__ import annotations

import fcntl
import os
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from tests.helpers import configs, write_experiments

ROOT = Path(__file__).resolve().parent.parent
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def in_a_terminal(argv: list[str], columns: int, cwd: Path, **env_extra: str) -> list[str]:
    """`python launch.py ARGV` in a real pseudo-terminal `columns` wide; its screen lines, colours removed."""
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")} | env_extra
    done = subprocess.Popen(
        [sys.executable, str(ROOT / "launch.py"), *argv], cwd=cwd, stdout=follower, stderr=follower, env=env
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert done.wait(timeout=120) == 0, b"".join(chunks).decode(errors="replace")
    return ANSI.sub("", b"".join(chunks).decode()).replace("\r", "").splitlines()


@pytest.mark.parametrize("columns", [80, 120])
def test_the_dry_run_fits_the_terminal_with_its_box_whole(columns, tmp_path):
    # Before: every table was drawn 160 columns wide, and an 80-column terminal wrapped each line in two.
    folder = write_experiments(tmp_path / "configs")
    lines = in_a_terminal(["--all", "--dry-run", "--config-dir", str(folder)], columns, tmp_path)
    box = [line for line in lines if line[:1] in "┃│┡┏┗└╇┣├"]
    assert max(len(line) for line in box) <= columns  # (sentences below it may wrap, as text does)
    assert len(box) > 5 and all(line.rstrip()[-1] in "┃│┩┓┛┘┤" for line in box), "\n".join(lines)
    assert any("chain/one" in line for line in box)  # the job column is kept first
    if columns == 80:
        assert any(line.startswith("left out to fit 80 columns:") for line in lines), "\n".join(lines)


@pytest.mark.slow
def test_a_local_run_shows_a_live_status_table_while_its_job_trains(repo_root, tmp_path, tiny):
    # Before: a local run printed one line when a job started and one when it ended, nothing between.
    folder = configs(tmp_path, repo_root, a={"epochs": 3})
    argv = ["--all", "--backend", "local", "--no-preflight", "--config-dir", str(folder)]
    lines = in_a_terminal(argv, 120, repo_root, LAUNCH_POLL_S="0.3")
    live_rows = [line for line in lines if line.startswith("│ a/train") and "RUNNING" in line]
    assert live_rows, "\n".join(lines)
