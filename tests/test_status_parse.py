"""The squeue/sacct parsers and the state table, on text recorded from the dev cluster (slurm-wlm 22.05.8).

Recorded with the launcher's formats of then (`squeue -h -u USER -o "%i|%T|%r|%M"`, `sacct -n -P -X -o
JobID,State,Elapsed,ExitCode,Reason`; the nodes field came after, issue 39) while these jobs ran: 460 failed (exit 3); 461 waited on it with
--kill-on-invalid-dep=no; 462 waited on it and was killed (kill_invalid_depend); 463 was requeued with
`scontrol requeue`, ran again and was cancelled; 464 was held; 465 was a 3-task array. No cluster needed.

What jobs held (`sacct -n -P -D -X -o JobID,State,ElapsedRaw,AllocTRES`, the report's GPU-hours), recorded
in tests/fixtures/sacct/usage-22.05.8.txt: 1 held 2 GPUs; 2 held one and was requeued twice by
`scontrol requeue`; 3 asked for no GPU; 4 was cancelled while it ran; 5 was cancelled while held; 7 held 4.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from core.durations import format_eta
from core.states import State, from_slurm, jobs_verdict, parent_verdict
from slurm.watching.status import (
    Allocation,
    Done,
    Row,
    SchedulerInfo,
    parse_sacct,
    parse_sacct_allocations,
    parse_squeue,
    status_row,
    tres_gpus,
)

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


# Issue 39: the nodes a job holds or held, the last field of both formats (`squeue -o "%i|%T|%r|%M|%N"`,
# `sacct -o JobID,State,Elapsed,ExitCode,Reason,NodeList`). Written as slurm-wlm 22.05.8 prints them (its
# man pages: squeue's %N is empty while a job waits; sacct keeps "None assigned" for a job that never held
# a node), with the two-node dev cluster's node names (n1, n2) and the one-node cluster's (vm).
SQUEUE_WITH_NODES = """\
470|RUNNING|None|1:02|n[1-2]
471|RUNNING|None|0:30|vm
472|PENDING|Resources|0:00|
473|COMPLETING|None|2:10|n2
"""
SACCT_WITH_NODES = """\
480|COMPLETED|00:04:10|0:0|None|n[1-2]
481|FAILED|00:00:05|1:0|None|n1
482|CANCELLED by 1000|00:00:00|0:0|Resources|None assigned
483|TIMEOUT|00:10:00|0:0|None|vm
"""


def test_status_names_the_nodes_a_two_node_job_holds():
    info = parse_squeue(SQUEUE_WITH_NODES)
    assert info["470"] == SchedulerInfo(State.RUNNING, "", "1:02", nodes="n[1-2]")  # SLURM's own notation
    assert info["471"].nodes == "vm" and info["473"].nodes == "n2"  # COMPLETING: the nodes not yet freed
    assert info["472"] == SchedulerInfo(State.PENDING, "Resources", "0:00", nodes="")  # waits: holds none


def test_status_names_the_nodes_an_ended_job_held_and_none_for_one_that_never_started():
    info = parse_sacct(SACCT_WITH_NODES)
    assert info["480"] == SchedulerInfo(State.COMPLETED, "", "00:04:10", "0:0", "n[1-2]")
    assert info["481"].nodes == "n1" and info["483"].nodes == "vm"
    assert info["482"].nodes == ""  # "None assigned": cancelled while it waited


def test_lines_in_the_formats_before_the_nodes_read_as_before_with_no_nodes():
    # A squeue/sacct wrapper that prints the old fields only: the same states, nodes "".
    assert parse_squeue("7|RUNNING|None|0:14\n")["7"] == SchedulerInfo(State.RUNNING, "", "0:14", nodes="")
    assert parse_sacct("8|FAILED|00:00:01|3:0|None\n")["8"].nodes == ""


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


USAGE = (Path(__file__).parent / "fixtures" / "sacct" / "usage-22.05.8.txt").read_text()
# The same jobs earlier, as sacct printed them while 4 ran and 2 waited to start again after its requeue.
USAGE_WHILE_RUNNING = """\
1|COMPLETED|3|billing=1,cpu=1,gres/gpu=2,node=1
2|REQUEUED|6|billing=1,cpu=1,gres/gpu=1,node=1
3|COMPLETED|2|billing=1,cpu=1,node=1
4|RUNNING|15|billing=1,cpu=1,gres/gpu=1,node=1
2|PENDING|0|
"""
# Without -X (a site's sacct wrapper may drop it): each job's steps follow it, with their own TRES.
USAGE_WITH_STEPS = """\
2|REQUEUED|6|billing=1,cpu=1,gres/gpu=1,node=1
2.batch|CANCELLED|6|cpu=1,gres/gpu=1,mem=0,node=1
2|REQUEUED|7|billing=1,cpu=1,gres/gpu=1,node=1
2.batch|CANCELLED|7|cpu=1,gres/gpu=1,mem=0,node=1
2|COMPLETED|30|billing=1,cpu=1,gres/gpu=1,node=1
2.batch|COMPLETED|30|cpu=1,gres/gpu=1,mem=0,node=1
"""


def test_sacct_allocations_keep_every_attempt_of_a_requeued_job_with_its_gpus():
    found = parse_sacct_allocations(USAGE)
    assert found["2"] == [
        Allocation(State.PENDING, 6, 1),  # REQUEUED: an attempt that ended in a requeue
        Allocation(State.PENDING, 7, 1),
        Allocation(State.COMPLETED, 30, 1),
    ]
    assert found["1"] == [Allocation(State.COMPLETED, 3, 2)] and found["7"] == [
        Allocation(State.COMPLETED, 4, 4)
    ]
    assert found["3"] == [Allocation(State.COMPLETED, 2, 0)]  # no gres/gpu: a CPU job
    assert found["4"] == [Allocation(State.CANCELLED, 19, 1)]
    assert found["5"] == [Allocation(State.CANCELLED, 0, 0)]  # never started: no AllocTRES
    assert set(found) == {"1", "2", "3", "4", "5", "7"}


def test_sacct_allocations_of_a_running_job_and_of_one_waiting_to_restart():
    found = parse_sacct_allocations(USAGE_WHILE_RUNNING)
    assert found["4"] == [Allocation(State.RUNNING, 15, 1)]
    assert found["2"] == [Allocation(State.PENDING, 6, 1), Allocation(State.PENDING, 0, 0)]


def test_sacct_allocations_skip_step_lines_and_unreadable_ones():
    assert parse_sacct_allocations(USAGE_WITH_STEPS) == {"2": parse_sacct_allocations(USAGE)["2"]}
    assert parse_sacct_allocations("9|RUNNING\n\n8|COMPLETED|n/a|gres/gpu=1\n") == {}
    assert parse_sacct_allocations("9|TIMEOUT|1-00:00:05|gres/gpu=1\n")["9"][0].elapsed_s == 86405


def test_gpus_are_read_from_untyped_or_typed_tres_counts():
    assert tres_gpus("billing=1,cpu=1,gres/gpu=2,node=1") == 2
    # A cluster that accounts GPU types (AccountingStorageTRES=gres/gpu,gres/gpu:a100) lists both forms;
    # the untyped one is the total.
    assert tres_gpus("billing=64,cpu=32,gres/gpu:a100=4,gres/gpu=4,mem=256G,node=1") == 4
    assert tres_gpus("cpu=8,gres/gpu:a100=2,gres/gpu:v100=1,node=1") == 3  # only typed counts kept
    assert tres_gpus("") == tres_gpus("billing=1,cpu=1,node=1") == tres_gpus("gres/gpu=n/a") == 0


@pytest.mark.parametrize(
    ("kind", "parent", "verdict"),
    [
        ("afterok", None, None),
        ("afterok", State.RUNNING, None),
        ("afterok", State.UNKNOWN, None),
        ("afterok", State.COMPLETED, State.PENDING),
        ("afterok", State.FAILED, State.BLOCKED),
        ("afterok", State.CANCELLED, State.BLOCKED),
        ("afterok", State.BLOCKED, State.BLOCKED),
        ("afterany", State.PENDING, None),
        ("afterany", State.COMPLETED, State.PENDING),
        ("afterany", State.TIMEOUT, State.PENDING),
        ("afterany", State.BLOCKED, State.PENDING),
    ],
)
def test_one_dependency_rule_as_slurm_applies_it(kind, parent, verdict):
    """afterok blocks on a parent that did not complete, afterany waits only for its end: the rule the local
    backend, a pack's lanes and --status all take from core/states.py."""
    assert parent_verdict(kind, parent) == verdict


# job_status's table by hand, every combination that can happen (nothing is live unless queued): (DONE says, queued, the scheduler still has it) → row.
STATUS_ROWS = (
    [(Done.UNREADABLE, queued, live, Row.UNREADABLE) for queued in (False, True) for live in (False, True)]
    + [(Done.THIS, queued, live, Row.FINISHED) for queued in (False, True) for live in (False, True)]
    + [
        (Done.OTHER, False, False, Row.ANOTHER_CONFIG),
        (Done.OTHER, True, False, Row.ANOTHER_CONFIG),
        (Done.OTHER, True, True, Row.SCHEDULED),  # requeued or relaunched with --force: it runs again
        (Done.NONE, False, False, Row.PLANNED),
        (Done.NONE, True, False, Row.SCHEDULED),
        (Done.NONE, True, True, Row.SCHEDULED),
    ]
)


@pytest.mark.parametrize("done, queued, live, row", STATUS_ROWS)
def test_status_rows_an_edited_jobs_old_run_is_completed_not_failed_and_a_done_job_never_asks_slurm(
    done, queued, live, row
):
    assert status_row(done, queued, live) is row


def test_a_blocking_parent_blocks_even_while_another_still_runs():
    assert jobs_verdict([None, State.BLOCKED]) is State.BLOCKED
    assert jobs_verdict([State.PENDING, None]) is None
    assert jobs_verdict([State.PENDING, State.PENDING]) is State.PENDING


def test_an_eta_past_a_day_keeps_its_days():
    """Before: the ETA was a 24-hour clock: 93,600 s (26 hours) read 02:00:00."""
    assert format_eta(93_600) == "1-02:00:00"
    assert format_eta(3_723.4) == "01:02:03"
    assert format_eta(None) == format_eta(float("inf")) == ""


def test_a_local_jobs_elapsed_is_its_own_clock_not_blank(tmp_path):
    """Before: --status left `elapsed` blank for every local job (no scheduler keeps its time). Its files
    as submitit lays them out, dated: submitted at t, its log last written 95 s later."""
    import os
    import time

    from core.job_records import JobRecord
    from slurm.cluster.scheduler import RecordedLocalJob
    from slurm.watching.status import local_elapsed

    job = RecordedLocalJob(tmp_path, "4242")
    start = time.time() - 3600
    for path, when in ((job.paths.submitted_pickle, start), (job.paths.stdout, start + 95)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
        os.utime(path, (when, when))
    record = JobRecord("4242", backend="local")
    assert local_elapsed(job, record, running=False) == "00:01:35"
    assert local_elapsed(job, record, running=True) in ("01:00:00", "01:00:01")
    job.paths.submitted_pickle.unlink()  # gone: job.json's submission time is the start
    stamped = JobRecord(
        "4242", backend="local", submitted_at=time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(start))
    )
    assert local_elapsed(job, stamped, running=False) in ("00:01:34", "00:01:35", "00:01:36")  # whole seconds


def test_a_job_the_user_cancelled_shows_no_traceback_nor_fix_the_cause(tmp_path):
    """Before: --status printed the cancelled job's KeyboardInterrupt traceback from its log and "Fix the
    cause, then: python launch.py --retry-failed", as for a crash."""
    from slurm.cluster.profile import load_profile
    from slurm.planning.experiments import load_experiments
    from slurm.planning.plan import build_plan
    from slurm.watching.render import problem_lines
    from slurm.watching.status import JobStatus
    from tests.helpers import experiment_folder

    folder = experiment_folder(tmp_path)
    profile, _ = load_profile(folder)
    train, evaluation = build_plan(load_experiments(folder, profile), profile).jobs[:2]
    log = tmp_path / "job.log"
    log.write_text('Traceback (most recent call last):\n  File "x.py", line 1\nKeyboardInterrupt\n')
    cancelled = JobStatus(
        train,
        State.CANCELLED,
        reason="cancelled at 2026-11-28T07:00:00",
        scheduler_id="99",
        log_path=str(log),
        backend="local",
    )
    lines = problem_lines([cancelled])
    assert lines == [
        f"{train.id}: CANCELLED (local pid 99, cancelled at 2026-11-28T07:00:00): stopped as asked, not failed; "
        "the same launch (or --retry-failed) runs it again"
    ]
    failed = JobStatus(evaluation, State.FAILED, reason="ValueError: x", scheduler_id="7", log_path=str(log))
    assert "Fix the cause, then: python launch.py --retry-failed (same --config-dir)" in problem_lines(
        [cancelled, failed]
    )


def test_tail_of_an_unknown_experiment_names_the_run_root_it_looked_in(tmp_path, capsys):
    """Before: `--tail EXP` said "no experiment 'EXP'" without saying where it had looked (the default
    folder's run root), so a user whose runs were under another run root could not tell why."""
    import launch
    from tests.helpers import experiment_folder

    folder = experiment_folder(tmp_path)
    assert launch.main(["--tail", "b", "--config-dir", str(folder)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"--tail: no experiment 'b' in the run root {tmp_path / 'runs'}/" in err and "--config-dir" in err


def test_a_local_eval_stopped_at_its_time_limit_says_so_with_the_limit_and_where_it_came_from(tmp_path):
    """Before: "ended without a result (killed or cancelled)", though its log had the time-limit signal.
    The job's files as submitit lays them out: its log with the line slurm/queueing/jobs.py writes on USR2, no
    result; its pid is no live process."""
    from core.job_records import JobRecord
    from slurm.cluster.profile import load_profile
    from slurm.cluster.scheduler import RecordedLocalJob, reached_time_limit
    from slurm.planning.experiments import load_experiments
    from slurm.planning.plan import build_plan
    from slurm.watching.status import local_info
    from tests.helpers import experiment_folder

    folder = experiment_folder(tmp_path)
    profile, _ = load_profile(folder)
    evaluation = build_plan(load_experiments(folder, profile), profile).job("a/eval")
    assert evaluation.time_auto and evaluation.estimate.source == "guess"
    job = RecordedLocalJob(tmp_path / "logs", "999999999")
    job.paths.stdout.parent.mkdir(parents=True)
    job.paths.stdout.write_text(
        "INFO eval.job: 20 predictions made\n"
        "WARNING slurm.queueing.jobs: received SIGUSR2: stopping at the next step end (training) or batch end (eval)\n"
    )
    assert reached_time_limit(job)
    info = local_info(job, JobRecord("999999999", backend="local"), evaluation)
    assert info.state is State.TIMEOUT
    assert (
        f"reached its time limit ({evaluation.resources.time}, eval.resources.time: auto from a guessed"
        in info.reason
    )
    assert "predictions (one per example) are kept" in info.reason and "--retry-failed" in info.reason
    job.paths.stdout.write_text("Traceback ...\nValueError: x\n")  # no signal: not a time limit
    assert not reached_time_limit(job)


def test_a_job_that_ran_and_failed_loses_the_reason_it_once_waited_for():
    """L4: `dB/dpo: FAILED (slurm job 9) Dependency; rank 1 on n2: Killed`: sacct keeps the pending reason
    of a job that has since run; it says nothing of the failure. A job cancelled while it waited keeps it."""
    info = parse_sacct(
        "9|FAILED|00:01:02|1:0|Dependency|n[1-2]\n10|CANCELLED by 0|00:00:00|0:0|Dependency|None assigned\n"
    )
    assert info["9"].state is State.FAILED and info["9"].reason == ""
    assert info["10"].state is State.CANCELLED and info["10"].reason == "Dependency"
