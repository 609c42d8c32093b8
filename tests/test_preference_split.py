"""Issue 41: the micro-batch split of a DPO step trains the same adapter as the written split. A DPO loss is a
mean over the pairs of the effective batch (sigmoid: one term per pair), so `train.micro_batch` may split
that batch into micro-batches x accumulation steps only if the accumulated loss is still the mean over its
pairs, not a mean of per-micro-batch means. Real DPO stages (TRL's DPOTrainer) on the tiny causal model, a
first stage against the base model, fp32 on the CPU: the splits differ by float rounding only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.train_helpers import (
    ROUNDING,
    SAME_SUMS,
    SQL,
    assert_same_adapter,
    make_job,
    one_torch_thread,
    read_jsonl,
    run_ranks,
)
from train.stage import run_stage

pytestmark = pytest.mark.slow  # trains for seconds: make test-fast leaves it out
PAIRS = 7  # at an effective batch of 4: a full step of 4 pairs, then a short last step of 3


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_torch_thread():
        yield


def pairs_file(folder: Path, count: int) -> str:
    path = folder / f"pairs-{count}.jsonl"
    path.write_text("".join((SQL / "pairs-train.jsonl").read_text().splitlines(keepends=True)[:count]))
    return str(path)


def dpo_job(tiny, run_dir: Path, pairs: str, micro_batch: int | str, batch_size: int = 4):
    """One epoch over `pairs` at an effective batch of 4 per rank (batch_size 4 x grad_accum 1 as written)."""
    return make_job(
        tiny,
        run_dir,
        data={"train": pairs, "format": "preference", "order": "file"},
        method="dpo",
        dpo={"beta": 0.1, "reference": "base"},
        max_steps=None,
        epochs=1,
        batch_size=batch_size,
        grad_accum=1,
        micro_batch=micro_batch,
        learning_rate=5e-3,  # large enough that a wrongly weighted pair moves the adapter measurably
        precision="fp32",
    )


def dpo_run(tiny, run_dir: Path, pairs: str, micro_batch: int | str) -> Path:
    assert run_stage(dpo_job(tiny, run_dir, pairs, micro_batch)) == "completed"
    return run_dir


# What each row of a DPO step logs that must not depend on the split: the loss, the gradient, and TRL's
# per-pair figures (each a mean over the step's pairs; TRL's own mean of micro-batch means was not).
LOGGED = ("loss", "grad_norm", "rewards/margins", "rewards/chosen", "logps/rejected")


def figures(run_dir: Path) -> dict:
    rows = [row for row in read_jsonl(run_dir / "metrics.jsonl") if "loss" in row]
    return {key: [r[key] for r in rows] for key in LOGGED}


def assert_same_step(split: Path, written: Path, step: int) -> None:
    """The split run logs the written run's loss, gradient norm and per-pair figures at `step` (0: the full
    first step of 4 pairs, 1: the short last one of 3)."""
    ran, wrote = figures(split), figures(written)
    print(split.name, json.dumps(ran), written.name, json.dumps(wrote))  # pytest -s: the figures
    assert len(ran["loss"]) == len(wrote["loss"]) == 2
    for key in LOGGED:
        assert ran[key][step] == pytest.approx(wrote[key][step], rel=ROUNDING, abs=1e-7), (key, ran, wrote)


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory) -> dict[int, Path]:
    """One epoch over PAIRS pairs by micro-batch: the written split 4 x 1 (steps of 4 and 3 pairs), 2 x 2
    (micro-batches of 2 and 2, then 2 and 1) and 1 x 4 (four of 1, then three)."""
    folder = tmp_path_factory.mktemp("dpo-split")
    pairs = pairs_file(folder, PAIRS)
    return {
        micro_batch: dpo_run(tiny, folder / f"{micro_batch}x", pairs, micro_batch)
        for micro_batch in (4, 2, 1)
    }


@pytest.mark.parametrize("micro_batch", [2, 1])
def test_a_dpo_step_split_into_micro_batches_is_not_scaled_by_its_accumulation_steps(runs, micro_batch):
    """The first step, 4 pairs: 2 x 2 and 1 x 4 against 4 x 1. A DPO loss summed over the micro-batches
    without dividing by their count would train on 2x (4x) the gradient and log 2x (4x) the loss."""
    split = runs[micro_batch]
    ran = json.loads((split / "summary.json").read_text())["split"]
    assert (ran["micro_batch"], ran["grad_accum"], ran["how"]) == (micro_batch, 4 // micro_batch, "asked")
    assert_same_step(split, runs[4], 0)


@pytest.mark.parametrize("micro_batch", [2, 1])
def test_a_short_last_dpo_step_weighs_each_pair_alike_not_each_micro_batch(runs, micro_batch):
    """The last step, 3 pairs: at 2 x 2 its micro-batches hold 2 pairs and 1, at 1 x 4 it has 3 of its 4.
    Its loss must be the mean over its 3 pairs, as the written 4 x 1 computes it in one batch; a mean of
    the two micro-batches' means gives the lone pair the weight of two (dividing by 4 micro-batches, each
    pair 3/4 of its weight). The adapter after both steps is the written split's."""
    split = runs[micro_batch]
    assert_same_step(split, runs[4], 1)
    assert_same_adapter(split, runs[4], relative=SAME_SUMS)


def test_a_dpo_step_on_two_ranks_is_the_step_of_one_rank_with_the_whole_batch(runs, tiny, tmp_path):
    """DDP averages the ranks' gradients: each rank's micro-batch must weigh its pairs' share of the step's
    pairs summed over all ranks, times the ranks, or 2 ranks of 2 pairs train on half (or twice) the
    gradient of one rank of 4. The first, full step against the written 4 x 1 on one process (the short
    last step differs by design: its last round is filled up with the epoch's first pair)."""
    pairs = pairs_file(tmp_path, PAIRS)
    job = dpo_job(tiny, tmp_path / "2-ranks", pairs, micro_batch=2, batch_size=2)
    assert [rank["outcome"] for rank in run_ranks(job, 2)] == ["completed", "completed"]
    summary = json.loads((tmp_path / "2-ranks" / "summary.json").read_text())
    assert (summary["world_size"], summary["split"]["micro_batch"]) == (2, 2)
    assert_same_step(tmp_path / "2-ranks", runs[4], 0)
