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

from tests.train_helpers import ROUNDING, SAME_SUMS, SQL, assert_same_adapter, make_job, read_jsonl
from train.stage import run_stage

pytestmark = pytest.mark.slow  # trains for seconds: make test-fast leaves it out


def pairs_file(folder: Path, count: int) -> str:
    path = folder / f"pairs-{count}.jsonl"
    path.write_text("".join((SQL / "pairs-train.jsonl").read_text().splitlines(keepends=True)[:count]))
    return str(path)


def dpo_run(tiny, run_dir: Path, pairs: str, micro_batch: int | str):
    """One epoch over `pairs` at an effective batch of 4 (batch_size 4 x grad_accum 1 as written)."""
    job = make_job(
        tiny,
        run_dir,
        data={"train": pairs, "format": "preference", "order": "file"},
        method="dpo",
        dpo={"beta": 0.1, "reference": "base"},
        max_steps=None,
        epochs=1,
        batch_size=4,
        grad_accum=1,
        micro_batch=micro_batch,
        learning_rate=5e-3,  # large enough that a wrongly weighted pair moves the adapter measurably
        precision="fp32",
    )
    assert run_stage(job) == "completed"
    return run_dir


def figures(run_dir: Path) -> dict:
    rows = [row for row in read_jsonl(run_dir / "metrics.jsonl") if "loss" in row]
    return {"loss": [r["loss"] for r in rows], "grad_norm": [r["grad_norm"] for r in rows]}


def assert_same_training(split: Path, written: Path) -> None:
    ran, wrote = figures(split), figures(written)
    print(split.name, json.dumps(ran), written.name, json.dumps(wrote))  # pytest -s: the figures
    assert len(ran["loss"]) == len(wrote["loss"]) == 2
    assert ran["loss"] == pytest.approx(wrote["loss"], rel=ROUNDING), (ran, wrote)
    assert ran["grad_norm"] == pytest.approx(wrote["grad_norm"], rel=ROUNDING), (ran, wrote)
    assert_same_adapter(split, written, relative=SAME_SUMS)


@pytest.fixture(scope="module")
def written(tiny, tmp_path_factory) -> dict[int, Path]:
    """The written split, 4 x 1, over 8 pairs (two full steps) and over 7 (the last step holds 3 pairs)."""
    folder = tmp_path_factory.mktemp("dpo-written")
    return {n: dpo_run(tiny, folder / f"4x1-{n}", pairs_file(folder, n), 4) for n in (8, 7)}


@pytest.mark.parametrize("micro_batch", [2, 1])
def test_a_dpo_step_split_into_micro_batches_is_not_scaled_by_its_accumulation_steps(
    tiny, tmp_path, written, micro_batch
):
    """8 pairs, 2 steps of 4: 2 x 2 and 1 x 4 against 4 x 1. A DPO loss summed over the micro-batches
    without dividing by their count would train on 2x (4x) the gradient and log 2x (4x) the loss."""
    split = dpo_run(tiny, tmp_path / f"{micro_batch}-8", pairs_file(tmp_path, 8), micro_batch)
    ran = json.loads((split / "summary.json").read_text())["split"]
    assert (ran["micro_batch"], ran["grad_accum"], ran["how"]) == (micro_batch, 4 // micro_batch, "asked")
    assert_same_training(split, written[8])


def test_a_short_last_dpo_step_weighs_each_pair_alike_not_each_micro_batch(tiny, tmp_path, written):
    """7 pairs at 2 x 2: the last step's micro-batches hold 2 pairs and 1. Its loss must be the mean over
    its 3 pairs, as the written 4 x 1 computes it in one batch; a mean of the two micro-batches' means
    gives the lone pair the weight of two."""
    split = dpo_run(tiny, tmp_path / "2x2-7", pairs_file(tmp_path, 7), 2)
    assert_same_training(split, written[7])
