"""core/split.py: the micro-batch, accumulation and checkpointing a job runs its effective batch with, on
hand-computed memory lines (GB = fixed + micro-batch x per example). Usable memory is the GPU's less 5 %
(HEADROOM): 40 GB → 38, 80 GB → 76."""

from __future__ import annotations

import pytest

from core.config import TrainSpec
from core.split import (
    HEADROOM,
    MemoryFigures,
    Split,
    StepLine,
    choose,
    divisors,
    kept_on_resume,
    resolve,
    usable_gb,
)
from train.device import split_memory_gb

# A 7B causal model under QLoRA at 4096 tokens (illustrative lines of its order): 4-bit weights, LoRA state
# and reserve ~6 GB; 2.1 GB of activations per example without checkpointing, 0.35 with; its eval at twice
# the batch: 1.2 GB per training example.
QLORA_7B = MemoryFigures(
    plain=(StepLine(6.0, 2.1), StepLine(5.5, 1.2)),
    checkpointed=(StepLine(6.0, 0.35), StepLine(5.5, 1.2)),
)
# A 0.5B LoRA in bf16 at ~256 tokens.
LORA_05B = MemoryFigures(plain=(StepLine(2.2, 1.1),), checkpointed=(StepLine(2.2, 0.3),))


def test_usable_memory_leaves_the_stated_headroom():
    assert HEADROOM == 0.05
    assert usable_gb(40) == pytest.approx(38.0)
    assert usable_gb(80) == pytest.approx(76.0)


def test_divisors_are_the_exact_splits_largest_first():
    assert divisors(12) == [12, 6, 4, 3, 2, 1]
    assert divisors(16) == [16, 8, 4, 2, 1]
    assert divisors(1) == [1]


def test_a_7b_qlora_at_1x16_on_40gb_takes_8x2_without_checkpointing():
    # 16: 6 + 16 x 2.1 = 39.6 > 38. 8: 6 + 16.8 = 22.8, eval 5.5 + 9.6 = 15.1: fits.
    split = choose(QLORA_7B, usable_gb(40), effective=16)
    assert (split.micro_batch, split.grad_accum, split.gradient_checkpointing) == (8, 2, False)
    assert split.peak_gb == pytest.approx(22.8)
    assert split.fits


def test_a_7b_qlora_at_1x16_on_80gb_takes_the_whole_effective_batch():
    # 16: train 39.6, eval 5.5 + 19.2 = 24.7: both under 76.
    split = choose(QLORA_7B, usable_gb(80), effective=16)
    assert (split.micro_batch, split.grad_accum, split.gradient_checkpointing) == (16, 1, False)
    assert split.peak_gb == pytest.approx(39.6)
    assert "micro 16 x accum 1, no checkpointing: step 39.6 of 76 GB" in split.describe()


def test_a_05b_lora_at_8x1_has_nothing_to_trade():
    split = choose(LORA_05B, usable_gb(80), effective=8)
    assert (split.micro_batch, split.grad_accum, split.gradient_checkpointing) == (8, 1, False)


def test_the_eval_step_can_be_what_limits_the_micro_batch():
    # Training alone fits 16 (2 + 16 x 1 = 18 ≤ 38); the eval at twice the batch does not (2 + 16 x 3 = 50):
    # 8 gives 2 + 24 = 26.
    figures = MemoryFigures(
        plain=(StepLine(2.0, 1.0), StepLine(2.0, 3.0)),
        checkpointed=(StepLine(2.0, 0.2), StepLine(2.0, 3.0)),
    )
    split = choose(figures, usable_gb(40), effective=16)
    assert (split.micro_batch, split.grad_accum, split.gradient_checkpointing) == (8, 2, False)


def test_checkpointing_only_when_not_even_one_fits_without_it():
    # Without: 37 + 1 x 2 = 39 > 38 at a micro-batch of 1. With: 20 + d x 2 ≤ 38 → d ≤ 9 → 8 of 16.
    figures = MemoryFigures(plain=(StepLine(37.0, 2.0),), checkpointed=(StepLine(20.0, 2.0),))
    split = choose(figures, usable_gb(40), effective=16)
    assert (split.micro_batch, split.grad_accum, split.gradient_checkpointing) == (8, 2, True)
    assert "not even 1 fits without" in split.reason


def test_nothing_fits_gives_one_with_checkpointing_marked_as_not_fitting():
    figures = MemoryFigures(plain=(StepLine(45.0, 2.0),), checkpointed=(StepLine(41.0, 2.0),))
    split = choose(figures, usable_gb(40), effective=16)
    assert (split.micro_batch, split.grad_accum, split.gradient_checkpointing, split.fits) == (
        1,
        16,
        True,
        False,
    )


def test_asked_checkpointing_stays_on():
    split = choose(LORA_05B, usable_gb(80), effective=8, checkpointing=True)
    assert (split.micro_batch, split.grad_accum, split.gradient_checkpointing) == (8, 1, True)


@pytest.mark.parametrize("effective", [1, 6, 16, 48])
@pytest.mark.parametrize("gpu", [8, 40, 80])
def test_the_effective_batch_is_never_raised_nor_lowered(effective, gpu):
    split = choose(QLORA_7B, usable_gb(gpu), effective)
    assert split.micro_batch * split.grad_accum == effective


def train(**keys) -> TrainSpec:
    return TrainSpec(**keys)


def test_a_cpu_keeps_the_users_split():
    split = resolve(
        train(batch_size=2, grad_accum=4), QLORA_7B, None, "on a CPU the split is the one written"
    )
    assert (split.micro_batch, split.grad_accum, split.how) == (2, 4, "as written")


def test_auto_on_a_gpu_chooses_and_an_asked_micro_batch_is_honoured_even_when_it_does_not_fit():
    spec = train(batch_size=1, grad_accum=16)
    assert resolve(spec, QLORA_7B, 40).micro_batch == 8
    asked = resolve(train(batch_size=1, grad_accum=16, micro_batch=16), QLORA_7B, 40)
    assert (asked.micro_batch, asked.grad_accum, asked.how, asked.fits) == (16, 1, "asked", False)


def test_a_micro_batch_that_does_not_divide_the_effective_batch_is_refused_with_the_ones_that_do():
    with pytest.raises(
        ValueError, match=r"micro_batch 3 does not divide .* = 8 .*use one of 1, 2, 4, 8, or auto"
    ):
        train(batch_size=2, grad_accum=4, micro_batch=3)


def test_ddp_ranks_choose_for_the_smallest_free_memory_and_a_rank_without_a_gpu_keeps_the_written_split():
    assert split_memory_gb([70.1, 33.0, 79.0]) == 33.0
    assert split_memory_gb([70.1, None]) is None
    # one decision: every rank computes it from the same gathered minimum
    per_rank = [resolve(train(batch_size=1, grad_accum=16), QLORA_7B, split_memory_gb([80.0, 40.0]))] * 2
    assert {(s.micro_batch, s.grad_accum) for s in per_rank} == {(8, 2)}


def test_a_split_survives_its_json_record():
    split = choose(QLORA_7B, usable_gb(40), effective=16)
    assert Split.from_json(split.as_json()) == split
    assert MemoryFigures.from_json(QLORA_7B.as_json()) == QLORA_7B


def test_the_step_may_fill_what_is_free_and_what_the_loaded_model_already_holds():
    """The split is chosen with the weights already on the GPU; the estimate counts them itself. Before:
    free memory alone, the weights counted twice. 80 GB card, 15 GB held by the model, 64 GB free."""
    from train.device import step_memory_gb

    assert step_memory_gb(64 * 10**9, 15 * 10**9) == pytest.approx(79.0)
    assert step_memory_gb(64 * 10**9, 0) == pytest.approx(64.0)


def recorded(micro: int, accum: int, world_size: int | None = 1) -> dict:
    record = Split(micro, accum, False, "auto", "the largest micro-batch that fits", world_size=world_size)
    return (
        record.as_json()
        if world_size is not None
        else {k: v for k, v in record.as_json().items() if k != "world_size"}
    )


def test_a_tampered_split_json_that_does_not_make_the_effective_batch_is_not_kept_on_resume():
    """Before: micro 3 x accum 1 in split.json on a 2 x 2 stage trained to the end with an effective batch
    of 3, COMPLETED, no warning."""
    kept, why = kept_on_resume(recorded(3, 1), effective=4, world_size=1)
    assert kept is None
    assert "micro 3 x accum 1 = 3" in why and "batch_size x grad_accum = 4" in why


def test_a_split_json_made_for_another_world_size_is_chosen_again_on_resume():
    kept, why = kept_on_resume(recorded(2, 2, world_size=2), effective=4, world_size=1)
    assert kept is None and "chosen for 2 rank(s) and the job now has 1" in why


@pytest.mark.parametrize("junk", [None, {"micro_batch": 2}, {**recorded(2, 2), "micro_batch": True}, [2, 2]])
def test_a_foreign_split_json_is_not_trusted_on_resume(junk):
    assert kept_on_resume(junk, effective=4, world_size=1)[0] is None


def test_a_matching_split_json_is_kept_on_resume_with_or_without_its_world_size():
    assert kept_on_resume(recorded(4, 1), effective=4, world_size=1)[0] == Split.from_json(recorded(4, 1))
    assert kept_on_resume(recorded(1, 4, world_size=None), effective=4, world_size=2)[0].micro_batch == 1


def test_a_split_json_asking_for_the_fused_loss_where_it_cannot_run_is_chosen_again_on_resume():
    """L7: `fused_loss: true` written into split.json (micro 2 x accum 2, a 4 x 1 stage) was kept on a CPU,
    and every retry failed with `No module named 'liger_kernel'`, the cause unnamed."""
    tampered = {**recorded(2, 2), "fused_loss": True}
    kept, why = kept_on_resume(tampered, effective=4, world_size=1, fused_possible=False)
    assert kept is None and "asks for the fused loss, which this job cannot run here" in why
    assert kept_on_resume(tampered, effective=4, world_size=1, fused_possible=True)[0].fused_loss is True
    assert kept_on_resume({**recorded(2, 2), "fused_loss": "yes"}, effective=4, world_size=1)[0] is None


def test_an_elastic_resume_at_another_world_size_says_so_not_that_the_split_misses_the_batch():
    """L11: after a 1 -> 2 requeue the log said `micro 4 x accum 2 = 8 does not make this stage's effective
    batch per rank`; the reason is the world size, whose change moves the per-rank batch of an elastic job."""
    kept, why = kept_on_resume(recorded(4, 2, world_size=1), effective=4, world_size=2)
    assert kept is None and why == "its split.json was chosen for 1 rank(s) and the job now has 2"
