"""The squeue/sacct parsers and the state table, on text recorded from the dev cluster (slurm-wlm 22.05.8).

Recorded with the launcher's own formats (`squeue -h -u USER -o "%i|%T|%r|%M"`, `sacct -n -P -X -o
JobID,State,Elapsed,ExitCode,Reason`) while these jobs ran: 460 failed (exit 3); 461 waited on it with
--kill-on-invalid-dep=no; 462 waited on it and was killed (kill_invalid_depend); 463 was requeued with
`scontrol requeue`, ran again and was cancelled; 464 was held; 465 was a 3-task array. No cluster needed.
"""

from __future__ import annotations

import pytest

from slurm.states import State, from_slurm
from slurm.status import SchedulerInfo, parse_sacct, parse_squeue

SQUEUE = """\
461|PENDING|DependencyNeverSatisfied|0:00
463|PENDING|BeginTime|0:00
464|PENDING|JobHeldUser|0:00
465_0|RUNNING|None|0:14
465_1|RUNNING|None|0:14
465_2|RUNNING|None|0:14
"""

# `sacct --duplicates` (and the same text as sacct prints it without -D, minus the REQUEUED line).
SACCT = """\
460|FAILED|00:00:01|3:0|None
461|CANCELLED by 0|00:00:00|0:0|DependencyNeverSatisfied
462|CANCELLED|00:00:00|0:0|Dependency
463|REQUEUED|00:00:11|0:0|None
464|CANCELLED by 0|00:00:00|0:0|JobHeldUser
465_0|CANCELLED by 0|00:00:23|0:0|None
465_1|CANCELLED by 0|00:00:23|0:0|None
465_2|CANCELLED by 0|00:00:23|0:0|None
463|CANCELLED by 0|00:00:01|0:0|BeginTime
"""


def test_squeue_gives_state_reason_and_elapsed_per_job():
    info = parse_squeue(SQUEUE)
    assert info["461"] == SchedulerInfo(State.PENDING, "DependencyNeverSatisfied", "0:00")
    assert info["463"] == SchedulerInfo(State.PENDING, "BeginTime", "0:00")  # requeued, waiting to restart
    assert info["464"].reason == "JobHeldUser"
    assert info["465_1"] == SchedulerInfo(State.RUNNING, "", "0:14")  # "None" is no reason
    assert set(info) == {"461", "463", "464", "465_0", "465_1", "465_2"}  # array tasks keep their ids


def test_sacct_keeps_the_last_attempt_of_a_requeued_job():
    info = parse_sacct(SACCT)
    assert info["463"] == SchedulerInfo(State.CANCELLED, "BeginTime", "00:00:01", "0:0")
    assert len(info) == 8


def test_sacct_states_reasons_and_exit_codes():
    info = parse_sacct(SACCT)
    assert info["460"] == SchedulerInfo(State.FAILED, "", "00:00:01", "3:0")
    assert info["461"] == SchedulerInfo(State.CANCELLED, "DependencyNeverSatisfied", "00:00:00", "0:0")
    assert info["462"].state is State.CANCELLED and info["462"].reason == "Dependency"
    assert info["465_2"].state is State.CANCELLED and info["465_2"].elapsed == "00:00:23"


def test_squeues_parenthesised_reasons_and_null_read_like_its_plain_ones():
    # `%R` (squeue's default NODELIST(REASON) column) wraps reasons in parentheses; some versions say (null).
    info = parse_squeue("7|PENDING|(DependencyNeverSatisfied)|0:00\n8|PENDING|(null)|0:00\n")
    assert info["7"].reason == "DependencyNeverSatisfied"
    assert info["8"].reason == ""


def test_empty_short_and_blank_output_is_tolerated():
    assert parse_squeue("") == {} and parse_sacct("") == {}
    info = parse_sacct("\n9|RUNNING\n   \n")  # a line cut short, blank lines
    assert info == {"9": SchedulerInfo(State.RUNNING, "", "", "")}


@pytest.mark.parametrize(
    ("raw", "state"),
    [
        ("CANCELLED by 0", State.CANCELLED),
        ("CANCELLED by 1000", State.CANCELLED),
        ("PENDING", State.PENDING),
        ("REQUEUED", State.PENDING),
        ("COMPLETING", State.RUNNING),
        ("TIMEOUT", State.TIMEOUT),
        ("OUT_OF_MEMORY", State.FAILED),
        ("NODE_FAIL", State.FAILED),
        ("PREEMPTED", State.PENDING),
        ("RUNNING+", State.RUNNING),
        ("completed", State.COMPLETED),
        ("SOMETHING_NEW", State.UNKNOWN),
    ],
)
def test_raw_slurm_states_map_to_ours(raw, state):
    assert from_slurm(raw) is state
