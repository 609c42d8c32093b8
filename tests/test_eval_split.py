"""Issue 40 (4): no out-of-memory the memory model could have seen. The in-training eval step runs on the eval
set's batches, at twice the training micro-batch: judged at the training set's lengths (as before), a dev set
much longer than the training set chose a split whose first eval needs more memory than the GPU has, after a
whole eval period of training. Judged at the eval set's own lengths, in preflight and in the job, the split is
smaller. A split that fits nowhere fails at the job's start, with its figures.

The GPU is the test seam (train/device.py FAKE_FREE_GPU_GB, a GPU's free memory in GB) and cluster.yaml's
gpu_mem_gb for preflight; the memory model runs as always, on fake tensors."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from core.split import DoesNotFit, usable_gb
from tests.train_helpers import SQL, make_job, sql_data
from train.device import FAKE_FREE_GPU_GB

EFFECTIVE = 8  # 2 x 4 as written


def long_dev_set(folder: Path) -> str:
    """The demo's dev questions with their schema written out ten times: about 10x the training length."""
    rows = [json.loads(line) for line in (SQL / "dev.jsonl").read_text().splitlines()[:16]]
    path = folder / "long-dev.jsonl"
    path.write_text("".join(json.dumps(r | {"schema": " | ".join([r["schema"]] * 10)}) + "\n" for r in rows))
    return str(path)


def long_eval_job(tiny, tmp_path: Path):
    return make_job(
        tiny,
        tmp_path / "run",
        data=sql_data("easy") | {"eval": long_dev_set(tmp_path)},
        batch_size=2,
        grad_accum=4,
        max_steps=None,
        epochs=1,
        eval_every_epochs=1,
    )


def gpu_where_the_train_lengths_choose_the_whole_batch(job) -> float:
    """A GPU (GB) on which the eval step judged at the training set's lengths (the old choice) lets the
    whole effective batch through in one micro-batch: the peak at 8, as split_figures measures it (a line is
    exact at its far end), with the CUDA reserve, over the usable share."""
    from train import preflight

    tokenizer = preflight.tokenizer_or_reason(job)[0]
    _, config, with_tokens = preflight.trainable_of(job, tokenizer)
    train = preflight.lengths_of(job, job.data.train, with_tokens, config)[2]
    dev = preflight.lengths_of(job, job.data.eval, with_tokens, config)[2]
    assert dev.max_length >= 4 * train.max_length
    lengths = preflight.step_lengths("causal", train, None)
    shape = lengths | {"batch_size": EFFECTIVE, "gradient_checkpointing": False, "grad_accum": 2}
    from train.memory_figures import estimate_for

    old = estimate_for(job, shape, tokenizer)
    return old.total_gb / usable_gb(1.0) * 1.001


@pytest.mark.slow  # the memory model over a long dev set, and the job's own setup: about 10 s of CPU
def test_a_dev_set_longer_than_the_train_set_is_given_the_smaller_split_in_the_job_and_in_preflight(
    tiny, tmp_path, monkeypatch
):
    from train.preflight import preflight_job
    from train.recipe import StageRecipe

    job = long_eval_job(tiny, tmp_path)
    gpu_gb = gpu_where_the_train_lengths_choose_the_whole_batch(job)
    monkeypatch.setenv(FAKE_FREE_GPU_GB, str(gpu_gb))
    recipe = StageRecipe(job, threading.Event())
    recipe.setup()
    assert recipe.split.micro_batch < EFFECTIVE and recipe.split.fits, recipe.split
    assert recipe.trainer.args.per_device_eval_batch_size == 2 * recipe.split.micro_batch

    result = preflight_job(job, gpu_gb)  # the login node's judgement: the same choice
    # The same choice; the job also records the world size it chose for (preflight plans for none).
    assert result.split == {**recipe.split.as_json(), "world_size": None}
    assert result.step_lengths["eval_max_length"] >= 4 * result.step_lengths["max_length"]
    assert result.fits and result.memory["eval_gb"] <= gpu_gb

    monkeypatch.setenv(FAKE_FREE_GPU_GB, "0.0001")  # nothing fits: not even 1 with checkpointing
    job = job.model_copy(update={"run_dir": str(tmp_path / "nowhere")})
    with pytest.raises(DoesNotFit, match=r"micro 1 x accum 8, checkpointing: step .* GB where 0\.00 GB"):
        StageRecipe(job, threading.Event()).setup()
    assert not (tmp_path / "nowhere" / "split.json").exists()  # a later start chooses afresh
