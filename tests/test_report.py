"""The report reads run folders only: a finished experiment gets its numbers, a failed one a row that says so."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import submitit
from submitit.core.utils import DelayedSubmission, JobPaths

import launch
from core.job_records import job_records, record_job
from core.runs import BaseEval, ReportInput
from core.states import State
from eval.report import write_report
from slurm.cluster.profile import load_profile
from slurm.planning.experiments import load_experiments
from slurm.planning.pack import unit_of
from slurm.planning.plan import build_plan
from slurm.queueing.lanes import PackJob
from slurm.watching.reporting import job_runs
from slurm.watching.status import parse_sacct_allocations
from slurm.watching.usage import plan_usage, usage_of
from tests.conftest import write_cluster_yaml

# sacct's own figures for jobs 1-7 of the dev cluster (see tests/test_status_parse.py): 1 held 2 GPUs
# for 3 s; 2 one GPU for 6 + 7 + 30 s (requeued twice); 3 no GPU for 2 s; 4 one GPU for 19 s
# (cancelled); 7 four GPUs for 4 s.
USAGE = (Path(__file__).parent / "fixtures" / "sacct" / "usage-22.05.8.txt").read_text()

EXPERIMENT = """\
name: {name}
model: {{name_or_path: org/model, kind: causal}}
data: {{train: {data}, eval: {data}, input_field: q, target_field: a}}
stages: [{{name: one}}, {{name: two}}]
eval: {{metrics: [exact_match, bleu]}}
resources: {{mem_gb: 4, cpus: 1}}
"""


def plan_of(tmp_path: Path, *names: str, **resources: str):
    """The plan of EXPERIMENTs named `names` (and of `name=RESOURCES`, with those resources), over one
    tiny data file, with runs and logs under tmp_path."""
    configs = tmp_path / "configs"
    configs.mkdir()
    write_cluster_yaml(configs, tmp_path)
    data = tmp_path / "d.jsonl"
    data.write_text('{"q": "x", "a": "y"}\n')
    for name, own in [(name, None) for name in names] + list(resources.items()):
        text = EXPERIMENT.format(name=name, data=data)
        if own:
            text = text.replace("resources: {mem_gb: 4, cpus: 1}", f"resources: {own}")
        (configs / f"{name}.yaml").write_text(text)
    profile, _ = load_profile(configs)
    return build_plan(load_experiments(configs, profile), profile)


def write_stage(run_dir: Path, losses: list[float], runtime_s: float, eval_loss: float) -> None:
    run_dir.mkdir(parents=True)
    rows = [{"step": 5 * (i + 1), "loss": loss} for i, loss in enumerate(losses)]
    rows.append({"step": 5 * len(losses), "eval_loss": eval_loss})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "lo')
    summary = {"trainable_percent": 1.25, "train_runtime_s": runtime_s, "best_eval_loss": eval_loss}
    (run_dir / "summary.json").write_text(json.dumps(summary))


def test_a_rows_best_eval_loss_is_its_scored_stages_and_each_stages_is_listed_not_their_minimum(tmp_path):
    """Before: an SFT -> DPO row's best_eval_loss was the minimum over its stages, the SFT stage's
    cross-entropy beside a DPO loss, read as the DPO stage's."""
    plan = plan_of(tmp_path, "good")
    runs = tmp_path / "runs"
    write_stage(runs / "good" / "one", [3.0, 2.5], 60, 0.9)
    write_stage(runs / "good" / "two", [0.7, 0.6], 60, 1.6)
    write_report(ReportInput(job_runs(plan), runs))
    row = next(r for r in csv.DictReader((runs / "report.csv").open()) if r["experiment"] == "good")
    assert float(row["best_eval_loss"]) == 1.6 and row["stage_eval_losses"] == "one 0.9 → two 1.6"


def test_report_rows_plots_and_a_failed_experiment(tmp_path, repo_root):
    plan = plan_of(tmp_path, "good", "broken")
    runs = tmp_path / "runs"
    write_stage(runs / "good" / "one", [3.0, 2.5, 2.0], 60, 2.2)
    write_stage(runs / "good" / "two", [1.9, 1.5], 120, 1.6)
    (runs / "good" / "eval").mkdir()
    results = {"exact_match": 0.25, "bleu": 0.5, "adapter_changes_output": True, "n": 4}
    (runs / "good" / "eval" / "results.json").write_text(json.dumps(results))
    states = {"broken/one": "FAILED", "broken/two": "BLOCKED", "broken/eval": "BLOCKED"}

    tasks = {"good": "socratiq-qg", "broken": None}
    written = write_report(
        ReportInput(job_runs(plan, states), runs, repo_root / "configs" / "baselines.yaml", tasks)
    )

    rows = {r["experiment"]: r for r in csv.DictReader((runs / "report.csv").open())}
    assert rows["good"]["status"] == "complete"
    assert rows["good"]["stages"] == "one → two"
    assert float(rows["good"]["exact_match"]) == 0.25 and float(rows["good"]["train_min"]) == 3.0
    assert float(rows["good"]["best_eval_loss"]) == 1.6
    assert float(rows["good"]["gpu_hours"]) == 0.05  # 180 s on one GPU
    assert rows["broken"]["status"] == "missing: one FAILED, two BLOCKED, eval BLOCKED"
    assert rows["T5-p"]["status"] == "published" and float(rows["T5-p"]["rouge_l"]) == 0.211
    markdown = (runs / "report.md").read_text()
    assert "| broken | missing: one FAILED" in markdown and "Ang et al. 2023" in markdown
    # The published numbers sit in the socratiq-qg table, not beside the experiment without that task.
    other, socratiq = markdown.split("## Task: socratiq-qg")
    assert "## Task: (no task set)" in other
    assert "| T5-p | published" in socratiq and "| good |" in socratiq
    assert "| broken |" in other and "T5-p" not in other
    pictures = [p for p in written if p.suffix == ".png"]
    assert runs / "loss_curves.png" in pictures and runs / "good" / "loss.png" in pictures
    assert all(p.stat().st_size > 5_000 for p in pictures)
    assert not (runs / "broken" / "loss.png").exists()


def test_report_shows_which_split_was_scored(tmp_path):
    # Today the report has no such column: scores on the training data read like eval scores.
    plan = plan_of(tmp_path, "held-out", "on-train")
    runs = tmp_path / "runs"
    for name, split in (("held-out", "eval"), ("on-train", "train")):
        (runs / name / "eval").mkdir(parents=True)
        results = {"n": 1, "exact_match": 1.0, "split": split, "source": str(tmp_path / "d.jsonl")}
        (runs / name / "eval" / "results.json").write_text(json.dumps(results))

    write_report(ReportInput(job_runs(plan), runs))

    rows = {r["experiment"]: r for r in csv.DictReader((runs / "report.csv").open())}
    assert rows["held-out"]["eval_split"] == "eval"
    assert rows["on-train"]["eval_split"] == "TRAIN (scored on training data)"
    assert "| TRAIN (scored on training data) |" in (runs / "report.md").read_text()


def test_without_a_scheduler_record_a_stage_counts_its_trainer_clock_and_a_cpu_run_nothing(
    tmp_path, repo_root
):
    plan_of(tmp_path, cpu="{gpus: 0, mem_gb: 4, cpus: 1}", four="{gpus: 4, mem_gb: 4, cpus: 1}")
    runs = tmp_path / "runs"
    for name in ("cpu", "four"):
        write_stage(runs / name / "one", [3.0], 1800, 2.2)
        write_stage(runs / name / "two", [2.0], 1800, 1.6)
    # The cost per GPU-hour comes from cluster.yaml, through the launcher's --report.
    write_cluster_yaml(tmp_path / "configs", tmp_path, gpu_hour_cost=2.5)
    shutil.copy(repo_root / "configs" / "baselines.yaml", tmp_path / "configs")
    assert launch.main(["--config-dir", str(tmp_path / "configs"), "--report"]) == 0
    rows = {r["experiment"]: r for r in csv.DictReader((runs / "report.csv").open())}
    assert (float(rows["cpu"]["gpu_hours"]), float(rows["four"]["gpu_hours"])) == (0.0, 4.0)
    assert (float(rows["cpu"]["cost"]), float(rows["four"]["cost"])) == (0.0, 10.0)
    report = (runs / "report.md").read_text()
    assert "All jobs: 4.00 GPU-hours allocated" in report and "; cost 10.00 (at 2.5 per GPU-hour)." in report
    # A stage that found no GPU (summary.json device "cpu": a local run on a CPU machine) held none.
    summary = runs / "four" / "one" / "summary.json"
    summary.write_text(json.dumps(json.loads(summary.read_text()) | {"device": "cpu"}))
    assert launch.main(["--config-dir", str(tmp_path / "configs"), "--report"]) == 0
    assert "All jobs: 2.00 GPU-hours allocated" in (runs / "report.md").read_text()
    clock = "Trainer clock (no scheduler record)"
    assert (
        f"| four/one | PLANNED | 0 | – | – | 30 | 0 | {clock} | – | – |" in (runs / "report.md").read_text()
    )
    # Per job: where the GPU-hours went (each stage 30 minutes on its own GPUs; never submitted here),
    # and that they are a lower bound.
    assert f"| four/two | PLANNED | 4 | – | – | 30 | 2 | {clock} | – | – |" in report
    assert f"| cpu/one | PLANNED | 0 | – | – | 30 | 0 | {clock} | – | – |" in report
    assert "4 job(s) counted from the Trainer's clock, a lower bound" in report


def test_baselines_are_shown_only_beside_experiments_on_their_task(tmp_path, repo_root):
    import pytest

    from eval.report import BaselinesError

    plan = plan_of(tmp_path, "sql")
    runs = tmp_path / "runs"
    baselines = tmp_path / "baselines.yaml"
    baselines.write_text(
        "sets:\n"
        "  - {task: socratiq-qg, source: Ang, baselines: [{name: T5-p, rouge_l: 0.211}]}\n"
        "  - {task: spider, source: Yu, baselines: [{name: Seq2SQL, exact_match: 0.1}]}\n"
    )
    write_report(ReportInput(job_runs(plan), runs, baselines, {"sql": "spider"}))
    rows = {r["experiment"]: r for r in csv.DictReader((runs / "report.csv").open())}
    assert set(rows) == {"sql", "Seq2SQL"} and rows["Seq2SQL"]["task"] == "spider"
    assert "Ang" not in (runs / "report.md").read_text()

    baselines.write_text("source: Ang\nbaselines: [{name: T5-p, rouge_l: 0.211}]\n")
    with pytest.raises(BaselinesError, match="set 1 has no `task`"):
        write_report(ReportInput(job_runs(plan), runs, baselines, {"sql": "spider"}))


def test_a_pipe_in_a_baselines_name_does_not_move_its_number_into_another_column(tmp_path):
    """Before: `T5 | base` ended its cell, and its exact_match was shown under the next column."""
    plan = plan_of(tmp_path, "sql")
    runs = tmp_path / "runs"
    baselines = tmp_path / "baselines.yaml"
    baselines.write_text("task: spider\nbaselines: [{name: 'T5 | base', exact_match: 0.123}]\n")
    write_report(ReportInput(job_runs(plan), runs, baselines, {"sql": "spider"}))
    lines = (runs / "report.md").read_text().splitlines()
    head = next(line for line in lines if line.startswith("| experiment"))
    row = next(line for line in lines if "T5" in line)
    cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
    columns = [c.strip() for c in head.split("|")[1:-1]]
    assert len(cells) == len(columns), row
    assert cells[columns.index("experiment")] == r"T5 \| base"
    assert cells[columns.index("exact_match")] == "0.123"


def test_an_experiments_description_is_in_the_report_as_configs_readme_says(tmp_path):
    plan = plan_of(tmp_path, "sql")
    runs = tmp_path / "runs"
    write_report(ReportInput(job_runs(plan), runs, descriptions={"sql": "T5-small on the shop\nSQL data"}))
    assert "- **sql**: T5-small on the shop SQL data" in (runs / "report.md").read_text()


def test_our_bertscore_f1_fills_the_bertscore_column_of_the_published_baselines(tmp_path, repo_root):
    # results.json says bertscore_f1; baselines.yaml (as published tables) says bertscore. Two columns
    # would put our number where no baseline can be compared with it.
    plan = plan_of(tmp_path, "qg")
    runs = tmp_path / "runs"
    (runs / "qg" / "eval").mkdir(parents=True)
    (runs / "qg" / "eval" / "results.json").write_text(
        json.dumps({"n": 3, "bleu": 0.02, "bertscore_f1": 0.7})
    )
    write_report(
        ReportInput(job_runs(plan), runs, repo_root / "configs" / "baselines.yaml", {"qg": "socratiq-qg"})
    )
    reader = csv.DictReader((runs / "report.csv").open())
    rows = {r["experiment"]: r for r in reader}
    assert "bertscore_f1" not in reader.fieldnames
    assert float(rows["qg"]["bertscore"]) == 0.7 and float(rows["T5-p"]["bertscore"]) == 0.632


def test_mean_gpu_utilisation_and_non_pad_tokens_per_second_per_experiment(tmp_path):
    plan = plan_of(tmp_path, "gpu", "cpu")
    runs = tmp_path / "runs"
    # gpu: stage one's rows 80 and 90 %, stage two's 70 % and a row before the first sample (no field);
    # 36,000 + 54,000 non-pad tokens in 1,800 + 1,800 s. cpu: the same without any GPU field.
    stages = {"one": ([80, 90], 36_000), "two": ([70, None], 54_000)}
    for name in ("gpu", "cpu"):
        for stage, (utils, tokens) in stages.items():
            write_stage(runs / name / stage, [2.0] * len(utils), 1800, 1.5)
            summary_path = runs / name / stage / "summary.json"
            summary = json.loads(summary_path.read_text()) | {"num_input_tokens_seen": tokens}
            if (name, stage) == (
                "gpu",
                "one",
            ):  # the split auto chose (core/split.py), as the trainer records it
                summary["split"] = {
                    "micro_batch": 32,
                    "grad_accum": 1,
                    "gradient_checkpointing": False,
                    "how": "auto",
                    "reason": "the whole effective batch fits",
                }
            summary_path.write_text(json.dumps(summary))
            if name == "gpu":
                rows = [
                    {"step": i, "loss": 2.0} | ({"gpu_util_percent": u} if u else {})
                    for i, u in enumerate(utils)
                ]
                (runs / name / stage / "metrics.jsonl").write_text(
                    "".join(json.dumps(r) + "\n" for r in rows)
                )
    write_report(ReportInput(job_runs(plan), runs))
    rows = {r["experiment"]: r for r in csv.DictReader((runs / "report.csv").open())}
    assert float(rows["gpu"]["gpu_util_%"]) == 80.0  # (80 + 90 + 70) / 3: a row without samples is no 0 %
    assert float(rows["gpu"]["tokens_per_s"]) == float(rows["cpu"]["tokens_per_s"]) == 25.0
    assert rows["cpu"]["gpu_util_%"] == ""  # no GPU: empty, not 0
    # Per stage: one's 85 % and 20 tokens/s, two's 70 % and 30 tokens/s (plan_of's stages have 1 GPU;
    # no scheduler states given: a stage with its summary.json finished).
    report = (runs / "report.md").read_text()
    clock = "Trainer clock (no scheduler record)"
    assert f"| gpu/one | COMPLETED | 1 | – | – | 30 | 0.5 | {clock} | 85 | 20 | 32x1 (auto) |" in report
    assert f"| gpu/two | COMPLETED | 1 | – | – | 30 | 0.5 | {clock} | 70 | 30 | – |" in report
    assert f"| cpu/two | COMPLETED | 1 | – | – | 30 | 0.5 | {clock} | – | 30 | – |" in report


def submitted(run_dir: Path, *job_ids: str, backend: str = "slurm", pack: bool = False) -> None:
    """job.json as the launcher leaves it after submitting `job_ids` for this folder, oldest first."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for job_id in job_ids:
        record_job(run_dir, job_id, backend, pack=pack)


def recorded_usage(plan, logs: Path):
    """What the launcher's --report finds, with sacct's answer recorded (USAGE) instead of asked."""
    records = {job.id: job_records(Path(job.run_dir)) for job in plan.jobs}
    return usage_of(plan, records, parse_sacct_allocations(USAGE), str(logs))


def test_gpu_hours_are_what_sacct_says_every_requeue_and_the_eval_job_held(tmp_path):
    # Before: rank 0's Trainer clock x the YAML's gpus (30 s here): requeues, model loading and the
    # eval job were left out.
    plan = plan_of(tmp_path, "good")
    runs = tmp_path / "runs"
    write_stage(runs / "good" / "one", [3.0, 2.0], 20, 2.2)  # the Trainer's clock: its last attempt
    write_stage(runs / "good" / "two", [1.9], 10, 1.6)
    submitted(runs / "good" / "one", "2")  # requeued twice: 6 + 7 + 30 s on 1 GPU
    submitted(runs / "good" / "two", "4", "3")  # cancelled after 19 s on 1 GPU; again, on no GPU
    submitted(runs / "good" / "eval", "1")  # 3 s on 2 GPUs
    (runs / "good" / "eval" / "results.json").write_text(json.dumps({"n": 4, "exact_match": 0.5}))

    usage = recorded_usage(plan, tmp_path / "logs")
    write_report(ReportInput(job_runs(plan, usage=usage), runs, usage=usage, gpu_hour_cost=2.5))

    rows = {r["experiment"]: r for r in csv.DictReader((runs / "report.csv").open())}
    assert float(rows["good"]["gpu_hours"]) == round((43 * 1 + 19 * 1 + 3 * 2) / 3600, 4)
    assert float(rows["good"]["train_min"]) == 0.5  # the Trainer's clocks, beside it
    assert usage.jobs["good/one"].gpu_hours == pytest.approx(43 / 3600)
    report = (runs / "report.md").read_text()
    assert "| good/one | COMPLETED | 1 | 3 | 0.72 | 0.33 | 0.0119 | sacct | – | – |" in report
    assert "| good/two | COMPLETED | 0 | 2 | 0.35 | 0.17 | 0.0053 | sacct | – | – |" in report
    assert "| good/eval | COMPLETED | 2 | 1 | 0.05 | – | 0.0017 | sacct | – | – |" in report
    assert "All jobs: 0.02 GPU-hours allocated" in report and "Trainer's clock, a lower bound" not in report


def test_a_shared_evals_allocation_is_charged_once_split_evenly_over_the_evals_it_scored(tmp_path):
    """Before: each eval a shared eval scored was charged the whole of its allocation, so a sweep's
    GPU-hours counted it once per point."""
    plan = plan_of(tmp_path, "a", "b")
    runs = tmp_path / "runs"
    for name in ("a", "b"):
        record_job(runs / name / "eval", "1", "slurm", shared=True)  # job 1: 3 s on 2 GPUs
    usage = recorded_usage(plan, tmp_path / "logs")
    evals = [usage.jobs[f"{name}/eval"] for name in ("a", "b")]
    assert [u.gpu_hours for u in evals] == [pytest.approx(3 * 2 / 3600 / 2)] * 2
    assert sum(u.gpu_hours for u in evals) == pytest.approx(3 * 2 / 3600)
    assert evals[0].source == "sacct: 1/2 of shared eval 1"


def test_a_pack_counts_its_whole_allocation_idle_lanes_included_shared_by_lane_time(tmp_path):
    plan = plan_of(tmp_path, "a", "b")
    runs, logs = tmp_path / "runs", tmp_path / "logs"
    # Job 7: 4 lanes for 4 s = 16 GPU-seconds, of which the units used 4 (b/two and b/eval were blocked
    # before they started): lanes busy 25 %.
    lane_s = {"a/one": 2.0, "a/two": 1.0, "a/eval": 0.5, "b/one": 0.5, "b/two": None, "b/eval": None}
    for job in plan.jobs:
        submitted(Path(job.run_dir), "7", pack=True)
        ran = lane_s[job.id] is not None
        lane = {"pack_job": "7", "lane": 0, "gpu": "0", "state": "done" if ran else "blocked"}
        lane |= {"started_s": 1000.0, "ended_s": 1000.0 + lane_s[job.id]} if ran else {}
        (Path(job.run_dir) / "lane.json").write_text(json.dumps(lane))
    # The allocation's own submission, as launch.py --pack pickles it: the units it was given.
    units = [unit_of(job, str(logs)) for job in plan.jobs]
    (logs / "packs").mkdir(parents=True)
    DelayedSubmission(PackJob(), units, 4, str(tmp_path), 30).dump(
        JobPaths(logs / "packs", "7").submitted_pickle
    )

    usage = recorded_usage(plan, logs)
    write_report(ReportInput(job_runs(plan, usage=usage), runs, usage=usage))

    rows = {r["experiment"]: r for r in csv.DictReader((runs / "report.csv").open())}
    assert float(rows["a"]["gpu_hours"]) == round(16 * 3.5 / 4 / 3600, 4)  # 14 of the 16 GPU-seconds
    assert float(rows["b"]["gpu_hours"]) == round(16 * 0.5 / 4 / 3600, 4)
    report = (runs / "report.md").read_text()
    assert "Pack 7: 4 GPUs x 0.1 min = 0.00 GPU-hours, lanes busy 25%" in report
    assert "| a/one | – | 1 | 1 | 0.03 | – | 0.0022 | sacct: share of pack 7 | – | – |" in report
    assert "| b/two | – | 0 | 0 | 0 | – | 0 | sacct: share of pack 7 | – | – |" in report  # never ran
    # A report on `a` alone: b's unit still takes its share of the allocation (the pack's own list).
    profile, _ = load_profile(tmp_path / "configs")
    only_a = build_plan(load_experiments(tmp_path / "configs", profile, None, ["a"]), profile)
    assert recorded_usage(only_a, logs).jobs["a/one"].gpu_hours == pytest.approx(16 * 2 / 4 / 3600)
    assert sum(u.gpu_hours for u in recorded_usage(only_a, logs).jobs.values()) == pytest.approx(14 / 3600)
    # Without the allocation's own list (its log folder deleted), the plan's units share all of it.
    JobPaths(logs / "packs", "7").submitted_pickle.unlink()
    assert sum(u.gpu_hours for u in recorded_usage(only_a, logs).jobs.values()) == pytest.approx(16 / 3600)


def run_local_job(folder: Path, visible: str) -> submitit.Job:
    """A real local job as the local backend starts one (submitit's LocalExecutor, the GPUs it was given
    in CUDA_VISIBLE_DEVICES), which names them in its log as a stage does."""
    python = f"env CUDA_VISIBLE_DEVICES={visible} {sys.executable}"
    job = submitit.LocalExecutor(folder=folder, python=python).submit(
        subprocess.run, ["sh", "-c", "echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"], check=True
    )
    job.result()
    return job


@pytest.mark.slow
def test_a_local_job_counts_its_wall_time_x_the_gpus_it_was_given_and_no_sacct_is_called(tmp_path, repo_root):
    configs = tmp_path / "configs"
    plan = plan_of(tmp_path, "loc")
    # No SLURM here: any sacct or squeue the report ran would leave its name in `called`.
    fake_bin, called = tmp_path / "bin", tmp_path / "called"
    fake_bin.mkdir()
    for name in ("sacct", "squeue", "sbatch"):
        (fake_bin / name).write_text(f"#!/bin/sh\necho {name} >> {called}\nexit 1\n")
        (fake_bin / name).chmod(0o755)
    on_gpus = run_local_job(tmp_path / "logs" / "loc" / "one", "0,1")
    on_cpu = run_local_job(tmp_path / "logs" / "loc" / "two", "")
    submitted(tmp_path / "runs" / "loc" / "one", on_gpus.job_id, backend="local")
    submitted(tmp_path / "runs" / "loc" / "two", on_cpu.job_id, backend="local")

    usage = plan_usage(plan, str(tmp_path / "logs"))

    paths = on_gpus.paths
    held_s = max(paths.result_pickle.stat().st_mtime, paths.stdout.stat().st_mtime)
    held_s -= paths.submitted_pickle.stat().st_mtime
    assert usage.jobs["loc/one"].held_s == pytest.approx(held_s) and held_s > 0
    assert (usage.jobs["loc/one"].gpus, usage.jobs["loc/one"].source) == (2, "local clock")
    assert usage.jobs["loc/one"].gpu_hours == pytest.approx(held_s * 2 / 3600)
    assert (usage.jobs["loc/two"].gpus, usage.jobs["loc/two"].gpu_hours) == (0, 0.0)  # on the CPU
    assert "loc/eval" not in usage.jobs  # never submitted
    # The launcher's --report, as a user runs it: no torch imported, no SLURM client called.
    check = (
        "import sys, launch; "
        f"code = launch.main(['--config-dir', {str(configs)!r}, '--report']); "
        "print('exit', code, 'torch' in sys.modules)"
    )
    env = {**os.environ, "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        [sys.executable, "-c", check], cwd=repo_root, env=env, capture_output=True, text=True
    )
    assert done.stdout.strip().endswith("exit 0 False"), done.stderr[-2000:]
    assert not called.exists()
    assert "| loc/one | " in (tmp_path / "runs" / "report.md").read_text()
    assert (
        " 2 | 1 | " in (tmp_path / "runs" / "report.md").read_text().split("| loc/one | ")[1].split("\n")[0]
    )


def test_report_reads_what_each_job_held_from_the_dev_clusters_sacct(slurm_cluster, tmp_path):
    plan = plan_of(tmp_path, "real")  # resources.gpus 1: the 2 GPUs below can only come from sacct

    def sbatch(gpus: int, seconds: int) -> str:
        command = ["sbatch", "--wait", "--parsable", f"--gres=gpu:{gpus}", "-c", "1", "--mem=100M"]
        command += ["-o", "/dev/null", "--wrap", f"sleep {seconds}"]
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, check=True)
        return done.stdout.strip().split(";")[0]

    submitted(tmp_path / "runs" / "real" / "one", sbatch(2, 2))
    submitted(tmp_path / "runs" / "real" / "eval", sbatch(1, 1))

    usage = plan_usage(plan, str(tmp_path / "logs"))
    one, evaluation = usage.jobs["real/one"], usage.jobs["real/eval"]
    assert (one.gpus, one.attempts, one.source) == (2, 1, "sacct") and one.held_s >= 2
    assert one.gpu_hours == pytest.approx(one.held_s * 2 / 3600)
    assert (evaluation.gpus, evaluation.source) == (1, "sacct") and evaluation.held_s >= 1
    assert "real/two" not in usage.jobs and not usage.unanswered  # never submitted: no figure
    assert launch.main(["--config-dir", str(tmp_path / "configs"), "--report"]) == 0
    report = (tmp_path / "runs" / "report.md").read_text()
    assert "| real/one | COMPLETED | 2 | 1 | " in report and "| real/eval | COMPLETED | 1 | 1 | " in report


SWEEP = "sweep: {{grid: {{train.learning_rate: [1.0e-4, 3.0e-4], adapter.rank: [8]}}{more}}}\n"


def sweep_plan(tmp_path: Path, more: str = ", seeds: [1, 2, 3], select: {metric: eval_loss, mode: min}"):
    """The plan of an ordinary experiment `plain` and of sweep `lr` (one stage: two points, lr1e-04-r8
    and lr3e-04-r8, with the `seeds`, `select`... of `more`), and the sweep members by experiment name."""
    plan_of(tmp_path, "plain")
    configs = tmp_path / "configs"
    text = EXPERIMENT.format(name="lr", data=tmp_path / "d.jsonl")
    text = text.replace("stages: [{name: one}, {name: two}]", "stages: [{name: one}]")
    (configs / "lr.yaml").write_text(text + SWEEP.format(more=more))
    profile, _ = load_profile(configs)
    loaded = load_experiments(configs, profile)
    return build_plan(loaded, profile), {e.name: e.sweep for e in loaded if e.sweep}


def write_replicate(runs: Path, name: str, eval_loss: float, scores: dict, split: str = "eval") -> None:
    """A finished replicate: one stage of 60 s on one GPU (train_min 1, gpu_hours 0.0167) and its scores."""
    write_stage(runs / name / "one", [3.0, 2.0], 60, eval_loss)
    (runs / name / "eval").mkdir()
    results = {"n": 10, "split": split, **scores}
    (runs / name / "eval" / "results.json").write_text(json.dumps(results))


def md_line(report: str, start: str) -> str:
    return next(line for line in report.splitlines() if line.startswith(start))


@pytest.mark.slow
def test_a_sweep_is_one_row_per_point_with_mean_and_sample_std_of_its_seeds_and_the_best_marked(tmp_path):
    # Before: every replicate was its own row of the task's table, six rows to compare by eye.
    plan, sweeps = sweep_plan(tmp_path)
    runs = tmp_path / "runs"
    for seed, loss, em in ((1, 1.0, 0.5), (2, 1.2, 0.6), (3, 1.4, 0.7)):
        write_replicate(runs, f"lr-lr1e-04-r8-s{seed}", loss, {"exact_match": em})
    for seed, loss, em in ((1, 2.0, 0.2), (2, 2.5, 0.3), (3, 3.0, 0.4)):
        write_replicate(runs, f"lr-lr3e-04-r8-s{seed}", loss, {"exact_match": em})

    write_report(ReportInput(job_runs(plan), runs, sweeps=sweeps))

    report = (runs / "report.md").read_text()
    task_table, sweep_part = report.split("### Sweep: lr")
    assert "| plain | missing: not run yet |" in task_table and "| lr-lr" not in task_table
    head = "| point | train.learning_rate | adapter.rank | seeds | eval_split | best | best_eval_loss "
    assert md_line(sweep_part, "| point ") == head + "| exact_match | train_min | gpu_hours |"
    # Sample standard deviation (n - 1): 1.0, 1.2, 1.4 -> 0.2 (the population's would be 0.1633).
    assert md_line(sweep_part, "| lr1e-04-r8 ") == (
        "| lr1e-04-r8 | 0.0001 | 8 | 3/3 done | eval | ✓ | 1.2 ± 0.2 | 0.6 ± 0.1 | 1 ± 0 | 0.0167 ± 0 |"
    )
    assert md_line(sweep_part, "| lr3e-04-r8 ") == (
        "| lr3e-04-r8 | 0.0003 | 8 | 3/3 done | eval |  | 2.5 ± 0.5 | 0.3 ± 0.1 | 1 ± 0 | 0.0167 ± 0 |"
    )
    assert "Best by eval_loss (min, eval split): lr1e-04-r8" in sweep_part
    assert "not complete" not in sweep_part


def test_a_point_with_a_failed_seed_says_2_of_3_done_and_is_not_selected_on_a_mean_of_fewer(tmp_path):
    plan, sweeps = sweep_plan(tmp_path)
    runs = tmp_path / "runs"
    for seed, loss in ((1, 1.0), (2, 1.2), (3, 1.4)):
        # Seed 2's eval job scored no exact_match: that column cannot be a mean of the other two either.
        write_replicate(runs, f"lr-lr1e-04-r8-s{seed}", loss, {"exact_match": 0.5} if seed != 2 else {})
    # Seeds 1 and 2 of lr3e-04-r8 beat every seed of lr1e-04-r8 (mean 0.6); seed 3 failed.
    write_replicate(runs, "lr-lr3e-04-r8-s1", 0.5, {"exact_match": 0.9})
    write_replicate(runs, "lr-lr3e-04-r8-s2", 0.7, {"exact_match": 0.9})
    states = {"lr-lr3e-04-r8-s3/one": "FAILED", "lr-lr3e-04-r8-s3/eval": "BLOCKED"}

    write_report(ReportInput(job_runs(plan, states), runs, sweeps=sweeps))

    report = (runs / "report.md").read_text()
    assert md_line(report, "| lr3e-04-r8 ") == (
        "| lr3e-04-r8 | 0.0003 | 8 | 2/3 done | eval |  | incomplete | incomplete | incomplete | incomplete |"
    )
    assert "0.6 ± 0.1414" not in report
    assert md_line(report, "| lr1e-04-r8 ").startswith("| lr1e-04-r8 | 0.0001 | 8 | 3/3 done | eval | ✓ |")
    assert "| ✓ | 1.2 ± 0.2 | incomplete | 1 ± 0 |" in md_line(report, "| lr1e-04-r8 ")
    assert "Best by eval_loss (min, eval split): lr1e-04-r8" in report
    assert "Replicates not complete: lr-lr3e-04-r8-s3 (missing: one FAILED, eval BLOCKED)." in report


@pytest.mark.slow
def test_a_sweep_is_never_selected_on_a_test_split(tmp_path):
    # No `seeds:`: each point is one run, its cells the value itself (no ± of one number).
    plan, sweeps = sweep_plan(tmp_path, ", select: {metric: exact_match, mode: max}")
    runs = tmp_path / "runs"
    write_replicate(runs, "lr-lr1e-04-r8", 1.0, {"exact_match": 0.6})
    write_replicate(runs, "lr-lr3e-04-r8", 2.0, {"exact_match": 0.4})

    write_report(ReportInput(job_runs(plan), runs, sweeps=sweeps))

    report = (runs / "report.md").read_text()
    assert md_line(report, "| lr1e-04-r8 ").startswith(
        "| lr1e-04-r8 | 0.0001 | 8 | 1/1 done | eval | ✓ | 1 | 0.6 |"
    )
    assert "Best by exact_match (max, eval split): lr1e-04-r8" in report

    # The same scores on a test split: choosing by them would make them an optimistic estimate.
    for name in ("lr-lr1e-04-r8", "lr-lr3e-04-r8"):
        (runs / name / "eval" / "results.json").write_text(json.dumps({"exact_match": 0.5, "split": "test"}))
    write_report(ReportInput(job_runs(plan), runs, sweeps=sweeps))

    report = (runs / "report.md").read_text()
    assert "✓" not in report and "| best |" not in report
    assert (
        "Best by exact_match (max): none marked: the selection cannot be made on a test split "
        "(lr-lr1e-04-r8's exact_match was scored on split 'test'); select on eval_loss or on scores of "
        "the eval split."
    ) in report
    # Nor on the training data (eval.split: train), which the row already flags.
    for name in ("lr-lr1e-04-r8", "lr-lr3e-04-r8"):
        (runs / name / "eval" / "results.json").write_text(json.dumps({"exact_match": 0.5, "split": "train"}))
    write_report(ReportInput(job_runs(plan), runs, sweeps=sweeps))
    report = (runs / "report.md").read_text()
    assert "✓" not in report and "none marked: the selection cannot be made on the training data" in report


@pytest.mark.slow
def test_report_csv_keeps_each_seeds_row_with_its_sweep_point_seed_and_swept_values(tmp_path):
    plan, sweeps = sweep_plan(tmp_path)
    runs = tmp_path / "runs"
    for seed, loss in ((1, 1.0), (2, 1.2), (3, 1.4)):
        write_replicate(runs, f"lr-lr1e-04-r8-s{seed}", loss, {"exact_match": 0.5})

    write_report(ReportInput(job_runs(plan), runs, sweeps=sweeps))

    reader = csv.DictReader((runs / "report.csv").open())
    rows = {r["experiment"]: r for r in reader}
    assert reader.fieldnames[-6:] == ["task", "sweep", "point", "seed", "train.learning_rate", "adapter.rank"]
    assert len(rows) == 7  # six replicates and plain: no mean or std rows
    seed_2 = rows["lr-lr1e-04-r8-s2"]
    assert (seed_2["sweep"], seed_2["point"], seed_2["seed"]) == ("lr", "lr1e-04-r8", "2")
    assert (seed_2["train.learning_rate"], seed_2["adapter.rank"], seed_2["best_eval_loss"]) == (
        "0.0001",
        "8",
        "1.2",
    )
    assert rows["lr-lr3e-04-r8-s3"]["status"] == "missing: not run yet"
    assert (rows["plain"]["sweep"], rows["plain"]["seed"], rows["plain"]["adapter.rank"]) == ("", "", "")
    # Without `sweeps` (a caller that does not pass them) the report is as before: a row per experiment.
    write_report(ReportInput(job_runs(plan), runs))
    reader = csv.DictReader((runs / "report.csv").open())
    assert "sweep" not in reader.fieldnames and "### Sweep" not in (runs / "report.md").read_text()
    assert "| lr-lr1e-04-r8-s2 | complete |" in (runs / "report.md").read_text()


def test_a_sweep_points_loss_curves_are_one_mean_line_with_a_min_max_band_over_shared_steps(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eval.report_plots import draw_all, loss_series

    plan, sweeps = sweep_plan(tmp_path)
    runs = tmp_path / "runs"
    # Steps 5, 10, 15; seed 3 stopped after step 10, so the mean ends there (3.0 and 2.0, band 2-4 and 2-2).
    for seed, losses in ((1, [3.0, 2.0, 1.0]), (2, [4.0, 2.0, 0.0]), (3, [2.0, 2.0])):
        write_stage(runs / f"lr-lr1e-04-r8-s{seed}" / "one", losses, 60, 1.0)
    write_stage(runs / "plain" / "one", [5.0], 60, 1.0)
    experiments = plan.experiments()
    series = {name: loss_series(job_runs(plan), name) for name in experiments}
    series = {name: s for name, s in series.items() if s[0]}

    fig, ax = plt.subplots()
    draw_all(ax, series, experiments, sweeps)

    labels = [line.get_label() for line in ax.lines if not line.get_label().startswith("_")]
    # The seeds' eval losses share no step (15, 15, 10): no eval mean rather than one over fewer.
    assert labels == ["lr-lr1e-04-r8 train (mean of 3/3 seeds, band min–max)", "plain train", "plain eval"]
    mean = next(line for line in ax.lines if line.get_label().startswith("lr-lr1e-04-r8"))
    assert list(zip(mean.get_xdata(), mean.get_ydata(), strict=True)) == [(5, 3.0), (10, 2.0)]
    (band,) = ax.collections
    vertices = band.get_paths()[0].vertices
    assert (vertices[:, 0].min(), vertices[:, 0].max()) == (5, 10)
    assert (vertices[:, 1].min(), vertices[:, 1].max()) == (2.0, 4.0)
    plt.close(fig)
    written = write_report(ReportInput(job_runs(plan), runs, sweeps=sweeps))
    assert runs / "loss_curves.png" in written and runs / "lr-lr1e-04-r8-s3" / "loss.png" in written


# Did fine-tuning help? The base model without an adapter, scored on the same prompts, as a row of its own,
# and each experiment's Δ against it.


def with_base_job(plan, template: str, stage: str, model: str = "org/model"):
    """`plan` with a base-model eval job as the plan side adds one (experiment `baselines`, no train job:
    a copy of eval job `template` writing to RUN_ROOT/baselines/STAGE), and the BaseEval naming it."""
    job = plan.job(template)
    out_dir = str(Path(plan.run_root) / "baselines" / stage)
    spec = job.spec.model_copy(update={"out_dir": out_dir, "experiment": "baselines", "stage": stage})
    base = dataclasses.replace(
        job, id=f"baselines/{stage}", experiment="baselines", stage=stage, spec=spec, depends_on=()
    )
    return dataclasses.replace(plan, jobs=(*plan.jobs, base)), BaseEval(base.id, out_dir, model)


def write_scores(folder: str | Path, source: str | None = None, **scores: float) -> None:
    """An eval job's results.json (an experiment's or a base's: the same keys) on the eval split; `source`:
    the file it scored, when the test compares files."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    scored = {"source": source} if source is not None else {}
    (Path(folder) / "results.json").write_text(json.dumps({"n": 4, "split": "eval", **scored, **scores}))


def with_first_stage_scored(tmp_path: Path):
    """(plan, base eval, out_dir): experiment `good` with a base eval and an eval of its first stage
    (eval-one, eval.after_each_stage) beside its last's."""
    plan, base = with_base_job(plan_of(tmp_path, "good"), "good/eval", "abc123")
    last = plan.job("good/eval")
    out_dir = str(Path(plan.run_root) / "good" / "eval-one")
    after_one = dataclasses.replace(
        last, id="good/eval-one", stage="eval-one", spec=last.spec.model_copy(update={"out_dir": out_dir})
    )
    return dataclasses.replace(plan, jobs=(*plan.jobs, after_one)), base, out_dir


def table_of(report: str) -> list[str]:
    """The first table of report.md: its header, then its rows (the separator left out)."""
    lines = [line for line in report.split("## Jobs")[0].splitlines() if line.startswith("|")]
    return [lines[0], *lines[2:]]


def scored_plan(tmp_path: Path):
    """Experiment `good` (exact_match 0.75, bleu 0.2) and its base eval (0.5, 0.3), which held 2 GPUs
    for 3 s (sacct's job 1): the plan, its BaseEval and the usage the launcher would find."""
    plan, base = with_base_job(plan_of(tmp_path, "good"), "good/eval", "abc123")
    write_scores(tmp_path / "runs" / "good" / "eval", exact_match=0.75, bleu=0.2)
    write_scores(base.out_dir, exact_match=0.5, bleu=0.3)
    submitted(Path(base.out_dir), "1")
    return plan, base, recorded_usage(plan, tmp_path / "logs")


def test_base_model_row_heads_its_task_table_with_its_own_scores_and_gpu_hours(tmp_path):
    # Before: no row said what the base model scores, so nobody could tell whether fine-tuning helped.
    plan, base, usage = scored_plan(tmp_path)
    runs = tmp_path / "runs"

    write_report(
        ReportInput(
            job_runs(plan, usage=usage), runs, usage=usage, gpu_hour_cost=2.5, base_evals={"good": base}
        )
    )

    header, first, second = table_of((runs / "report.md").read_text())
    assert header == (
        "| experiment | status | model | method | stages | gpu_hours | cost | eval_split | exact_match "
        "| Δ exact_match | bleu | Δ bleu |"
    )
    # 3 s on 2 GPUs = 0.0017 GPU-hours (sacct), cost 0.0017 x 2.5 = 0.00 (rounded to cents as for rows).
    assert (
        first
        == "| base (no adapter) | complete | org/model | – | – | 0.0017 | 0 | eval | 0.5 | – | 0.3 | – |"
    )
    assert second.startswith("| good | complete | org/model | lora |")
    assert (
        "| baselines/abc123 | COMPLETED | 2 | 1 | 0.05 | – | 0.0017 | sacct | – | – |"
        in (runs / "report.md").read_text()
    )


def test_delta_is_the_adapters_score_minus_the_bases_not_the_reverse(tmp_path):
    plan, base, usage = scored_plan(tmp_path)
    runs = tmp_path / "runs"

    write_report(ReportInput(job_runs(plan, usage=usage), runs, usage=usage, base_evals={"good": base}))

    good = table_of((runs / "report.md").read_text())[2]
    # exact_match 0.75 - 0.5 = +0.25; bleu 0.2 - 0.3 = -0.1 (not -0.09999999999999998 in the csv).
    assert good.endswith("| eval | 0.75 | +0.25 | 0.2 | -0.1 |")
    rows = {r["experiment"]: r for r in csv.DictReader((runs / "report.csv").open())}
    assert (rows["good"]["delta_exact_match"], rows["good"]["delta_bleu"]) == ("0.25", "-0.1")


def test_an_earlier_stage_scored_after_it_has_its_row_above_the_experiments_with_its_own_delta(tmp_path):
    # Before: eval.after_each_stage scored the first stage of a curriculum (the SFT of SFT -> DPO), and the
    # report showed only the last stage's row: base, SFT and DPO could not be read side by side.
    plan, base, out_dir = with_first_stage_scored(tmp_path)
    write_scores(base.out_dir, exact_match=0.5, bleu=0.3)
    write_scores(out_dir, exact_match=0.6, bleu=0.25)
    write_scores(tmp_path / "runs" / "good" / "eval", exact_match=0.75, bleu=0.2)
    runs = tmp_path / "runs"

    write_report(ReportInput(job_runs(plan), runs, base_evals={"good": base}))

    _, base_line, one, both = table_of((runs / "report.md").read_text())
    assert base_line.startswith("| base (no adapter) |")
    assert (
        one.startswith("| good @ one | ")
        and "| one |" in one
        and one.endswith("| 0.6 | +0.1 | 0.25 | -0.05 |")
    )
    assert (
        both.startswith("| good | ")
        and "| one → two |" in both
        and both.endswith("| 0.75 | +0.25 | 0.2 | -0.1 |")
    )
    rows = [r for r in csv.DictReader((runs / "report.csv").open()) if r["experiment"].startswith("good")]
    assert [(r["experiment"], r["delta_exact_match"]) for r in rows] == [
        ("good @ one", "0.1"),
        ("good", "0.25"),
    ]


def test_experiments_sharing_a_base_are_compared_with_it_and_another_base_model_gets_its_own_row(tmp_path):
    plan_of(tmp_path, "a", "b")
    configs = tmp_path / "configs"
    other = EXPERIMENT.format(name="c", data=tmp_path / "d.jsonl").replace("org/model", "org/other")
    (configs / "c.yaml").write_text(other)
    profile, _ = load_profile(configs)
    plan = build_plan(load_experiments(configs, profile), profile)
    plan, shared = with_base_job(plan, "a/eval", "m1")
    plan, own = with_base_job(plan, "c/eval", "m2", model="org/other")
    runs = tmp_path / "runs"
    for name, em in (("a", 0.75), ("b", 0.625), ("c", 0.25)):
        write_scores(runs / name / "eval", exact_match=em)
    write_scores(shared.out_dir, exact_match=0.5)
    write_scores(own.out_dir, exact_match=0.2)

    write_report(ReportInput(job_runs(plan), runs, base_evals={"a": shared, "b": shared, "c": own}))

    table = table_of((runs / "report.md").read_text())
    assert table[0].endswith("| eval_split | exact_match | Δ exact_match |")
    # One row per distinct base (a and b share one), both on top, each labelled with its model.
    assert table[1] == "| base (no adapter): org/model | complete | org/model | – | – | eval | 0.5 | – |"
    assert table[2] == "| base (no adapter): org/other | complete | org/other | – | – | eval | 0.2 | – |"
    assert [line.split(" | ")[0] for line in table[3:]] == ["| a", "| b", "| c"]
    # a: 0.75 - 0.5, b: 0.625 - 0.5, c against its own base: 0.25 - 0.2 (not 0.25 - 0.5 = -0.25).
    assert table[3].endswith("| org/model | lora | one → two | eval | 0.75 | +0.25 |")
    assert table[4].endswith("| org/model | lora | one → two | eval | 0.625 | +0.125 |")
    assert table[5].endswith("| org/other | lora | one → two | eval | 0.25 | +0.05 |")


def test_a_base_eval_not_run_yet_says_so_and_its_experiments_get_no_delta(tmp_path):
    plan, base = with_base_job(plan_of(tmp_path, "good"), "good/eval", "abc123")
    runs = tmp_path / "runs"
    write_scores(runs / "good" / "eval", exact_match=0.75)

    write_report(ReportInput(job_runs(plan), runs, base_evals={"good": base}))

    base_line, good = table_of((runs / "report.md").read_text())[1:]
    assert base_line == "| base (no adapter) | missing: not run yet | org/model | – | – | – | – | – |"
    assert good.endswith("| eval | 0.75 | – |")  # not 0.75 - 0 = +0.75

    write_report(ReportInput(job_runs(plan, {"baselines/abc123": "FAILED"}), runs, base_evals={"good": base}))
    assert table_of((runs / "report.md").read_text())[1].startswith(
        "| base (no adapter) | missing: eval FAILED |"
    )


def test_a_left_out_base_says_why_under_the_table_and_gives_no_delta(tmp_path):
    plan, base = with_base_job(plan_of(tmp_path, "good", "tokens"), "good/eval", "abc123")
    runs = tmp_path / "runs"
    write_scores(runs / "good" / "eval", exact_match=0.75)
    write_scores(runs / "tokens" / "eval", exact_match=0.9)
    write_scores(base.out_dir, exact_match=0.5)
    left_out = BaseEval("", "", "org/model", left_out="it adds tokens the base model lacks")

    write_report(ReportInput(job_runs(plan), runs, base_evals={"good": base, "tokens": left_out}))

    report = (runs / "report.md").read_text()
    table = table_of(report)
    assert [line.split(" | ")[0] for line in table[1:]] == ["| base (no adapter)", "| good", "| tokens"]
    assert table[2].endswith("| 0.75 | +0.25 |")
    assert table[3].endswith("| 0.9 | – |")  # not against good's base: 0.9 - 0.5
    assert "\n\nNo base row for tokens: it adds tokens the base model lacks.\n\n## Jobs" in report


def test_report_csv_has_the_base_row_and_a_delta_column_after_each_score(tmp_path):
    plan, base, usage = scored_plan(tmp_path)
    runs = tmp_path / "runs"

    write_report(
        ReportInput(
            job_runs(plan, usage=usage), runs, usage=usage, tasks={"good": "qa"}, base_evals={"good": base}
        )
    )

    reader = csv.DictReader((runs / "report.csv").open())
    rows = {r["experiment"]: r for r in reader}
    assert reader.fieldnames[-5:] == ["exact_match", "delta_exact_match", "bleu", "delta_bleu", "task"]
    assert list(rows) == ["base (no adapter)", "good"]
    base_row = rows["base (no adapter)"]
    assert (base_row["status"], base_row["model"], base_row["task"]) == ("complete", "org/model", "qa")
    assert (base_row["exact_match"], base_row["bleu"], base_row["gpu_hours"]) == ("0.5", "0.3", "0.0017")
    assert (base_row["delta_exact_match"], base_row["delta_bleu"]) == ("", "")
    assert (rows["good"]["delta_exact_match"], rows["good"]["task"]) == ("0.25", "qa")


def test_a_baselines_eval_job_without_a_train_job_does_not_crash_the_report(tmp_path):
    # Before: every experiment of the plan got a row, and experiment_row took train_jobs[0] of `baselines`.
    plan, base = with_base_job(plan_of(tmp_path, "good"), "good/eval", "abc123")
    runs = tmp_path / "runs"
    write_scores(base.out_dir, exact_match=0.5)

    write_report(
        ReportInput(job_runs(plan), runs)
    )  # a caller that passes no base_evals: the report as before

    report = (runs / "report.md").read_text()
    rows = [r["experiment"] for r in csv.DictReader((runs / "report.csv").open())]
    assert rows == ["good"] and "| baselines |" not in report and "Δ" not in report
    assert "| baselines/abc123 | COMPLETED |" in report  # the job itself is in the job table


@pytest.mark.slow
def test_a_sweep_points_delta_is_the_mean_of_its_seeds_minus_the_base(tmp_path):
    plan, sweeps = sweep_plan(tmp_path)
    plan, base = with_base_job(plan, "plain/eval", "abc123")
    runs = tmp_path / "runs"
    for seed, loss, em in ((1, 1.0, 0.5), (2, 1.2, 0.6), (3, 1.4, 0.7)):
        write_replicate(runs, f"lr-lr1e-04-r8-s{seed}", loss, {"exact_match": em})
    for seed, loss, em in ((1, 2.0, 0.2), (2, 2.5, 0.3), (3, 3.0, 0.4)):
        write_replicate(runs, f"lr-lr3e-04-r8-s{seed}", loss, {"exact_match": em})
    write_scores(base.out_dir, exact_match=0.25)

    write_report(
        ReportInput(job_runs(plan), runs, sweeps=sweeps, base_evals=dict.fromkeys(plan.experiments(), base))
    )

    report = (runs / "report.md").read_text()
    task_table, sweep_part = report.split("### Sweep: lr")
    assert "| base (no adapter) | complete | org/model | – | – | eval | 0.25 | – |" in task_table
    assert md_line(sweep_part, "| point ").endswith("| exact_match | Δ exact_match | train_min | gpu_hours |")
    # Means 0.6 and 0.3 against the base's 0.25: +0.35 and +0.05 (the spread is the score's, beside it).
    assert "| 0.6 ± 0.1 | +0.35 | 1 ± 0 |" in md_line(sweep_part, "| lr1e-04-r8 ")
    assert "| 0.3 ± 0.1 | +0.05 | 1 ± 0 |" in md_line(sweep_part, "| lr3e-04-r8 ")
    # Without a base for the point: no number, and the reason, once for all its seeds.
    gone = BaseEval("", "", "org/model", left_out="it adds tokens")
    left_out = {name: gone for name in plan.experiments() if name.startswith("lr-lr3e-04")}
    write_report(
        ReportInput(
            job_runs(plan), runs, sweeps=sweeps, base_evals=dict.fromkeys(plan.experiments(), base) | left_out
        )
    )
    report = (runs / "report.md").read_text()
    assert "| 0.3 ± 0.1 | – | 1 ± 0 |" in md_line(report, "| lr3e-04-r8 ")
    names = ", ".join(f"lr-lr3e-04-r8-s{seed}" for seed in (1, 2, 3))
    assert f"No base row for {names}: it adds tokens." in report


@pytest.mark.parametrize(
    "more",
    [
        ", seeds: [1, 2, 3], select: {metric: eval_loss, mode: min}",
        ", seeds: [1, 2, 3], select: {metric: exact_match, mode: max}",
    ],
)
@pytest.mark.slow
def test_a_point_whose_score_is_nan_is_never_marked_best(tmp_path, more):
    """Before: min() over the means kept a NaN met first (a NaN compares false with everything): a point
    whose loss diverged to NaN was marked best."""
    plan, sweeps = sweep_plan(tmp_path, more)
    runs = tmp_path / "runs"
    for seed in (1, 2, 3):  # lr1e-04-r8 comes first; one seed diverged: its loss and its score are NaN
        nan = seed == 1
        loss, em = (float("nan"), float("nan")) if nan else (0.5, 0.9)
        write_replicate(runs, f"lr-lr1e-04-r8-s{seed}", loss, {"exact_match": em})
        write_replicate(runs, f"lr-lr3e-04-r8-s{seed}", 2.0, {"exact_match": 0.3})
    write_report(ReportInput(job_runs(plan), runs, sweeps=sweeps))
    sweep_part = (runs / "report.md").read_text().split("### Sweep: lr")[1]
    assert "✓" in md_line(sweep_part, "| lr3e-04-r8 ") and "✓" not in md_line(sweep_part, "| lr1e-04-r8 ")
    assert "eval split): lr3e-04-r8" in sweep_part
    if "exact_match" in more:  # the diverged seed's score is flagged, not averaged
        assert "not a number in 1 of 3" in md_line(sweep_part, "| lr1e-04-r8 ")
        assert "left out, exact_match not a finite number: lr1e-04-r8" in sweep_part


def test_the_report_renderer_refuses_slurms_plan_and_reads_typed_rows_only(tmp_path):
    # Before: eval/report.py drove slurm's Plan without importing it, a dependency the layer test could not
    # see; now it takes the ground floor's JobRun records, and a plan handed in is refused, not half-read.
    plan = plan_of(tmp_path, "good")
    with pytest.raises(TypeError):
        write_report(ReportInput(plan, tmp_path / "runs"))
    rows = job_runs(plan, {"good/one": "FAILED"})
    assert [type(r).__module__ for r in rows] == ["core.runs"] * len(plan.jobs)
    assert rows[0].state is State.FAILED and rows[0].summary == {}


def test_a_point_with_a_pruned_seed_is_never_the_best_and_the_pruning_and_its_savings_are_shown(tmp_path):
    from core.config import PruneJob
    from core.pruning import judged, mark_pruned
    from core.rundir import write_spec

    prune = ", seeds: [1, 2], select: {metric: eval_loss, mode: min}, prune: {rungs: [1], keep: 0.5}"
    plan, sweeps = sweep_plan(tmp_path, prune)
    runs = tmp_path / "runs"
    spec = PruneJob(rungs=[1], keep=0.5, sweep="lr")
    for name, loss in (("lr-lr3e-04-r8-s1", 1.0), ("lr-lr3e-04-r8-s2", 1.2), ("lr-lr1e-04-r8-s1", 0.5)):
        write_replicate(runs, name, loss, {"exact_match": 0.5})
        judged(runs, "lr", name, "h", 1, loss + 1, spec)
    # Seed 2 of lr1e-04-r8 stopped at rung 1 of 3 epochs, with the best loss of all: were it counted, its
    # point (mean 0.45) would beat lr3e-04-r8 (mean 1.1).
    pruned = "lr-lr1e-04-r8-s2"
    write_replicate(runs, pruned, 0.4, {"exact_match": 0.5})
    write_spec(runs / pruned / "one", {"train": {"epochs": 3}})
    summary = json.loads((runs / pruned / "one" / "summary.json").read_text())
    (runs / pruned / "one" / "summary.json").write_text(json.dumps(summary | {"epochs_done": 1}))
    record = judged(runs, "lr", pruned, "h", 1, 9.0, spec)
    mark_pruned(runs / pruned / "one", record)

    write_report(ReportInput(job_runs(plan), runs, sweeps=sweeps))

    report = (runs / "report.md").read_text()
    assert md_line(report, "| lr1e-04-r8 ").startswith(
        "| lr1e-04-r8 | 0.0001 | 8 | 1/2 done, 1 pruned | eval |  |"
    )
    assert "Best by eval_loss (min, eval split): lr3e-04-r8" in report
    # cutoff: the median of 2.0, 2.2, 1.5 and 9.0 is 2.1
    assert (
        md_line(report, f"| {pruned} ") == f"| {pruned} | 9 | at rung 1 (9 > cutoff 2.1 of 4) | 0.0167 | 1 |"
    )
    assert "Replicates not complete" not in report
    # Spent: four runs of 1 minute each; saved: the pruned run's 2 epochs not trained, 2 minutes.
    assert (
        "Spent 0.0668 GPU-hours (4 training minutes); pruning saved ~0.0334 GPU-hours (~2 training" in report
    )


def test_a_dpo_stages_reward_curves_are_plotted_beside_its_loss(tmp_path):
    """TRL's rewards/accuracies and rewards/margins rows of the second (DPO) stage, at steps counted across
    stages as the loss is; an experiment without them keeps its loss-only picture."""
    from eval.report_plots import plot_losses, reward_series

    plan = plan_of(tmp_path, "pref", "plain")
    runs = tmp_path / "runs"
    for name in ("pref", "plain"):
        write_stage(runs / name / "one", [3.0, 2.5], 60, 2.2)
        write_stage(runs / name / "two", [0.69, 0.6], 60, 0.65)
    rewards = [
        {"step": 5, "loss": 0.69, "rewards/accuracies": 0.0, "rewards/margins": 0.0},
        {"step": 10, "loss": 0.6, "rewards/accuracies": 0.75, "rewards/margins": 0.3},
    ]
    (runs / "pref" / "two" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rewards))
    jobs = job_runs(plan, {})

    assert reward_series(jobs, "pref") == {
        "rewards/accuracies": [(15, 0.0), (20, 0.75)],  # after stage one's 10 steps
        "rewards/margins": [(15, 0.0), (20, 0.3)],
    }
    assert reward_series(jobs, "plain") == {}
    plot_losses(jobs, ["pref", "plain"], runs)
    widths = {name: png_width(runs / name / "loss.png") for name in ("pref", "plain")}
    assert widths["pref"] > 1.5 * widths["plain"]  # a second plot beside the loss


def png_width(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[16:20], "big")  # the IHDR chunk's width


def test_a_stage_row_that_scored_other_data_than_its_base_has_no_delta_and_the_report_says_why(tmp_path):
    """M6: an SFT -> DPO run's SFT row (eval-sft: the SFT dev set) took its Δ against the base, which scored
    the last stage's eval data (the DPO pairs): two example sets compared. The DPO row's Δ stays."""
    plan, base, out_dir = with_first_stage_scored(tmp_path)
    runs = tmp_path / "runs"
    for folder, source, em in (
        (base.out_dir, "pairs.jsonl", 0.5),
        (out_dir, "dev.jsonl", 0.6),
        (runs / "good" / "eval", "pairs.jsonl", 0.75),
    ):
        write_scores(folder, source, exact_match=em)

    write_report(ReportInput(job_runs(plan), runs, base_evals={"good": base}))

    report = (runs / "report.md").read_text()
    _, _, one, both = table_of(report)
    assert one.startswith("| good @ one | ") and one.endswith("| 0.6 | – |"), one
    assert both.endswith("| 0.75 | +0.25 |"), both
    assert "good @ one: no Δ, its eval scored dev.jsonl and the base pairs.jsonl." in report


def test_an_sft_then_grpo_experiment_plots_each_methods_loss_and_the_grpo_rewards_on_panels_of_their_own(
    tmp_path,
):
    """Issue 49 (and 51's "17x worse"): an SFT cross-entropy and a GRPO loss on one axis compare nothing.
    Each method's loss gets its own panel; GRPO's mean reward and share of groups without variance beside."""
    from eval.report_plots import losses_by_method, plot_losses, reward_series

    plan = plan_of(tmp_path, "rl", "plain")
    runs = tmp_path / "runs"
    for name in ("rl", "plain"):
        write_stage(runs / name / "one", [3.0, 2.5], 60, 2.2)
        write_stage(runs / name / "two", [0.69, 0.6], 60, 0.65)
    rows = [
        {"step": 5, "loss": 0.0, "reward": 0.25, "frac_reward_zero_std": 0.5, "rewards/rouge_l/mean": 0.25},
        {"step": 10, "loss": 0.01, "reward": 0.5, "frac_reward_zero_std": 0.0, "rewards/rouge_l/mean": 0.5},
        {"step": 10, "eval_loss": 0.05},
    ]
    (runs / "rl" / "two" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    jobs = job_runs(plan, {})
    assert reward_series(jobs, "rl") == {
        "reward": [(15, 0.25), (20, 0.5)],
        "frac_reward_zero_std": [(15, 0.5), (20, 0.0)],
    }
    by_method = losses_by_method(jobs, "rl")
    assert list(by_method) == ["sft", "grpo"] and by_method["grpo"] == ([(15, 0.0), (20, 0.01)], [(20, 0.05)])
    assert by_method["sft"][1] == [(10, 2.2)]  # the SFT panel's evals are the SFT stage's alone
    assert list(losses_by_method(jobs, "plain")) == ["sft"]
    plot_losses(jobs, ["rl", "plain"], runs)
    widths = {name: png_width(runs / name / "loss.png") for name in ("rl", "plain")}
    assert widths["rl"] > 2.2 * widths["plain"]  # the SFT loss, the GRPO loss and the rewards: three panels


def test_a_short_stages_one_logged_loss_is_drawn_as_a_dot_not_an_invisible_line():
    """A first own run (8 steps) drew its loss.png with empty panels: a line through one point shows
    nothing. Few points get a marker each; a long curve stays a plain line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eval.report_plots import FEW_POINTS, draw, draw_rewards

    fig, (ax, rewards_ax) = plt.subplots(1, 2)
    draw(ax, "short", [(1, 1.75)], [(8, 0.87)], [])
    draw(ax, "long", [(step, 1.0) for step in range(FEW_POINTS + 1)], [], [])
    draw_rewards(rewards_ax, "short", {"rewards/accuracies": [(9, 0.0)]})
    markers = {line.get_label(): line.get_marker() for line in [*ax.lines, *rewards_ax.lines]}
    plt.close(fig)
    assert markers["short train"] == "o" and markers["short rewards/accuracies"] == "o"
    assert markers["long train"] in ("None", "", None)
