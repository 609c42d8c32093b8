"""Preflight's GPU memory estimate (train/memory.py) against what a step really holds.

The measurements are real steps of real (small, random-weight) models on this CPU, held as a bf16 GPU holds
them, with the allocator's peak read from torch.profiler (bench/preflight_memory.py, whose helpers these are):
an estimate must cover what a measurement shows."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from bench import preflight_memory as bench

LLAMA = bench.ROOT / "models" / "tiny-llama" / "config.json"
SMALL = {"from": LLAMA, "hidden_size": 64, "intermediate_size": 128}
FULL_LM_HEAD = {"modules_to_save": ["lm_head"], "allow_full_modules": True, "max_trainable_percent": 100}
# name → (kind, config changes, adapter, batch, length, gradient checkpointing[, grad_accum[, answer tokens]])
CASES = {
    "large vocabulary": ("causal", SMALL | {"vocab_size": 32000}, {}, 4, 128, False),
    # Logits only at the 16 answer tokens of each 128 (train/loss.py): the step's logits shrink 8x.
    "large vocabulary, prompt-heavy": ("causal", SMALL | {"vocab_size": 32000}, {}, 4, 128, False, 1, 16),
    # Checkpointing keeps each layer's input once and recomputes one layer at a time (each counted once).
    "checkpointed, 4 layers": (
        "causal",
        SMALL | {"vocab_size": 8000, "num_hidden_layers": 4},
        {},
        4,
        128,
        True,
    ),
    "full lm_head in fp32": ("causal", SMALL | {"vocab_size": 8000}, FULL_LM_HEAD, 2, 64, False),
    # The second micro-batch's backward finds every gradient (the lm_head copy's too) already there.
    "full lm_head, accumulating": ("causal", SMALL | {"vocab_size": 8000}, FULL_LM_HEAD, 2, 64, False, 2),
    "qlora": (
        "causal",
        SMALL | {"vocab_size": 8000, "hidden_size": 256, "intermediate_size": 512},
        {"method": "qlora"},
        2,
        64,
        False,
    ),
    "seq2seq": ("seq2seq", {"from": bench.ROOT / "models" / "tiny-t5" / "config.json"}, {}, 8, 64, False),
}


def case_job(tmp_path: Path, name: str):
    """(job, length, answer tokens per example or None)."""
    kind, changes, adapter, batch, length, checkpointing, *more = CASES[name]
    accum, answer = (more + [1, None])[:2]
    modules = bench.T5_TARGETS if kind == "seq2seq" else bench.ALL_LINEAR
    folder = bench.model_folder(tmp_path, "model", changes, kind)
    adapter = {"rank": 8, "target_modules": modules} | adapter
    return bench.bench_job(folder, kind, adapter, batch, checkpointing, accum), length, answer


def estimate(job, length: int, targets: int | None = None):
    from train.memory_figures import measure_memory

    shape = {
        "targets": targets,
        "batch_size": job.train.batch_size,
        "max_length": length,
        "max_target_length": length,
        "gradient_checkpointing": job.train.gradient_checkpointing,
        "grad_accum": job.train.grad_accum,
    }
    return measure_memory(job, shape, None)


@pytest.fixture(scope="module")
def measured_cases(tmp_path_factory) -> dict:
    """name → (estimate, measured bytes): each case's model built, estimated and measured once."""
    found = {}
    for name in CASES:
        job, length, answer = case_job(tmp_path_factory.mktemp(name.replace(" ", "-").replace(",", "")), name)
        found[name] = estimate(job, length, answer), bench.measured(job, length, answer)
    return found


@pytest.mark.parametrize("name", CASES)
@pytest.mark.slow
def test_the_estimate_covers_the_whole_training_step_not_only_what_the_forward_saves(name, measured_cases):
    """Weights, trainable state and the step's own peak (the loss's fp32 logits and log-softmax, the
    backward's logits-sized gradients, autocast's copies) against the allocator's peak over forward, loss,
    backward and the AdamW step: within 15%, never under by more than 5%."""
    from train.memory import GB

    predicted, actual = measured_cases[name]
    step = (predicted.weights_gb + predicted.trainable_state_gb + predicted.activations_gb) * GB
    assert -0.05 <= step / actual["train"] - 1 <= 0.15, (name, step, actual)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.slow
def test_the_in_training_eval_at_twice_the_batch_is_estimated(name, measured_cases):
    from train.memory import CUDA_RESERVE_GB, EVAL_BATCH_FACTOR, GB

    predicted, actual = measured_cases[name]
    assert predicted.eval_batch_size == EVAL_BATCH_FACTOR * CASES[name][3]
    step = (predicted.eval_gb - CUDA_RESERVE_GB) * GB
    assert -0.05 <= step / actual["eval"] - 1 <= 0.15, (name, step, actual)
    assert predicted.total_gb == max(predicted.train_gb, predicted.eval_gb)


@pytest.mark.parametrize("double_quant", [True, False])
def test_qlora_weights_are_counted_as_held_fp32_upcasts_and_4bit_constants(double_quant, tmp_path):
    """prepare_model_for_kbit_training holds embeddings, lm_head and norms in fp32 (not the load dtype),
    and a 4-bit weight's constants depend on double quantization: to the byte, as bitsandbytes holds them."""
    kind, changes, adapter, batch, length, _ = CASES["qlora"]
    folder = bench.model_folder(tmp_path, "model", changes, kind)
    adapter = {"rank": 8, "target_modules": "all-linear", "method": "qlora", "double_quant": double_quant}
    job = bench.bench_job(folder, kind, adapter, batch, False)
    held = bench.held_bytes(bench.weight_tensors(bench.real_model(job), trainable=False))
    from train.memory import GB

    assert estimate(job, length).weights_gb * GB == pytest.approx(held, rel=1e-6)


def test_memory_is_in_decimal_gb_as_cluster_yaml_and_nvml_readings_are():
    """One unit: an "80 GB" H100 written as gpu_mem_gb: 80 must not be filled by a step of 79.9 GiB
    (85.8 GB), and preflight's figures compare with the GPU readings status shows (train/gpu_use.py)."""
    from core.preflight import JobPreflight
    from slurm.planning.preflight import refusals
    from train import gpu_use, memory

    assert memory.GB == gpu_use.GB == 10**9
    step = 79.9 * 2**30 / memory.GB  # 79.9 GiB
    result = JobPreflight("e/s", 1.0, 1, 100, {}, 100.0, memory_gb=step, gpu_mem_gb=80, fits=False)
    result.memory = {"train_gb": step}
    [problem] = refusals(result, "e.yaml")
    assert "needs about 85.8 GB per GPU, over the 80 GB" in problem.message
    assert "GB = 10^9 bytes" in problem.message


def test_preflight_evaluates_at_the_batch_the_trainer_evaluates_at(tiny, tmp_path):
    from tests.train_helpers import make_job, sql_data
    from train.memory import EVAL_BATCH_FACTOR
    from train.recipe import StageRecipe

    job = make_job(tiny, tmp_path / "run", data=sql_data(eval_split="dev"), eval_every_epochs=1, batch_size=3)
    recipe = StageRecipe(job, threading.Event())
    recipe.setup()
    assert recipe.training_arguments().per_device_eval_batch_size == EVAL_BATCH_FACTOR * 3


@pytest.mark.slow
def test_a_job_whose_eval_step_does_not_fit_is_refused_naming_the_eval(tmp_path):
    """A logits-heavy job: its training step fits, its in-training eval (twice the batch) does not."""
    from slurm.planning.preflight import refusals
    from train.preflight import preflight_job

    kind, changes, _, batch, length, _ = CASES["large vocabulary"]
    folder = bench.model_folder(tmp_path, "model", changes, kind)
    job = bench.bench_job(folder, kind, {"rank": 8, "target_modules": "all-linear"}, batch, False)
    job = job.model_copy(update={"data": job.data.model_copy(update={"max_length": length})})
    auto = job
    job = written(job, batch)  # the batch as written (micro_batch: auto would choose one that fits)
    memory = preflight_job(job, None).memory
    assert memory["eval_gb"] > memory["train_gb"]  # the case this test is about
    gpu = round((memory["train_gb"] + memory["eval_gb"]) / 2, 6)
    result = preflight_job(job, gpu)
    assert result.fits is False and result.largest_batch < batch
    [problem] = refusals(result, "e.yaml")
    assert (
        f"its in-training eval (batch {2 * batch}, twice the training batch) needs about" in problem.message
    )
    chosen = preflight_job(auto, gpu)  # auto: a smaller micro-batch with more accumulation, admitted
    assert chosen.fits and chosen.split["micro_batch"] < batch
    assert chosen.split["micro_batch"] * chosen.split["grad_accum"] == batch


def written(job, micro_batch: int):
    """The job with its micro-batch as written (train.micro_batch: N), judged as it is."""
    return job.model_copy(update={"train": job.train.model_copy(update={"micro_batch": micro_batch})})


def qwen_7b(tmp_path: Path) -> Path:
    """Qwen2.5-7B's config.json (its published shapes)."""
    config = json.loads((bench.QWEN.parent / "config.json").read_text()) | {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_window_layers": 28,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.slow
def test_a_7b_job_with_qwens_vocabulary_at_4x2048_is_not_admitted_on_an_80_gb_gpu(tmp_path):
    """Its logits alone are 4 × 2048 × 152k: the loss's fp32 copy, log-softmax and gradients are tens of GB
    beyond what the forward saves. Before: admitted, then out of memory after its queue wait."""
    from train.preflight import preflight_job

    job = bench.bench_job(qwen_7b(tmp_path), "causal", {"rank": 16, "target_modules": "all-linear"}, 4, False)
    job = job.model_copy(update={"data": job.data.model_copy(update={"max_length": 2048})})
    result = preflight_job(written(job, 4), 80)
    assert result.fits is False and result.memory["train_gb"] > 80
    # micro_batch: auto admits it at a micro-batch that fits, the effective batch kept
    chosen = preflight_job(job, 80)
    assert chosen.fits and chosen.memory["train_gb"] <= 80
    assert (chosen.split["micro_batch"], chosen.split["grad_accum"]) in ((2, 2), (1, 4))


@pytest.mark.slow
def test_qlora_7b_weights_count_what_prepare_model_for_kbit_training_holds(tmp_path):
    """Qwen2.5-7B under QLoRA: embeddings and lm_head (2 × 545M) in fp32, 6.5B 4-bit weights with their
    double-quantized constants, norms and biases in fp32: 7.7 GB (7.2 GiB), not 5.5 GB (5.12 GiB)."""
    job = bench.bench_job(qwen_7b(tmp_path), "causal", {"method": "qlora", "rank": 16}, 1, False)
    weights = estimate(job, 64).weights_gb
    assert 7.6 < weights < 7.8, weights


@pytest.mark.slow
def test_a_dpo_step_is_estimated_as_two_sequences_per_pair_with_the_reference_forward(tiny, tmp_path):
    """TRL's own DPO step (chosen and rejected as one batch of 8 sequences, the reference forward while the
    policy's activations are alive, the backward) on 4 pairs of 64 tokens with 16-token answers, measured
    (bench/preflight_memory.py measured_preference), against preflight's estimate of a DPO stage: within
    15%, never under by more than 5%. Counted as an SFT step of 4 examples, it was well under."""
    from train.memory import CUDA_RESERVE_GB, GB

    folder = bench.model_folder(tmp_path, "model", {"from": LLAMA}, "causal")
    job = bench.preference_job(
        bench.bench_job(folder, "causal", {"rank": 8, "target_modules": "all-linear"}, 4, False)
    )
    predicted, actual = bench.estimated(job, 64, 16), bench.measured_preference(job, 64, 16)
    assert -0.05 <= predicted["train"] / actual["train"] - 1 <= 0.15, (predicted, actual)
    as_sft = estimate(
        job.model_copy(update={"train": job.train.model_copy(update={"method": "sft"})}), 64, 16
    )
    assert (as_sft.train_gb - CUDA_RESERVE_GB) * GB < 0.9 * actual["train"]  # the gap this closes


@pytest.mark.slow
def test_preflight_judges_a_dpo_stage_at_its_pairs_lengths_instead_of_refusing_its_data(tiny, tmp_path):
    """Before: preflight counted a pair's labels, which pairs do not have ("Column 'labels' doesn't
    exist"): the stage's data read as refused and its memory was never judged."""
    from tests.train_helpers import SQL, make_job
    from train.preflight import preflight_job

    data = {"train": str(SQL / "pairs-train.jsonl"), "format": "preference"}
    job = make_job(tiny, tmp_path / "run", data=data, method="dpo", dpo={"reference": "base"})
    result = preflight_job(job, None)
    assert result.data_refused is None and result.labelled_tokens is None
    assert result.step_lengths["targets"] < result.step_lengths["max_length"]  # the longer answer's
    assert result.memory["trainable_state_gb"] > 0 and result.memory_gb > 1.0  # judged, reserve included
    # reference: previous holds the adapter's frozen fp32 copy besides: 4 bytes per trainable parameter
    previous = job.model_copy(
        update={"train": job.train.model_copy(update={"dpo": {"reference": "previous"}})}
    )
    previous = previous.model_validate(previous.model_dump())
    extra = preflight_job(previous, None).memory["weights_gb"] - result.memory["weights_gb"]
    assert extra == pytest.approx(4 * result.trainable_params / 1e9, rel=1e-9)


# GRPO: eight-head attention over 4 layers and a small vocabulary, so that a generation's KV cache counts
KV_HEAVY = SMALL | {
    "num_hidden_layers": 4,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 16,
}
GRPO_PROMPT, GRPO_COMPLETION = 16, 48  # tokens


def grpo_case(tmp_path: Path, micro, prompts: int = 8, generations: int = 8, beta: float = 0.0):
    """A GRPO stage of `prompts` x `generations` completions a step, in micro-batches of `micro` of them."""
    folder = bench.model_folder(tmp_path, "model", KV_HEAVY, "causal")
    job = bench.bench_job(folder, "causal", {"rank": 8, "target_modules": "all-linear"}, 1, False)
    return bench.grpo_job(job, prompts, generations, micro, GRPO_COMPLETION, beta)


def grpo_estimate(job, micro: int):
    from train.grpo_data import as_completions
    from train.memory_figures import measure_memory

    train = job.train
    completions = train.batch_size * train.reward_objective.num_generations
    shape = {
        "targets": GRPO_COMPLETION,
        "batch_size": micro,
        "max_length": GRPO_PROMPT + GRPO_COMPLETION,
        "max_target_length": GRPO_COMPLETION,
        "gradient_checkpointing": False,
        "grad_accum": completions // micro,
    }
    return measure_memory(as_completions(written(job, micro)), shape, None)


@pytest.mark.slow
def test_a_grpo_generation_holds_the_kv_cache_of_all_the_steps_completions_whatever_the_micro_batch(tmp_path):
    """A GRPO step samples all its completions at once (train/grpo.py sampled_completions): the generation's
    line counts the step's 64 sequences at micro-batches of 1 and of 16 alike, and holds at least their KV
    cache at full length, by hand: 2 (keys and values) x 4 layers x 8 heads x 16 dims x (16 + 48) tokens x 64
    sequences x 2 bytes (bf16) = 8.4 MB. Before, a GRPO step was judged by its training micro-batches only."""
    from train.memory import GB

    job = grpo_case(tmp_path, 1)
    small, large = grpo_estimate(job, 1), grpo_estimate(job, 16)
    assert small.generation_sequences == large.generation_sequences == 8 * 8
    assert small.generation_gb == large.generation_gb and small.train_gb < large.train_gb
    cache = 2 * 4 * 8 * 16 * (GRPO_PROMPT + GRPO_COMPLETION) * 64 * 2
    assert cache <= small.generation_activations_gb * GB <= 1.25 * cache  # the cache is most of it
    assert small.total_gb == small.generation_gb  # at micro-batches of 1, the generation is the peak


@pytest.mark.slow
def test_micro_batch_auto_splits_a_grpo_step_to_fit_and_refuses_a_generation_that_cannot(tmp_path):
    """`micro_batch: auto` on a GRPO stage chooses among micro-batches of completions that divide the step's
    64 (its job chooses with the same figures: train/recipe.py fresh_split over GrpoRecipe.split_job); no
    micro-batch helps a GPU that cannot hold the generation, refused naming it."""
    from core.split import DoesNotFit, refuse_unless_fits, resolve, usable_gb
    from train.grpo_data import as_completions
    from train.memory_figures import split_figures

    view = as_completions(grpo_case(tmp_path, "auto"))
    lengths = {"max_length": GRPO_PROMPT + GRPO_COMPLETION, "max_target_length": GRPO_COMPLETION}
    figures = split_figures(view, lengths | {"targets": GRPO_COMPLETION}, None)
    between = (figures.peak_gb(8, False) + figures.peak_gb(16, False)) / 2
    split = resolve(view.train, figures, between / usable_gb(1.0))
    assert (split.micro_batch, split.grad_accum, split.gradient_checkpointing) == (8, 8, False)
    [generation] = [line.fixed_gb for line in figures.plain if line.per_example_gb == 0]
    too_small = resolve(view.train, figures, 0.99 * generation / usable_gb(1.0))
    with pytest.raises(DoesNotFit, match="GRPO stage's generation"):
        refuse_unless_fits(too_small)


@pytest.mark.slow
def test_a_grpo_step_is_estimated_with_its_generation_within_ten_percent(tmp_path):
    """TRL's own GRPO step (bench/preflight_memory.py measured_grpo: the generation of the step's 64
    completions at once, each run to 48 tokens, then 64 micro-batches of 1 and fused AdamW) against
    preflight's estimate: within 10 %, never under by more than 5 %. Judged by its training micro-batches
    alone, as before the generation was counted, it was well under."""
    job = grpo_case(tmp_path, 1)
    predicted, actual = bench.estimated_grpo(job, GRPO_PROMPT), bench.measured_grpo(job, GRPO_PROMPT)
    assert predicted["peak"] == "generation"
    assert -0.05 <= predicted["train"] / actual["train"] - 1 <= 0.10, (predicted, actual)
    assert predicted["training_only"] < 0.8 * actual["train"]  # the gap this closes


def test_an_elastic_grpo_stage_is_judged_by_the_generation_of_its_fewest_ranks(tmp_path):
    """`nodes: 1-2` keeps the global batch: on 1 node each rank accumulates twice the steps, and so
    generates twice the completions at once. Preflight judged the generation at the largest size (8 x 2 x 4
    = 64 completions a rank), where it is smallest; on the fewest ranks it is 128. A job that runs knows its
    ranks (train/recipe.py at_world_size): its own figure is its own accumulation's."""
    from train.grpo_data import as_completions
    from train.memory_figures import grpo_step
    from train.recipe import at_world_size

    job = grpo_case(tmp_path, "auto", prompts=8, generations=4)
    job = job.model_copy(update={"train": job.train.model_copy(update={"grad_accum": 2})})
    shape = {"max_length": GRPO_PROMPT + GRPO_COMPLETION}
    fixed = grpo_step(as_completions(job), shape)["generation"]["sequences"]
    elastic = job.model_copy(update={"global_ranks": 8, "fewest_ranks": 4})
    assert fixed == 8 * 2 * 4
    assert grpo_step(as_completions(elastic), shape)["generation"]["sequences"] == 2 * fixed
    on_four = at_world_size(elastic, 4)
    assert on_four.fewest_ranks is None and on_four.train.grad_accum == 4
    assert grpo_step(as_completions(on_four), shape)["generation"]["sequences"] == 2 * fixed
    assert grpo_step(as_completions(at_world_size(elastic, 8)), shape)["generation"]["sequences"] == fixed
