"""The pruning rule (core/pruning.py) on hand-computed figures, and its records on disk: one value per run,
a recorded decision taken back on requeue, two processes deciding at once."""

from __future__ import annotations

import math
import multiprocessing
from pathlib import Path

import pytest

from core.config import PruneSpec
from core.pruning import (
    Decision,
    decision,
    expected_epochs,
    judged,
    latest_by_run,
    quantile,
    rung_file,
    rung_records,
)

HALF = PruneSpec(rungs=[1], keep=0.5, min_points=3)


def test_quantile_interpolates_linearly_between_neighbours_as_numpys_default_does():
    # positions (n - 1) q: 1.5 -> halfway from 2 to 3; 1.65 -> 2.65; the ends are the extremes.
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert quantile([6.0, 5.0, 4.0, 3.0, 2.0, 1.0], 0.33) == pytest.approx(2.65)
    assert quantile([7.0], 0.33) == 7.0
    assert quantile([1.0, 9.0], 0.0) == 1.0 and quantile([1.0, 9.0], 1.0) == 9.0


def test_a_loss_above_the_keep_quantile_stops_and_one_at_or_below_goes_on():
    losses = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # median 3.5
    assert decision(4.0, losses, 0.5, 3).stop is True
    assert decision(3.0, [1.0, 2.0, 3.0, 4.0, 5.0, 3.0], 0.5, 3).stop is False
    stopped = decision(6.0, losses, 0.5, 3)
    assert (stopped.cutoff, stopped.points) == (3.5, 6)


def test_a_loss_tied_with_the_cutoff_goes_on():
    # [2, 2, 2, 5]: the median is 2; a 2 is not above it, the 5 is.
    assert decision(2.0, [2.0, 2.0, 2.0, 5.0], 0.5, 3) == decision(2.0, [5.0, 2.0, 2.0, 2.0], 0.5, 3)
    assert decision(2.0, [2.0, 2.0, 2.0, 5.0], 0.5, 3).stop is False
    assert decision(5.0, [2.0, 2.0, 2.0, 5.0], 0.5, 3).stop is True


def test_with_fewer_than_min_points_losses_every_run_goes_on_however_bad():
    early = decision(100.0, [1.0, 100.0], 0.5, 3)
    assert (early.stop, early.cutoff, early.points) == (False, None, 2)
    assert decision(100.0, [1.0, 1.0, 100.0], 0.5, 3).stop is True


def test_a_loss_that_is_not_a_number_stops_and_never_moves_the_others_cutoff():
    assert decision(math.nan, [1.0, 2.0, math.nan], 0.5, 3) == Decision(True, None, 3)
    assert decision(math.inf, [1.0], 0.5, 3).stop is True
    # The NaN recorded by a diverged run is left out: 2.0 is judged among 1.0, 3.0 and itself (median 2).
    assert decision(2.0, [1.0, 3.0, math.nan, 2.0], 0.5, 3) == Decision(False, 2.0, 3)


def test_expected_epochs_follow_the_halving_sum_and_no_rung_is_the_worst_case():
    assert expected_epochs(3, [1], 0.5) == 2.0  # 1 + 0.5 x 2
    assert expected_epochs(4, [1, 2], 0.5) == 1 + 0.5 + 0.25 * 2
    assert expected_epochs(3, [1, 2], 0.33) == pytest.approx(1 + 0.33 + 0.33**2)
    assert expected_epochs(3, [], 0.5) == 3


def test_runs_are_judged_in_the_order_they_arrive_against_every_run_recorded_so_far(tmp_path):
    # Six rates, the three hopeless ones last: the first two go on (too few records), then each is judged.
    arrivals = [("a", 1.2), ("b", 1.1), ("c", 1.0), ("d", 3.0), ("e", 3.0), ("f", 3.0)]
    decided = {run: judged(tmp_path, "lr", run, "h", 1, loss, HALF) for run, loss in arrivals}
    assert [decided[run].stop for run, _ in arrivals] == [False, False, False, True, True, True]
    assert decided["c"].cutoff == 1.1  # median of 1.2, 1.1, 1.0
    assert decided["d"].cutoff == pytest.approx(1.15)  # median of 1.0, 1.1, 1.2, 3.0
    assert decided["f"].cutoff == pytest.approx(2.1)  # of three 1.x and three 3.0: (1.2 + 3.0) / 2
    assert [r.points for r in rung_records(tmp_path, "lr", 1)] == [1, 2, 3, 4, 5, 6]


def test_each_seed_of_a_point_is_judged_on_its_own(tmp_path):
    # A point's two seeds are two runs: the good seed goes on, the bad one stops.
    for run, loss in [("x-s1", 1.0), ("y-s1", 1.0), ("z-s1", 1.0)]:
        judged(tmp_path, "sw", run, "h", 1, loss, HALF)
    assert judged(tmp_path, "sw", "p-s1", "h", 1, 0.9, HALF).stop is False
    assert judged(tmp_path, "sw", "p-s2", "h", 1, 2.0, HALF).stop is True


def test_a_requeued_run_takes_back_its_recorded_decision_and_never_decides_again(tmp_path):
    for run, loss in [("a", 1.0), ("b", 1.0), ("c", 5.0)]:
        first = judged(tmp_path, "sw", run, "h", 1, loss, HALF)
    assert first.stop is True
    # Requeued after its decision, it trains again to the rung (another loss, more records since): the
    # same decision, and nothing written.
    judged(tmp_path, "sw", "d", "h", 1, 9.0, HALF)
    again = judged(tmp_path, "sw", "c", "h", 1, 0.5, HALF)
    assert again == first and len(rung_records(tmp_path, "sw", 1)) == 4


def test_a_run_rerun_under_another_config_decides_anew_and_its_new_loss_replaces_its_old(tmp_path):
    for run, loss in [("a", 1.0), ("b", 1.0), ("c", 5.0)]:
        judged(tmp_path, "sw", run, "h", 1, loss, HALF)
    rerun = judged(tmp_path, "sw", "c", "h2", 1, 0.5, HALF)
    assert rerun.stop is False and rerun.points == 3  # a, b and c's new loss: c's old one no longer counts
    assert latest_by_run(rung_records(tmp_path, "sw", 1))["c"].eval_loss == 0.5


def writer(run_root: str, prefix: str, start, count: int) -> None:
    start.wait()
    for index in range(count):
        judged(Path(run_root), "sw", f"{prefix}{index}", "h", 1, float(index), HALF)


def test_two_processes_deciding_at_once_each_see_every_earlier_decision(tmp_path):
    # Without the lock, two runs read the same records and both count themselves the n-th.
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(2)
    processes = [
        context.Process(target=writer, args=(str(tmp_path), prefix, start, 60)) for prefix in ("a", "b")
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
    assert [process.exitcode for process in processes] == [0, 0]
    records = rung_records(tmp_path, "sw", 1)
    assert len(records) == 120 and len(rung_file(tmp_path, "sw", 1).read_text().splitlines()) == 120
    assert [r.points for r in records] == list(range(1, 121))


def test_a_run_pruned_for_a_nan_loss_says_so_in_status_not_at_a_rung(tmp_path):
    """Before: --status said only "PRUNED at a rung" for a run whose eval loss was NaN (no cutoff)."""
    from core.pruning import RungRecord, mark_pruned
    from core.rundir import RunDir
    from slurm.status import pruned_reason

    decided = decision(math.nan, [math.nan, 1.0, 2.0], keep=0.5, min_points=3)
    mark_pruned(
        tmp_path, RungRecord("p-s1", "h", 1.0, math.nan, decided.stop, decided.cutoff, decided.points)
    )
    reason = pruned_reason(RunDir(tmp_path).read_pruned())
    assert reason.startswith("at rung 1: eval_loss is not a number") and "diverged" in reason
    # The same when a strict-JSON writer records the loss as null.
    assert "eval_loss is not a number" in pruned_reason({"rung": 1, "points": 3, "stop": True})


@pytest.mark.parametrize(
    "record, said",
    [
        (
            {"rung": 1, "eval_loss": 3.21, "cutoff": 1.15, "points": 4, "stop": True},
            "> cutoff 1.15 of 4 runs: stop",
        ),
        (
            {"rung": 2, "eval_loss": 1.0, "cutoff": 1.15, "points": 4, "stop": False},
            "<= cutoff 1.15 of 4 runs: go on",
        ),
        (
            {"rung": 1, "eval_loss": 1.0, "cutoff": None, "points": 2, "stop": False},
            "2 run(s) recorded (fewer than min_points 3): go on",
        ),
    ],
)
def test_each_rungs_decision_reads_with_its_loss_cutoff_and_verdict(record, said):
    from core.pruning import decided_text

    assert decided_text(record, min_points=3).endswith(said)
