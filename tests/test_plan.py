"""The plan is data: jobs, dependencies and hashes can be checked without submitting anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slurm.experiments import load_experiments, parse_overrides
from slurm.plan import build_plan
from slurm.profile import load_profile

EXPERIMENTS = Path(__file__).resolve().parent.parent / "configs" / "experiments"


def plan_for(overrides: list[str] | None = None, names: list[str] | None = None, folder: Path = EXPERIMENTS):
    profile, _ = load_profile(folder)
    return build_plan(load_experiments(folder, profile, parse_overrides(overrides or []), names), profile)


def test_shipped_experiments_plan_stages_evals_and_chains():
    plan = plan_for()
    ids = [j.id for j in plan.jobs]
    for name in ("flan-t5-small-qg", "flan-t5-base-qg", "t5-base-qg", "t5-small-sql"):
        assert f"{name}/train" in ids and f"{name}/eval" in ids
    edges = set(plan.edges())
    assert ("qwen-curriculum3/part1", "qwen-curriculum3/part2", "afterok") in edges
    assert ("qwen-curriculum3/part2", "qwen-curriculum3/part3", "afterok") in edges
    assert ("qwen-curriculum3/part3", "qwen-curriculum3/eval", "afterok") in edges
    assert ("qwen-random/eval", "qwen-sequential/train", "afterany") in edges
    # every dependency points backwards: the plan can be submitted in order
    position = {job_id: i for i, job_id in enumerate(ids)}
    assert all(position[a] < position[b] for a, b, _ in plan.edges())


def test_a_stage_starts_from_the_previous_stage_adapter():
    plan = plan_for(names=["qwen-curriculum2"])
    part1, part2 = plan.job("qwen-curriculum2/part1"), plan.job("qwen-curriculum2/part2")
    assert part1.spec.init_adapter is None
    assert part2.spec.init_adapter == f"{part1.run_dir}/adapter"
    assert part2.spec.train.learning_rate == pytest.approx(1e-4)  # the stage's own change
    assert part1.spec.train.learning_rate == pytest.approx(2e-4)  # inherited
    assert plan.job("qwen-curriculum2/eval").spec.adapter_dir == f"{part2.run_dir}/adapter"


def test_a_changed_stage_changes_the_hash_of_what_starts_from_it_only():
    before = {j.id: j.config_hash for j in plan_for(names=["qwen-curriculum2", "qwen-random"]).jobs}
    after = {
        j.id: j.config_hash
        for j in plan_for(["adapter.dropout=0.1"], names=["qwen-curriculum2", "qwen-random"]).jobs
    }
    assert all(before[k] != after[k] for k in before)  # an override applies to every selected experiment
    lr_only = {j.id: j.config_hash for j in plan_for(["train.seed=3"], names=["qwen-curriculum2"]).jobs}
    assert lr_only["qwen-curriculum2/part2"] != before["qwen-curriculum2/part2"]
    assert plan_for(names=["qwen-random"]).job("qwen-random/train").config_hash == before["qwen-random/train"]


def test_eval_after_each_stage_adds_intermediate_evals():
    plan = plan_for(["eval.after_each_stage=true"], names=["qwen-curriculum3"])
    ids = [j.id for j in plan.jobs]
    assert ids == [
        "qwen-curriculum3/part1",
        "qwen-curriculum3/eval-part1",
        "qwen-curriculum3/part2",
        "qwen-curriculum3/eval-part2",
        "qwen-curriculum3/part3",
        "qwen-curriculum3/eval",
    ]


def test_dry_run_imports_no_torch(repo_root):
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "launch.py", "--all", "--dry-run"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        check=True,
    )
    imported = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines() if "|" in line}
    assert "slurm" in imported and "pydantic" in imported  # the measurement itself works
    assert not imported & {"torch", "transformers", "peft", "datasets", "bitsandbytes"}
    assert "qwen-sequential/train" in done.stdout
