"""The report reads run folders only: a finished experiment gets its numbers, a failed one a row that says so."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import launch
from eval.report import write_report
from slurm.experiments import load_experiments
from slurm.plan import build_plan
from slurm.profile import load_profile
from tests.conftest import write_cluster_yaml

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
    written = write_report(plan, runs, states, repo_root / "configs" / "baselines.yaml", tasks)

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

    write_report(plan, runs)

    rows = {r["experiment"]: r for r in csv.DictReader((runs / "report.csv").open())}
    assert rows["held-out"]["eval_split"] == "eval"
    assert rows["on-train"]["eval_split"] == "TRAIN (scored on training data)"
    assert "| TRAIN (scored on training data) |" in (runs / "report.md").read_text()


def test_a_cpu_run_costs_no_gpu_hours_and_a_four_gpu_run_four_times_its_runtime(tmp_path, repo_root):
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
    assert "Training: 4.00 GPU-hours, cost 10.00 (at 2.5 per GPU-hour)." in report
    # A stage that found no GPU (summary.json device "cpu": a local run on a CPU machine) held none.
    summary = runs / "four" / "one" / "summary.json"
    summary.write_text(json.dumps(json.loads(summary.read_text()) | {"device": "cpu"}))
    assert launch.main(["--config-dir", str(tmp_path / "configs"), "--report"]) == 0
    assert "Training: 2.00 GPU-hours, cost 5.00" in (runs / "report.md").read_text()
    assert "| four/one | PLANNED | 0 | 30 | 0 | – | – |" in (runs / "report.md").read_text()
    # Per stage: where the GPU-hours went (each stage 30 minutes on its own GPUs; never submitted here).
    assert "| four/two | PLANNED | 4 | 30 | 2 | – | – |" in report
    assert "| cpu/one | PLANNED | 0 | 30 | 0 | – | – |" in report


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
    write_report(plan, runs, {}, baselines, {"sql": "spider"})
    rows = {r["experiment"]: r for r in csv.DictReader((runs / "report.csv").open())}
    assert set(rows) == {"sql", "Seq2SQL"} and rows["Seq2SQL"]["task"] == "spider"
    assert "Ang" not in (runs / "report.md").read_text()

    baselines.write_text("source: Ang\nbaselines: [{name: T5-p, rouge_l: 0.211}]\n")
    with pytest.raises(BaselinesError, match="set 1 has no `task`"):
        write_report(plan, runs, {}, baselines, {"sql": "spider"})


def test_our_bertscore_f1_fills_the_bertscore_column_of_the_published_baselines(tmp_path, repo_root):
    # results.json says bertscore_f1; baselines.yaml (as published tables) says bertscore. Two columns
    # would put our number where no baseline can be compared with it.
    plan = plan_of(tmp_path, "qg")
    runs = tmp_path / "runs"
    (runs / "qg" / "eval").mkdir(parents=True)
    (runs / "qg" / "eval" / "results.json").write_text(
        json.dumps({"n": 3, "bleu": 0.02, "bertscore_f1": 0.7})
    )
    write_report(plan, runs, {}, repo_root / "configs" / "baselines.yaml", {"qg": "socratiq-qg"})
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
            summary_path.write_text(json.dumps(summary))
            if name == "gpu":
                rows = [
                    {"step": i, "loss": 2.0} | ({"gpu_util_percent": u} if u else {})
                    for i, u in enumerate(utils)
                ]
                (runs / name / stage / "metrics.jsonl").write_text(
                    "".join(json.dumps(r) + "\n" for r in rows)
                )
    write_report(plan, runs)
    rows = {r["experiment"]: r for r in csv.DictReader((runs / "report.csv").open())}
    assert float(rows["gpu"]["gpu_util_%"]) == 80.0  # (80 + 90 + 70) / 3: a row without samples is no 0 %
    assert float(rows["gpu"]["tokens_per_s"]) == float(rows["cpu"]["tokens_per_s"]) == 25.0
    assert rows["cpu"]["gpu_util_%"] == ""  # no GPU: empty, not 0
    # Per stage: one's 85 % and 20 tokens/s, two's 70 % and 30 tokens/s (plan_of's stages have 1 GPU;
    # no scheduler states given: a stage with its summary.json finished).
    report = (runs / "report.md").read_text()
    assert "| gpu/one | COMPLETED | 1 | 30 | 0.5 | 85 | 20 |" in report
    assert "| gpu/two | COMPLETED | 1 | 30 | 0.5 | 70 | 30 |" in report
    assert "| cpu/two | COMPLETED | 1 | 30 | 0.5 | – | 30 |" in report
