"""Issue 49: a GRPO stage (train/grpo.py), TRL's real GRPOTrainer on the tiny causal model, fp32 on the CPU.

TRL's logged `loss` is ~0 on-policy with beta 0 (its ratio is 1 and the group advantages sum to 0), so these
tests look at gradients, parameters and rewards:
- one step's gradient equals the GRPO objective computed here by hand (plain torch on the log-probs of fixed
  completions, advantages per group, each accepted loss_type's normalisation);
- each accepted loss_type takes the same step whether the step's completions are one micro-batch or several;
- with beta > 0 the reference is the adapter the stage starts from: its KL at step 1 is 0;
- a stage stopped at a checkpoint and resumed samples the same completions and ends with the same adapter;
- a stage whose groups never vary stops with the message, at K steps;
- SFT -> GRPO through launch.py on the local backend, with rows base / SFT / GRPO.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

import launch
from tests import grpo_helpers
from tests.grpo_helpers import RIGHT, G
from tests.helpers import demo_configs
from tests.train_helpers import (
    SQL,
    StopAfter,
    adapter_tensors,
    assert_same_adapter,
    make_job,
    one_torch_thread,
    read_jsonl,
    run_ranks,
)
from train import recipe
from train.checkpoints import latest_valid_checkpoint, step_of
from train.grpo import GrpoRecipe, NoRewardVariance

pytestmark = pytest.mark.slow  # trains for seconds: make test-fast leaves it out
PROMPTS = 2  # per step


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_torch_thread():
        yield


def grpo_job(
    tiny,
    run_dir: Path,
    init_adapter: Path | None = None,
    grpo: dict | None = None,
    adapter: dict | None = None,
    **train,
):
    job = make_job(
        tiny,
        run_dir,
        adapter=adapter,
        data={
            "train": str(SQL / "easy.jsonl"),
            "input_field": "question",
            "target_field": "sql",
            "prompt_template": "{schema} | {question} | SQL: ",
        },
        method="grpo",
        grpo={"num_generations": G, "max_completion_length": 16, "rewards": [{"score": "exact_match"}]}
        | (grpo or {}),
        precision="fp32",
        learning_rate=5e-3,
        **({"max_steps": 1, "batch_size": PROMPTS} | train),
    )
    return job.model_copy(update={"init_adapter": str(init_adapter) if init_adapter else None})


class FixedCompletions(grpo_helpers.FixedCompletions):
    """The seam's fixed completions, with the model's own gradients of each step as the optimizer is about to
    take it, and those of the objective by hand."""

    def build_trainer(self):
        trainer = super().build_trainer()
        self.steps: list[tuple[dict, dict]] = []
        trainer.add_callback(GradientsAtTheStep(self))
        return trainer


class GradientsAtTheStep(TrainerCallback):
    """At each step, as the optimizer is about to take it (after clipping, before the update): the model's
    gradients, and those of the objective computed by hand on the same parameters and completions."""

    def __init__(self, recipe_: FixedCompletions):
        self.recipe = recipe_

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        taken = {n: p.grad.detach().clone() for n, p in params.items()}
        given = self.recipe.given[-1]
        grpo = self.recipe.job.train.reward_objective
        loss = by_hand(
            model, given, exact_rewards(self.recipe, given), grpo.loss_type, grpo.max_completion_length
        )
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        hand = {
            n: torch.zeros_like(p) if g is None else g
            for (n, p), g in zip(params.items(), grads, strict=True)
        }
        self.recipe.steps.append((taken, hand))


class SampledAndRecorded(GrpoRecipe):
    """Sampled completions (the real generation), recorded per step."""

    def completions_for(self, prompt_ids):
        out = super().completions_for(prompt_ids)
        self.given = [*getattr(self, "given", []), out]
        return out


def run(job, recipe_class, stop: threading.Event | None = None):
    """run_stage with `recipe_class`, returning (outcome, the recipe)."""
    made = {}

    class Kept(recipe_class):
        def setup(self):
            made["recipe"] = self
            super().setup()

    outcome = recipe.run_stage(job, stop, Kept)
    return outcome, made["recipe"]


# -- the objective by hand -----------------------------------------------------------------------------
def completion_logps(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Each completion token's log-probability given the prompt and the tokens before it (no padding)."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def by_hand(model, given, rewards: list[float], loss_type: str, max_completion_length: int):
    """The GRPO objective of one step (num_iterations 1, beta 0: on-policy, so the clipped ratio is 1 with
    the gradient of log p), from TRL's documentation of each loss_type:
    - advantage A_i = (r_i - mean of its group) / (unbiased std of its group + 1e-4);
    - per token: -A_i * exp(logp - logp.detach());
    - dapo: summed over every token of the step / the step's completion tokens;
      grpo: each completion's mean over its tokens, then the mean over the completions;
      dr_grpo: summed over every token / (completions x max_completion_length)."""
    prompts, completions = given
    r = torch.tensor(rewards).view(-1, G)
    advantages = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)
    terms = []
    for prompt, completion, advantage in zip(prompts, completions, advantages, strict=True):
        logp = completion_logps(model, prompt, completion)
        terms.append(-advantage * torch.exp(logp - logp.detach()))
    if loss_type == "dapo":
        return torch.cat(terms).sum() / sum(len(t) for t in terms)
    if loss_type == "grpo":
        return torch.stack([t.mean() for t in terms]).mean()
    return torch.cat(terms).sum() / (len(terms) * max_completion_length)


def exact_rewards(recipe_, given) -> list[float]:
    references = dict(zip(recipe_.train_set["prompt"], recipe_.train_set["reference"], strict=True))
    text_of = {tuple(ids): text for text, ids in recipe_.prompt_ids.items()}
    prompts, completions = given
    cleaned = recipe_.cleaned(completions)
    return [
        float(c.lower() == references[text_of[tuple(p)]].lower())
        for p, c in zip(prompts, cleaned, strict=True)
    ]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_one_grpo_step_is_the_gradient_of_the_objective_computed_by_hand(tiny, tmp_path, loss_type):
    outcome, ran = run(grpo_job(tiny, tmp_path / "run", grpo={"loss_type": loss_type}), FixedCompletions)
    assert outcome == "completed"
    (given,) = ran.given
    assert exact_rewards(ran, given) == ([1.0] * RIGHT + [0.0] * (G - RIGHT)) * PROMPTS
    row = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
    assert row["rewards/exact_match/mean"] == pytest.approx(
        RIGHT / G
    )  # the eval's exact_match, per completion
    assert row["frac_reward_zero_std"] == 0.0
    ((taken, hand),) = ran.steps
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in hand.values())).item()
    assert row["grad_norm"] == pytest.approx(norm, rel=1e-4)  # before clipping
    clip = min(1.0, 1.0 / (norm + 1e-6))  # max_grad_norm 1.0
    for name, gradient in hand.items():
        torch.testing.assert_close(taken[name], gradient * clip, rtol=1e-4, atol=1e-8)
    assert sum(int(g.abs().max() > 0) for g in hand.values()) >= len(hand) // 2  # B moves (A waits for B)


def test_a_qlora_grpo_stage_takes_the_objectives_step_over_its_4bit_layers(tiny, tmp_path):
    """QLoRA: the base held in 4 bits (bitsandbytes), the adapter trained in fp32 (TRL would cast a quantized
    model's trainable weights to bf16: train/grpo.py keeps them fp32); one step's gradients equal the
    objective computed by hand on the same quantized model, as LoRA's do."""
    from bitsandbytes.nn import Linear4bit

    job = grpo_job(tiny, tmp_path / "run", adapter={"method": "qlora"})
    outcome, ran = run(job, FixedCompletions)
    assert outcome == "completed"
    model = ran.trainer.model
    assert any(isinstance(module, Linear4bit) for module in model.modules())
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    ((taken, hand),) = ran.steps
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in hand.values())).item()
    clip = min(1.0, 1.0 / (norm + 1e-6))
    for name, gradient in hand.items():
        torch.testing.assert_close(taken[name], gradient * clip, rtol=1e-4, atol=1e-8)
    assert sum(int(g.abs().max() > 0) for g in hand.values()) >= len(hand) // 2


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_each_accepted_loss_takes_the_same_step_whatever_the_micro_batch_split(tiny, tmp_path, loss_type):
    whole = tmp_path / "whole"
    split = tmp_path / "split"
    grpo = {"loss_type": loss_type}
    assert (
        run(grpo_job(tiny, whole, grpo=grpo, max_steps=2, micro_batch=PROMPTS * G), FixedCompletions)[0]
        == "completed"
    )
    assert (
        run(grpo_job(tiny, split, grpo=grpo, max_steps=2, micro_batch=2), FixedCompletions)[0] == "completed"
    )
    assert json.loads((split / "split.json").read_text())["grad_accum"] == PROMPTS * G // 2
    assert_same_adapter(whole, split, relative=1e-5)
    assert adapter_tensors(whole).keys()


# -- the reference, resume, the no-variance stop ---------------------------------------------------------
@pytest.fixture(scope="module")
def sft_adapter(tiny, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sft")
    assert recipe.run_stage(make_job(tiny, folder / "sft")) == "completed"
    return folder / "sft" / "adapter"


def test_with_beta_the_reference_is_the_previous_adapter_so_the_kl_at_step_one_is_zero(
    tiny, tmp_path, sft_adapter
):
    grpo = {"beta": 0.04}
    assert run(grpo_job(tiny, tmp_path / "prev", sft_adapter, grpo=grpo), FixedCompletions)[0] == "completed"
    first = read_jsonl(tmp_path / "prev" / "metrics.jsonl")[0]
    assert abs(first["kl"]) < 1e-6
    summary = json.loads((tmp_path / "prev" / "summary.json").read_text())
    assert summary["reference"] == "previous"
    # Against the base model the SFT adapter is a real distance: the KL term is there to be measured.
    grpo_base = grpo | {"reference": "base"}
    assert (
        run(grpo_job(tiny, tmp_path / "base", sft_adapter, grpo=grpo_base), FixedCompletions)[0]
        == "completed"
    )
    assert read_jsonl(tmp_path / "base" / "metrics.jsonl")[0]["kl"] > 1e-4
    saved = json.loads((tmp_path / "prev" / "adapter" / "adapter_config.json").read_text())
    assert saved["r"] == 8  # the policy adapter, not TRL's frozen "ref" copy


def test_a_grpo_stage_stopped_at_a_checkpoint_resumes_to_the_same_completions_and_adapter(tiny, tmp_path):
    train = {"max_steps": 4, "save_every_steps": 2}
    grpo = {"temperature": 1.0, "max_completion_length": 8}
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    outcome, straight = run(grpo_job(tiny, straight_dir, grpo=grpo, **train), SampledAndRecorded)
    assert outcome == "completed" and len(straight.given) == 4
    outcome, first = run(grpo_job(tiny, resumed_dir, grpo=grpo, **train), SampledAndRecorded, StopAfter(1))
    assert outcome == "interrupted"
    assert step_of(latest_valid_checkpoint(resumed_dir / "checkpoints")) == 2
    outcome, second = run(grpo_job(tiny, resumed_dir, grpo=grpo, **train), SampledAndRecorded)
    assert outcome == "completed"
    assert first.given == straight.given[:2]
    assert second.given == straight.given[2:]  # the generation RNG is the checkpoint's
    assert_same_adapter(straight_dir, resumed_dir)
    assert [r["step"] for r in read_jsonl(resumed_dir / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4]
    # completions.jsonl: a few rows per step, each step's once (the stopped run's step 3 was forgotten)
    kept = [r["step"] for r in read_jsonl(resumed_dir / "completions.jsonl")]
    assert kept == [r["step"] for r in read_jsonl(straight_dir / "completions.jsonl")] == sorted(kept)
    assert set(kept) == {1, 2, 3, 4}


class AllAlike(GrpoRecipe):
    """Every completion of a group the same wrong query: no group ever has reward variance."""

    def completions_for(self, prompt_ids):
        eos = self.tokenizer.eos_token_id
        return [self.tokenizer("SELECT 1", add_special_tokens=False)["input_ids"] + [eos] for _ in prompt_ids]


def test_a_stage_whose_groups_never_vary_stops_at_k_steps_with_the_message(tiny, tmp_path):
    job = grpo_job(
        tiny, tmp_path / "run", grpo={"num_generations": 2}, max_steps=50, batch_size=4, micro_batch=8
    )
    with pytest.raises(
        NoRewardVariance, match="no completion group had reward variance in 12 steps: start from an SFT"
    ):
        run(job, AllAlike)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 13))  # the 12th logged, then the stop
    assert not (tmp_path / "run" / "adapter").exists() and not (tmp_path / "run" / "summary.json").exists()
    assert all(r["frac_reward_zero_std"] == 1.0 for r in rows if "loss" in r)


def test_sft_then_grpo_through_launch_on_the_local_backend(repo_root, tmp_path, tiny, monkeypatch, capsys):
    monkeypatch.chdir(repo_root)
    config_dir = demo_configs(repo_root, tmp_path)
    assert (
        launch.main(["--exp", "sql-llama-sft-grpo", "--config-dir", str(config_dir), "--backend", "local"])
        == 0
    )
    runs = tmp_path / "runs" / "sql-llama-sft-grpo"
    summary = json.loads((runs / "grpo" / "summary.json").read_text())
    assert summary["method"] == "grpo" and summary["init_adapter"].endswith("sql-llama-sft-grpo/sft/adapter")
    rows = [r for r in read_jsonl(runs / "grpo" / "metrics.jsonl") if "loss" in r]
    assert rows and all("rewards/rouge_l/mean" in r and "frac_reward_zero_std" in r for r in rows)
    assert all(0 <= r["completions/clipped_ratio"] <= 1 and "rewards/rouge_l/seconds" in r for r in rows)
    kept = read_jsonl(runs / "grpo" / "completions.jsonl")
    assert kept and set(kept[0]["rewards"]) == {"rouge_l", "sql_executes"}
    # Its speed-book row: the training's tokens/s and the sampling's seconds per decoding step, apart.
    from core.speeds import read_book

    (row,) = [r for r in read_book(tmp_path / "runs" / "speeds.jsonl") if r.objective == "grpo"]
    assert row.decode_step_s > 0 and row.decode_batch == 2 * 4 and row.tokens_per_s > 0
    report = (tmp_path / "runs" / "report.md").read_text()
    assert report.count("| sql-llama-sft-grpo") >= 2  # the SFT stage's row and the GRPO stage's
    assert "base (no adapter)" in report


class VariesAtFirst(AllAlike):
    """Groups of 2 that vary at the first step only (the reference, then a wrong query), alike after."""

    right, group = 1, 2

    def completions_for(self, prompt_ids):
        if self.trainer.state.global_step > 0:
            return super().completions_for(prompt_ids)
        return grpo_helpers.FixedCompletions.completions_for(self, prompt_ids)


def test_a_resumed_stage_remembers_that_a_group_varied_before_its_checkpoint(tiny, tmp_path):
    """Before the checkpoint kept it, a run resumed at step 2 forgot step 1's variance and stopped at K."""
    job = grpo_job(
        tiny,
        tmp_path / "run",
        grpo={"num_generations": 2},
        max_steps=14,
        batch_size=4,
        micro_batch=8,
        save_every_steps=2,
    )
    assert run(job, VariesAtFirst, StopAfter(1))[0] == "interrupted"
    assert run(job, VariesAtFirst)[0] == "completed"  # 14 steps, 13 of them without variance: K is 12
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert [r["frac_reward_zero_std"] for r in rows][:2] == [0.0, 1.0] and len(rows) == 14


def test_a_max_completion_length_shorter_than_a_reference_is_refused_by_preflight(
    repo_root, tmp_path, tiny, monkeypatch, capsys
):
    monkeypatch.chdir(repo_root)
    config_dir = demo_configs(repo_root, tmp_path)
    config = config_dir / "sql-llama-sft-grpo.yaml"
    config.write_text(config.read_text().replace("max_completion_length: 48", "max_completion_length: 12"))
    assert launch.main(["--exp", "sql-llama-sft-grpo", "--config-dir", str(config_dir), "--preflight"]) == 2
    err = capsys.readouterr().err
    assert (
        "sql-llama-sft-grpo/grpo: the job would fail at its start: train.grpo.max_completion_length 12 cannot"
        in err
    )
    assert "raise it to at least" in err and "Traceback" not in err


def test_a_grpo_step_on_two_ranks_is_the_step_of_one_process_with_the_whole_batch(tiny, tmp_path):
    """Each rank generates (here: is given) its own prompts' completions; the rewards' groups are whole on
    each rank, the advantages are of the gathered rewards, the loss is over the step's tokens on every rank."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert (
        run(grpo_job(tiny, one, max_steps=2, batch_size=2 * PROMPTS), grpo_helpers.FixedCompletions)[0]
        == "completed"
    )
    ranks = run_ranks(grpo_job(tiny, two, max_steps=2), env={"DDP_WORKER_RECIPE": "fixed-completions"})
    assert [r["outcome"] for r in ranks] == ["completed", "completed"]
    assert json.loads((two / "summary.json").read_text())["world_size"] == 2
    assert_same_adapter(one, two, relative=1e-4)


def test_preflight_judges_a_grpo_step_over_its_completions_not_its_prompts(
    repo_root, tmp_path, tiny, monkeypatch, capsys
):
    """Before, the memory model read a GRPO stage's batch_size (prompts) as the sequences of its step: G
    times too few. It judges batch_size x num_generations sequences of the longest prompt + completion."""
    import json as json_

    monkeypatch.chdir(repo_root)
    config_dir = demo_configs(repo_root, tmp_path)
    assert (
        launch.main(["--exp", "sql-llama-sft-grpo", "--config-dir", str(config_dir), "--preflight", "--json"])
        == 0
    )
    found = {r["job"]: r for r in json_.loads(capsys.readouterr().out)}
    grpo, sft = found["sql-llama-sft-grpo/grpo"], found["sql-llama-sft-grpo/sft"]
    assert grpo["split"]["micro_batch"] == 2 * 4 and grpo["split"]["grad_accum"] == 1
    assert grpo["step_lengths"]["max_length"] == grpo["longest_example"] == grpo["max_length"]
    assert (
        grpo["max_length"] == max(grpo["length_percentiles"]["inputs"])
        and grpo["examples"] == sft["examples"]
    )
    assert grpo["tokens_per_epoch"] == 4 * sum(  # each prompt's 4 sequences of prompt + 48 completion tokens
        len(ids) + 48 for ids in prompt_ids_of(tiny)
    )


def prompt_ids_of(tiny) -> list[list[int]]:
    from core.config import DataSpec, ModelSpec
    from train.grpo_data import prompts_as_trained
    from train.model import load_tokenizer

    data = DataSpec(
        train=str(SQL / "easy.jsonl"),
        input_field="question",
        target_field="sql",
        prompt_template="{schema} | {question} | SQL: ",
    )
    tokenizer = load_tokenizer(
        str(tiny["tiny-llama"]), ModelSpec(name_or_path=str(tiny["tiny-llama"]), kind="causal"), data
    )
    return prompts_as_trained(data.train, data, tokenizer, "causal")[2]
