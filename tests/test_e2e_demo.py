"""The README's main job, for real: the demo experiments through real sbatch on the dev cluster, and the
same plan on the local backend. Tiny models, real transformers/peft training on CPU, real SQLite."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from submitit.core.utils import JobPaths

import launch
from core.speeds import read_eval_book
from tests.conftest import squeue_ids, write_cluster_yaml
from tests.helpers import DEMO_JOBS, demo_configs, record, slurm_id, wait_until
from tests.train_helpers import (
    assert_every_step_logged_once,
    assert_same_curve,
    logged_losses,
    tensorboard_losses,
)
from train.checkpoints import latest_valid_checkpoint, step_of

TOKEN = "hf_NotARealTokenForTheDemoJobs"


def imported_modules(log: str) -> set[str]:
    """The modules a process imported, from the lines PYTHONPROFILEIMPORTTIME makes it print."""
    return set(re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", log, flags=re.M))


def scontrol_dependency(job_id: str) -> str:
    out = subprocess.run(
        ["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True
    ).stdout
    return next(part for part in out.split() if part.startswith("Dependency="))


def check_outputs(tmp: Path) -> None:
    runs = tmp / "runs"
    for plan_id in DEMO_JOBS:
        assert (runs / plan_id / "DONE").is_file(), plan_id
    trained = ("sql-t5-lora/train", "sql-llama-qlora-curriculum/harder", "chain-second/train")
    for stage in (*trained, "shapes-vl-qlora-curriculum/shapes"):
        rows = [json.loads(line) for line in (runs / stage / "metrics.jsonl").read_text().splitlines()]
        losses = [r["loss"] for r in rows if "loss" in r]
        assert len(losses) >= 2 and losses[-1] < losses[0], (stage, losses)
        assert (runs / stage / "adapter" / "adapter_model.safetensors").is_file()
        # TensorBoard is on by default: its event files hold the same curve as metrics.jsonl.
        # A curriculum's later stage continues its experiment's step axis from where the previous ended.
        offset = json.loads((runs / stage / "summary.json").read_text())["step_offset"]
        assert_same_curve(tensorboard_losses(runs / stage), logged_losses(runs / stage, offset))
    # The GRPO stage continued the SFT adapter and logged its rewards, each completion's kept a few per step.
    grpo = runs / "sql-llama-sft-grpo" / "grpo"
    assert json.loads((grpo / "summary.json").read_text())["init_adapter"].endswith(
        "sql-llama-sft-grpo/sft/adapter"
    )
    rows = [json.loads(line) for line in (grpo / "metrics.jsonl").read_text().splitlines()]
    assert all("rewards/rouge_l/mean" in r and "frac_reward_zero_std" in r for r in rows if "loss" in r)
    assert (grpo / "completions.jsonl").stat().st_size > 0
    for experiment in ("sql-t5-lora", "sql-llama-qlora-curriculum", "chain-first", "chain-second"):
        results = json.loads((runs / experiment / "eval" / "results.json").read_text())
        assert 0.0 <= results["rouge_l"] <= 1.0 and 0.0 <= results["sql_error_rate"] <= 1.0
        assert results["n"] > 0
        assert (runs / experiment / "eval" / "predictions.jsonl").is_file()
    # The vision-language curriculum: stage 2 continued stage 1's adapter (with its processor), and the
    # eval job generated from the images with it.
    shapes = json.loads((runs / "shapes-vl-qlora-curriculum" / "shapes" / "summary.json").read_text())
    assert shapes["init_adapter"].endswith("shapes-vl-qlora-curriculum/colours/adapter")
    assert (runs / "shapes-vl-qlora-curriculum" / "shapes" / "adapter" / "processor_config.json").is_file()
    results = json.loads((runs / "shapes-vl-qlora-curriculum" / "eval" / "results.json").read_text())
    assert results["n"] == 24 and 0.0 <= results["exact_match"] <= 1.0 and results["adapter_changes_output"]
    predicted = (runs / "shapes-vl-qlora-curriculum" / "eval" / "predictions.jsonl").read_text().splitlines()
    assert all(json.loads(row)["image"].endswith(".png") for row in predicted)


def test_demo_on_the_dev_cluster(repo_root, tmp_path, slurm_cluster, tiny, capsys, monkeypatch):
    monkeypatch.chdir(repo_root)
    # sbatch hands the submitting shell's environment to the jobs; they run with their output masked.
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    config_dir = demo_configs(repo_root, tmp_path)
    assert launch.main(["--all", "--config-dir", str(config_dir), "--backend", "slurm"]) == 0

    # The dependencies SLURM holds are the plan's (checked while the children still wait).
    first_eval = slurm_id(tmp_path, "chain-first/eval")
    assert f"afterany:{first_eval}" in scontrol_dependency(slurm_id(tmp_path, "chain-second/train"))
    easy = slurm_id(tmp_path, "sql-llama-qlora-curriculum/easy")
    assert f"afterok:{easy}" in scontrol_dependency(slurm_id(tmp_path, "sql-llama-qlora-curriculum/harder"))

    # A real `scontrol requeue` of the DPO stage mid-run, at its first committed checkpoint (step 10 of
    # 30): the requeued job goes on from a checkpoint, every step logged once (the in-process test of
    # tests/test_preference.py holds the resumed adapter bit-identical to a straight run).
    dpo_dir, dpo_job = (
        tmp_path / "runs" / "sql-llama-sft-dpo" / "dpo",
        slurm_id(tmp_path, "sql-llama-sft-dpo/dpo"),
    )
    wait_until(
        lambda: latest_valid_checkpoint(dpo_dir / "checkpoints") and not (dpo_dir / "summary.json").exists(),
        "the DPO stage's first checkpoint",
        600,
    )
    subprocess.run(["scontrol", "requeue", dpo_job], check=True)

    # A second launch while jobs are queued submits nothing new, then waits for all of them.
    queued = squeue_ids(tmp_path)
    assert launch.main(["--all", "--config-dir", str(config_dir), "--backend", "slurm", "--wait"]) == 0
    assert "Nothing to submit" in capsys.readouterr().out
    check_outputs(tmp_path)
    dpo = json.loads((dpo_dir / "summary.json").read_text())
    assert slurm_id(tmp_path, "sql-llama-sft-dpo/dpo") == dpo_job  # the same SLURM job, its second run
    assert dpo["resumed_from"] is not None and step_of(Path(dpo["resumed_from"])) >= 10
    assert dpo["global_step"] == 30
    assert_every_step_logged_once(dpo_dir, 30, every=5)

    # Everything done: a third launch submits nothing either, and queues nothing.
    records = {p: (tmp_path / "runs" / p / "job.json").read_text() for p in DEMO_JOBS}
    before = squeue_ids(tmp_path)
    assert launch.main(["--all", "--config-dir", str(config_dir), "--backend", "slurm"]) == 0
    # Nothing new queued; a job that ended may still be leaving the queue (COMPLETING) when --wait returns.
    assert squeue_ids(tmp_path) <= before
    assert records == {p: (tmp_path / "runs" / p / "job.json").read_text() for p in DEMO_JOBS}
    assert queued  # the first launch really queued jobs

    capsys.readouterr()
    assert launch.main(["--report", "--config-dir", str(config_dir)]) == 0
    assert f"Curves: tensorboard --logdir {tmp_path / 'runs'}" in capsys.readouterr().out
    report = (tmp_path / "runs" / "report.md").read_text()
    # The base models, each scored once without adapter (base.yaml: eval.baseline): the T5, the tiny Llama
    # (chain-first and chain-second share it), the same 4-bit for the QLoRA curriculum, the VL model, the
    # tiny Llama on the SFT -> DPO demo's dev pairs. The chat experiment has none: the base has no
    # embeddings for the ChatML markers it adds as tokens.
    bases = sorted(p.parent.name for p in (tmp_path / "runs").glob("_base-*/eval/DONE"))
    assert len(bases) == 5, bases
    # 8 experiments (SFT -> GRPO's SFT stage scored too: eval.after_each_stage) and 5 bases
    assert report.count("| complete") == 8 + 1 + 5 and report.count("| base (no adapter)") == 5
    assert "T5-p" not in report  # SocratiQ baselines belong to another task than the demo's text-to-SQL
    assert (tmp_path / "runs" / "loss_curves.png").stat().st_size > 10_000

    logs = list((tmp_path / "logs").rglob("*_log.out"))  # one per job: stdout and stderr together
    assert len(logs) == len(DEMO_JOBS) + len(bases) and all(p.stat().st_size > 0 for p in logs)
    # hub_downloads: login (the default): every job ran offline, from what preflight had here.
    scripts = [p.read_text() for p in (tmp_path / "logs").rglob("*_submission.sh")]
    assert len(scripts) == len(DEMO_JOBS) + len(bases)
    assert all("export HF_HUB_OFFLINE=1\nexport HF_DATASETS_OFFLINE=1\n" in text for text in scripts)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert not [p for p in written if TOKEN.encode() in p.read_bytes()]


@pytest.mark.parametrize("experiments", [["chain-first", "chain-second"]])
@pytest.mark.slow
def test_demo_runs_locally_without_slurm(repo_root, tmp_path, tiny, monkeypatch, experiments, capsys):
    monkeypatch.chdir(repo_root)
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")  # every job lists what it imports, in its log
    config_dir = demo_configs(repo_root, tmp_path)
    # Two job slots: were `after:` (afterany) ignored, chain-second/train would start beside chain-first/train.
    write_cluster_yaml(config_dir.parent, tmp_path, local_parallel_jobs=2)
    assert launch.main(["--exp", *experiments, "--config-dir", str(config_dir), "--backend", "local"]) == 0
    # Every job completed here: the report is written without a second command, and its path printed.
    report = tmp_path / "runs" / "report.md"
    # Four jobs, and the one eval of their shared base model (base.yaml: eval.baseline).
    assert f"All 5 job(s) completed. Report: {report}" in capsys.readouterr().out
    assert "| chain-second | complete" in report.read_text()
    for plan_id in ("chain-first/train", "chain-first/eval", "chain-second/train", "chain-second/eval"):
        assert (tmp_path / "runs" / plan_id / "DONE").is_file()
        assert record(tmp_path, plan_id)["backend"] == "local"
    # afterany: the second experiment started after the first one's last job ended (its DONE, written as
    # that job's last act, is older than the second's submitted call, written when the launcher started it).
    # Nanosecond file times; the one-second `submitted_at` stamps could not tell the order apart.
    first_end = (tmp_path / "runs" / "chain-first" / "eval" / "DONE").stat().st_mtime_ns
    second_pid = record(tmp_path, "chain-second/train")["job_id"]
    second_call = JobPaths(tmp_path / "logs" / "chain-second" / "train", second_pid).submitted_pickle
    assert first_end < second_call.stat().st_mtime_ns

    # A LoRA job imports what its stage uses (train/libraries.py): not bitsandbytes (peft would load it, and
    # torch's compiler with it), TRL or the VL processor; an eval job not the training recipe either.
    logs = {}
    for job in ("train", "eval"):
        (log,) = (tmp_path / "logs" / "chain-first" / job).glob("*_log.out")  # one log: one job start
        logs[job] = log.read_text()
    for job, entry in (("train", "train.stage"), ("eval", "eval.job")):
        imported = imported_modules(logs[job])
        assert entry in imported  # the listing is there to read
        # A package's submodules are listed only when it loaded: the hidden one's failed import is listed too.
        loaded = {
            m for m in imported if m.startswith(("bitsandbytes.", "trl.", "transformers.models.qwen2_5_vl."))
        }
        assert not loaded and "train.vl_processor" not in imported
    assert "train.recipe" not in imported_modules(logs["eval"])
    # The CPU it spent before its first step is logged and kept (bench/job_start.py reads it).
    summary = json.loads((tmp_path / "runs" / "chain-first" / "train" / "summary.json").read_text())
    assert summary["startup_cpu_s"] > 0 and "first step:" in logs["train"]

    # Each eval job timed itself into the speed book: the next plan estimates eval jobs from it.
    eval_rows = read_eval_book(tmp_path / "runs" / "speeds.jsonl")
    assert len(eval_rows) == 3 and all(r.decode_step_s > 0 and r.startup_s > 0 for r in eval_rows)

    # An eval job reruns by hand from its run folder alone, to the same scores (greedy decoding).
    eval_dir = tmp_path / "runs" / "chain-second" / "eval"
    first = json.loads((eval_dir / "results.json").read_text())
    (eval_dir / "results.json").unlink()
    rerun = subprocess.run(
        [sys.executable, "-m", "eval", "generate", str(eval_dir / "config.yaml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    again = json.loads((eval_dir / "results.json").read_text())
    assert {k: v for k, v in again.items() if k != "generation_s"} == {
        k: v for k, v in first.items() if k != "generation_s"
    }
