"""A preference stage (train/preference.py): TRL's real DPOTrainer on the tiny causal model, after a short SFT
stage. The trap peers fall into (LLaMA-Factory #8974: DPO on an SFT LoRA reports loss 0, accuracy 1 from the
first step, its reference silently the policy's own adapter or the base): at the first step, before any update,
the policy is the SFT adapter, and the reference is what `train.dpo.reference` says, checked against
log-probabilities computed here by hand."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch

from tests.train_helpers import SQL, StopAfter, assert_same_adapter, make_job, one_torch_thread, read_jsonl
from train.checkpoints import latest_valid_checkpoint, step_of
from train.stage import run_stage

BETA = 0.1
PAIRS = 8  # one batch: the first step's logged means are over exactly these pairs


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module", params=["lora", "qlora"])
def sft_stage(request, tiny, tmp_path_factory) -> tuple[str, Path, Path]:
    """(adapter method, the SFT adapter of a 3-step SFT stage on the demo SQL, a file of PAIRS demo pairs)."""
    folder = tmp_path_factory.mktemp(f"sft-{request.param}")
    assert run_stage(make_job(tiny, folder / "sft", adapter={"method": request.param})) == "completed"
    pairs = folder / "pairs.jsonl"
    pairs.write_text("".join((SQL / "pairs-train.jsonl").read_text().splitlines(keepends=True)[:PAIRS]))
    return request.param, folder / "sft" / "adapter", pairs


def dpo_job(tiny, run_dir: Path, sft_stage, reference: str, **train):
    method, adapter, pairs = sft_stage
    job = make_job(
        tiny,
        run_dir,
        adapter={"method": method},
        data={"train": str(pairs), "format": "preference", "order": "file"},
        method="dpo",
        dpo={"beta": BETA, "reference": reference},
        **({"max_steps": 1} | train),
    )
    return job.model_copy(update={"init_adapter": str(adapter)})


def answer_logps(job) -> dict[str, list[float]]:
    """Summed log-probabilities of each pair's chosen and rejected answer tokens, computed here from the
    model's logits: with the SFT adapter (`sft_*`) and with adapters disabled (`base_*`)."""
    from core.examples import read_jsonl as read_pairs
    from train.device import current
    from train.model import load_trained
    from train.pairs import encode_pair

    placement = current(job.train.precision)
    model, tokenizer = load_trained(
        job.model, job.init_adapter, job.adapter, placement=placement, data=job.data
    )
    model.eval()
    found = {f"{model_}_{side}": [] for model_ in ("sft", "base") for side in ("chosen", "rejected")}
    for row in read_pairs(Path(job.data.train)):
        pair = encode_pair(tokenizer, row, job.data)
        for side in ("chosen", "rejected"):
            ids = pair["prompt_ids"] + pair[f"{side}_ids"]
            for name, adapters in (("sft", contextlib.nullcontext()), ("base", model.disable_adapter())):
                with torch.no_grad(), adapters:
                    logits = model(input_ids=torch.tensor([ids])).logits[0].float()
                logps = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
                found[f"{name}_{side}"].append(logps[len(pair["prompt_ids"]) - 1 :].sum().item())
    return found


@pytest.fixture(scope="module")
def by_hand(tiny, sft_stage, tmp_path_factory) -> dict[str, list[float]]:
    return answer_logps(dpo_job(tiny, tmp_path_factory.mktemp("by-hand"), sft_stage, "base"))


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def first_row(run_dir: Path) -> dict:
    rows = [row for row in read_jsonl(run_dir / "metrics.jsonl") if "loss" in row]
    assert rows[0]["step"] == 1
    return rows[0]


@pytest.fixture(scope="module")
def previous_run(tiny, sft_stage, tmp_path_factory) -> Path:
    """A DPO stage after the SFT one, reference: previous: its first step is the trap's step; LoRA's runs on
    to 3 steps for the curriculum and resume tests (QLoRA's 4-bit CPU kernels are slow: one step)."""
    run_dir = tmp_path_factory.mktemp("dpo-previous") / "dpo"
    steps = 3 if sft_stage[0] == "lora" else 1
    assert run_stage(dpo_job(tiny, run_dir, sft_stage, "previous", max_steps=steps)) == "completed"
    return run_dir


@pytest.mark.slow
def test_reference_previous_is_the_sft_adapter_so_the_first_dpo_loss_is_ln2(previous_run, by_hand):
    row = first_row(previous_run)
    assert abs(row["loss"] - math.log(2)) < 1e-3  # policy == reference: sigmoid(0)
    assert abs(row["rewards/margins"]) < 1e-5 and abs(row["rewards/chosen"]) < 1e-5  # 4-bit kernels: ~1e-6
    # ...and both are the SFT adapter, not the base (whose log-probs differ by about a nat here).
    assert row["logps/chosen"] == pytest.approx(mean(by_hand["sft_chosen"]), abs=1e-3)
    assert abs(mean(by_hand["sft_chosen"]) - mean(by_hand["base_chosen"])) > 0.1
    summary = json.loads((previous_run / "summary.json").read_text())
    assert (summary["method"], summary["reference"]) == ("dpo", "previous")
    assert not (previous_run / "adapter" / "ref").exists()  # the frozen copy is not saved as the adapter


@pytest.mark.slow
def test_reference_base_is_the_model_with_adapters_disabled_and_the_margin_is_the_sft_log_ratio(
    tiny, tmp_path, sft_stage, by_hand
):
    job = dpo_job(tiny, tmp_path / "dpo", sft_stage, "base")
    assert run_stage(job) == "completed"
    row = first_row(tmp_path / "dpo")
    reference_chosen = row["logps/chosen"] - row["rewards/chosen"] / BETA
    reference_rejected = row["logps/rejected"] - row["rewards/rejected"] / BETA
    assert reference_chosen == pytest.approx(mean(by_hand["base_chosen"]), abs=1e-3)
    assert reference_rejected == pytest.approx(mean(by_hand["base_rejected"]), abs=1e-3)
    ratios = [
        (sc - bc) - (sr - br)
        for sc, bc, sr, br in zip(
            by_hand["sft_chosen"],
            by_hand["base_chosen"],
            by_hand["sft_rejected"],
            by_hand["base_rejected"],
            strict=True,
        )
    ]
    assert row["rewards/margins"] == pytest.approx(BETA * mean(ratios), abs=1e-4)
    assert abs(row["rewards/chosen"]) > 1e-2  # the reference is not the policy's own adapter


def logged(run_dir: Path, key: str) -> list[float]:
    return [row[key] for row in read_jsonl(run_dir / "metrics.jsonl") if key in row]


@pytest.mark.slow
@pytest.mark.parametrize("sft_stage", ["lora"], indirect=True)
def test_dpo_after_sft_lowers_its_loss_and_raises_its_reward_accuracy_on_the_demo_pairs(previous_run):
    losses, accuracies = logged(previous_run, "loss"), logged(previous_run, "rewards/accuracies")
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.01, losses
    assert accuracies[-1] > accuracies[0], accuracies
    assert logged(previous_run, "rewards/margins")[-1] > 0


@pytest.mark.slow
@pytest.mark.parametrize("sft_stage", ["lora"], indirect=True)
def test_a_dpo_stage_stopped_mid_way_resumes_to_the_same_adapter(tiny, tmp_path, sft_stage, previous_run):
    straight, interrupted = previous_run, tmp_path / "interrupted"
    job = dpo_job(tiny, interrupted, sft_stage, "previous", max_steps=3)
    assert run_stage(job, StopAfter(1)) == "interrupted"
    assert step_of(latest_valid_checkpoint(interrupted / "checkpoints")) == 2
    assert run_stage(job) == "completed"

    assert_same_adapter(straight, interrupted)
    steps = [row["step"] for row in read_jsonl(interrupted / "metrics.jsonl") if "loss" in row]
    assert steps == [1, 2, 3]  # none lost, none twice
    assert logged(interrupted, "rewards/margins") == pytest.approx(
        logged(straight, "rewards/margins"), abs=1e-5
    )


def test_a_too_long_pair_keeps_its_answers_whole_and_loses_its_prompts_start_or_is_dropped():
    import datasets

    from train.pairs import fitted

    pairs = datasets.Dataset.from_dict(
        {
            "prompt_ids": [[1, 2, 3, 4, 5, 6], [1, 2], [7, 8]],
            "chosen_ids": [[10, 11], [12], [13] * 9],
            "rejected_ids": [[20, 21, 22], [23], [24]],
            "length": [9, 3, 11],
        }
    )
    kept, cut, dropped = fitted(pairs, 8)
    assert (cut, dropped) == (1, 1)
    assert kept["prompt_ids"] == [[2, 3, 4, 5, 6], [1, 2]]  # the question at the prompt's end stays
    assert kept["chosen_ids"] == [[10, 11], [12]] and kept["rejected_ids"] == [[20, 21, 22], [23]]
    assert kept["length"] == [8, 3]


def test_a_string_pair_is_tokenized_as_the_sft_stage_tokenizes_its_example(tiny):
    from transformers import AutoTokenizer

    from core.config import DataSpec
    from train import data as data_lib
    from train.pairs import encode_pair

    tokenizer = AutoTokenizer.from_pretrained(tiny["tiny-llama"])
    row = {
        "prompt": "how many customers | SQL: ",
        "chosen": "SELECT COUNT(*) FROM customers",
        "rejected": "SELECT 1",
    }
    pair = encode_pair(tokenizer, row, DataSpec(train="x.jsonl", format="preference"))
    sft = data_lib.encode(tokenizer, [row["prompt"]], [row["chosen"]], "causal")
    assert pair["prompt_ids"] + pair["chosen_ids"] == sft["input_ids"][0]
    assert [t for t in sft["labels"][0] if t != -100] == pair["chosen_ids"]  # the answer and its eos
    assert pair["rejected_ids"][-1] == tokenizer.eos_token_id


def test_preflight_counts_a_cut_pair_and_a_dropped_pair_apart_and_names_the_file_none_of_whose_pairs_fits():
    """L12: `cut at max_length` read 24 for 24 pairs of which 13 were dropped; a refusal caused by the eval
    pairs did not say it was the eval file."""
    import datasets

    from core.preflight import JobPreflight
    from slurm.watching.preflight_report import cut_cell
    from train.pairs import fitted

    found = JobPreflight("t/dpo", 1.0, 1, 100, {}, 100.0, truncated_inputs=11, dropped_examples=13)
    assert cut_cell(found) == "11, 13 dropped"
    assert cut_cell(JobPreflight("t/sft", 1.0, 1, 100, {}, 100.0, truncated_inputs=2)) == "2"
    long_answers = datasets.Dataset.from_dict(
        {"prompt_ids": [[1, 2]], "chosen_ids": [[3] * 9], "rejected_ids": [[4]], "length": [11]}
    )
    with pytest.raises(
        ValueError, match=r"^pairs-dev.jsonl: max_length 8 holds not even the answers of any pair"
    ):
        fitted(long_answers, 8, "pairs-dev.jsonl")
