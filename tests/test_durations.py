"""core/durations.py: the one reader and writer of durations. A config's strict form and the looser ones
SLURM's tools print are read by the same module and agree; odd text is no figure, never a crash. (The
ETA's 24-hour wrap: tests/test_status_parse.py test_an_eta_past_a_day_keeps_its_days.)"""

from __future__ import annotations

import pytest

from core.durations import TIME_FORMAT, format_duration, read_duration, slurm_seconds, slurm_time
from slurm.watching.status import elapsed_seconds


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1-02:00:00", 93_600),  # D-HH:MM:SS
        ("02:00:00", 7_200),  # HH:MM:SS
        ("05:30", 330),  # MM:SS, as squeue's %M prints a short elapsed time
        ("10", 600),  # MM: a bare number is minutes (sbatch --time, slurm.conf MaxTime)
        ("1-12", 129_600),  # D-HH
        ("1-02:30", 95_400),  # D-HH:MM
        (" 00:10:00 ", 600),
    ],
)
def test_slurms_duration_forms_are_read_in_seconds(text, seconds):
    assert read_duration(text) == seconds


@pytest.mark.parametrize("odd", ["UNLIMITED", "INFINITE", "", "-1", "1-0²:00:00", "٣:00", "1:2:3:4", "n/a"])
def test_no_limit_and_odd_text_read_as_no_figure(odd):
    assert read_duration(odd) is None


@pytest.mark.parametrize("seconds", [0, 59, 3_599, 86_399, 86_400, 93_784, 10 * 86_400 + 1])
def test_a_written_duration_reads_back_the_same_by_both_readers(seconds):
    """A limit we write (#SBATCH --time, a message) is the one sacctmgr and scontrol print back: when the
    two forms had two parsers, a day-long limit could be read as one thing and checked as another."""
    text = slurm_time(seconds)
    assert TIME_FORMAT.match(text)
    assert slurm_seconds(text) == read_duration(text) == seconds


def test_a_day_is_written_with_its_days_not_as_a_24_hour_clock():
    assert slurm_time(93_784) == "1-02:03:04" and slurm_time(3_723) == "01:02:03"


def test_an_elapsed_time_is_read_raw_or_as_slurm_writes_it():
    assert elapsed_seconds("86405") == 86_405  # ElapsedRaw: seconds, not minutes
    assert elapsed_seconds("1-00:00:05") == 86_405
    assert elapsed_seconds("0:14") == 14  # squeue's %M form; the old strict reader gave None


def test_an_estimate_is_shown_as_roughly_as_it_is_known():
    assert [format_duration(s) for s in (45, 690, 4_320, 183_600)] == ["45s", "12m", "1h12m", "2d3h"]
