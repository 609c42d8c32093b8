"""Issue 29 (1): the effective batch is the contract, the micro-batch is the trainer's to choose. Real CPU
training on the tiny models: the choice is wired through to what the Trainer runs, recorded, kept on a
requeue, and changes nothing the run computes.

On a CPU `micro_batch: auto` keeps the written split, so the wiring is driven through the test seam that
stands in for torch.cuda.mem_get_info (train/device.py FAKE_FREE_GPU_GB): the job then chooses as a GPU with
that much free memory would, and still trains on the CPU.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

import launch
from tests.conftest import write_cluster_yaml
from tests.train_helpers import SAME_SUMS, StopAfter, assert_same_adapter, make_job, sql_data
from train.device import FAKE_FREE_GPU_GB
from train.recipe import StageRecipe, run_stage

pytestmark = pytest.mark.slow  # trains for seconds: make test-fast leaves it out


def job(tiny, run_dir: Path, kind: str, **train):
    return make_job(
        tiny,
        run_dir,
        kind,
        data=sql_data("easy", order="shuffle"),
        max_steps=None,
        epochs=1,
        precision="fp32",  # the splits then differ by float rounding only
        **({"batch_size": 2, "grad_accum": 4} | train),
    )


def train_recipe(job_) -> StageRecipe:
    recipe = StageRecipe(job_, threading.Event())
    recipe.setup()
    return recipe


@pytest.mark.parametrize("kind", ["seq2seq", "causal"])
def test_an_asked_micro_batch_of_8_trains_the_adapter_of_the_users_2x4(tiny, tmp_path, kind):
    written = tmp_path / "2x4"
    assert run_stage(job(tiny, written, kind, micro_batch=2)) == "completed"
    whole = tmp_path / "8x1"
    assert run_stage(job(tiny, whole, kind, micro_batch=8)) == "completed"
    ran = json.loads((whole / "summary.json").read_text())["split"]
    assert (ran["micro_batch"], ran["grad_accum"], ran["how"]) == (8, 1, "asked")
    assert_same_adapter(whole, written, relative=SAME_SUMS)


@pytest.mark.parametrize("kind", ["seq2seq", "causal"])
def test_auto_with_a_gpus_free_memory_runs_the_trainer_at_the_chosen_split_not_the_written_one(
    tiny, tmp_path, kind, monkeypatch
):
    written = tmp_path / "written"
    assert run_stage(job(tiny, written, kind, micro_batch=2)) == "completed"
    monkeypatch.setenv(FAKE_FREE_GPU_GB, "80")  # the seam: an 80 GB GPU's free memory, training on the CPU
    chosen = tmp_path / "auto"
    recipe = train_recipe(job(tiny, chosen, kind))
    args = recipe.trainer.args
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (8, 1)
    assert args.per_device_eval_batch_size == 16
    assert not args.activation_checkpointing
    assert recipe.train() == "completed"
    recipe.save()
    summary = json.loads((chosen / "summary.json").read_text())
    assert summary["split"]["how"] == "auto" and summary["split"]["micro_batch"] == 8
    assert summary["split"]["usable_gb"] == pytest.approx(76.0)
    assert json.loads((chosen / "split.json").read_text()) == summary["split"]
    assert summary["global_step"] == json.loads((written / "summary.json").read_text())["global_step"]
    assert_same_adapter(chosen, written, relative=SAME_SUMS)


def test_a_requeued_run_keeps_the_split_it_started_with(tiny, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv(FAKE_FREE_GPU_GB, "80")
    assert run_stage(job(tiny, run_dir, "causal", save_every_steps=1), StopAfter(2)) == "interrupted"
    assert json.loads((run_dir / "split.json").read_text())["micro_batch"] == 8
    monkeypatch.setenv(FAKE_FREE_GPU_GB, "0.0001")  # the requeued job lands on a GPU with far less free
    recipe = train_recipe(job(tiny, run_dir, "causal", save_every_steps=1))
    assert recipe.resume_from is not None
    args = recipe.trainer.args
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (8, 1)
    assert not args.activation_checkpointing


def test_a_tampered_split_json_is_chosen_again_on_resume_not_trained_with(
    tiny, tmp_path, monkeypatch, caplog
):
    """Before: micro 3 x accum 1 written into a 2 x 4 stage's split.json was trusted on the requeue, and the
    run trained on with an effective batch of 3."""
    run_dir = tmp_path / "run"
    monkeypatch.setenv(FAKE_FREE_GPU_GB, "80")
    assert run_stage(job(tiny, run_dir, "causal", save_every_steps=1), StopAfter(2)) == "interrupted"
    tampered = json.loads((run_dir / "split.json").read_text()) | {"micro_batch": 3, "grad_accum": 1}
    (run_dir / "split.json").write_text(json.dumps(tampered))
    recipe = train_recipe(job(tiny, run_dir, "causal", save_every_steps=1))
    assert recipe.resume_from is not None
    args = recipe.trainer.args
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 8
    assert "micro 3 x accum 1 = 3" in caplog.text and "chosen again" in caplog.text
    assert json.loads((run_dir / "split.json").read_text())["micro_batch"] == 8


def plan_json(argv: list[str], capsys) -> dict:
    assert launch.main([*argv, "--dry-run", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_dry_run_shows_the_split_preflight_chose_and_estimates_at_it(
    repo_root, tiny, tmp_path, monkeypatch, capsys
):
    """Before a preflight the dry run (torch-free) says `micro auto`; preflight chooses on cluster.yaml's
    gpu_mem_gb and records it; the next dry run shows that split and estimates the job's speed at it."""
    monkeypatch.chdir(repo_root)
    monkeypatch.setenv("LORA_CACHE_DIR", str(tmp_path / "cache"))
    shutil.copytree(repo_root / "configs", tmp_path / "configs")
    demo = tmp_path / "configs" / "demo"
    write_cluster_yaml(demo, tmp_path, gpu_mem_gb=80)
    argv = ["--exp", "sql-t5-lora", "--config-dir", str(demo), "train.batch_size=2", "train.grad_accum=4"]
    train = next(j for j in plan_json(argv, capsys)["jobs"] if j["id"] == "sql-t5-lora/train")
    assert train["estimate"]["split"] is None
    assert launch.main([*argv, "--dry-run"]) == 0
    assert "8 (2x4x1, micro auto)" in capsys.readouterr().out

    assert launch.main([*argv, "--preflight", "--json"]) == 0
    [result] = json.loads(capsys.readouterr().out)
    assert (result["split"]["micro_batch"], result["split"]["grad_accum"], result["split"]["how"]) == (
        8,
        1,
        "auto",
    )

    train = next(j for j in plan_json(argv, capsys)["jobs"] if j["id"] == "sql-t5-lora/train")
    assert train["estimate"]["split"] == "8x1"
    assert launch.main([*argv, "--dry-run"]) == 0
    assert "8 (2x4x1, micro 8x1)" in capsys.readouterr().out
    # another GPU size is another choice: not taken from this record
    write_cluster_yaml(demo, tmp_path, gpu_mem_gb=40)
    train = next(j for j in plan_json(argv, capsys)["jobs"] if j["id"] == "sql-t5-lora/train")
    assert train["estimate"]["split"] is None


def test_the_split_is_not_part_of_a_stages_identity(repo_root, tmp_path, monkeypatch, capsys):
    """Changing micro_batch changes how a stage runs, not what it computes: the same config hash (so a
    finished stage stays finished), and no 'changed' key for the relaunch to refuse."""
    from core.config import what_it_computes

    monkeypatch.chdir(repo_root)
    argv = ["--exp", "sql-t5-lora", "--config-dir", str(repo_root / "configs" / "demo")]
    hashes = []
    for split in ("train.micro_batch=auto", "train.micro_batch=4", "train.micro_batch=8"):
        jobs = {j["id"]: j for j in plan_json([*argv, split], capsys)["jobs"]}
        hashes.append((jobs["sql-t5-lora/train"]["config_hash"], jobs["sql-t5-lora/eval"]["config_hash"]))
        spec = jobs["sql-t5-lora/train"]["spec"]
        assert "micro_batch" in spec["train"] and "micro_batch" not in what_it_computes(spec)["train"]
    assert len(set(hashes)) == 1
