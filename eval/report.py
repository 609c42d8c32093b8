"""The comparison report: one row per experiment (and per published baseline), one per job (what it held
of the cluster, its Trainer clock, GPU utilisation, tokens/s), loss curves, as files.

Takes the run root's jobs as typed records (core/runs.py `JobRun`: each job's state, resources and
summary.json, read once by slurm/watching/reporting.py) and reads the rest of the run folders itself:
`metrics.jsonl` of each stage, `results.json` of the eval job. It never sees the plan or the scheduler.
GPU-hours are what the cluster charged: each job's elapsed time x the GPUs it held, every requeue, eval
jobs and a pack's idle lanes included, as the launcher found them (`usage`: slurm/watching/usage.py, from sacct or
a local job's own clock). A job without such a figure (run by hand, unknown to the scheduler) counts its
Trainer clock x its GPUs, and the report says so; a CPU run (device "cpu") costs no GPU-hours.
An experiment that failed or never ran is a row that says so, never a silent gap.

The points of a `sweep:` block (core/sweep.py) are compared like with like: one table per sweep, a row per
point, its replicates (one per seed) as mean ± sample standard deviation; a point whose seeds have not all
finished says so instead of averaging fewer. report.csv keeps one row per replicate. A pruned sweep's
table is followed by its runs' losses at each rung, where each was pruned and against which cutoff
(core/pruning.py's records), and what pruning spent and saved; a point with a pruned seed is never the best.

Did fine-tuning help? An experiment may have a base-model eval (`base_evals`): a job that scored the base
model, without any adapter, on the same prompts, metrics, generation settings and split. Its row heads the
task's table (`base (no adapter)`), and each experiment gets a Δ per score: its own score minus its own
base's (in report.csv: delta_<metric>). An experiment whose base was left out says why under the table.

Here: write_report, the entry, and the published baselines (baselines.yaml). The rows are built in
eval/report_rows.py, laid out as Markdown and CSV in eval/report_tables.py, the sweep and pruning tables in
eval/report_sweeps.py, the loss curves drawn in eval/report_plots.py.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from core.files import write_atomic
from core.rundir import RunRoot
from core.runs import JobRun, ReportInput
from eval.report_plots import plot_losses
from eval.report_rows import JOB_COLUMNS, present_columns, scored_rows, tasks_of, with_deltas
from eval.report_sweeps import sweep_points, sweep_section
from eval.report_tables import (
    csv_text,
    description_lines,
    incomparable_lines,
    left_out_lines,
    to_markdown,
    totals_text,
)


class BaselinesError(ValueError):
    """baselines.yaml is not as documented (docs/configuring.md)."""

    def __init__(self, message: str, path: Path):
        super().__init__(message)
        self.path = path


def baseline_sets(path: Path | None) -> dict[str, tuple[list[dict], str]]:
    """{task: (rows, source)} from baselines.yaml: one set (`task`, `source`, `baselines`) or a list of
    them under `sets`. Published numbers are only comparable on the task they were measured on."""
    data = yaml.safe_load(path.read_text()) if path and path.is_file() else None
    if not data:
        return {}
    sets = data.get("sets", [data]) if isinstance(data, dict) else None
    found = {}
    for number, entry in enumerate(sets or [None], 1):
        if not isinstance(entry, dict) or not entry.get("task"):
            raise BaselinesError(
                f"set {number} has no `task`: name the task its numbers were measured on "
                "(an experiment's `task:` key), so they are shown only beside experiments on that task",
                path,
            )
        rows = [{"experiment": b["name"], "status": "published", **b} for b in entry.get("baselines", [])]
        found[entry["task"]] = (rows, entry.get("source", ""))
    return found


def write_report(report: ReportInput) -> list[Path]:
    """report.md (one table per task, each with the published baselines of that task, then one table per
    sweep), report.csv (every row, with its task) and the loss curves, from `report` (core/runs.py
    ReportInput says what each part is: the run root's records, nothing of the plan or the scheduler).
    A job's own usage figure is its `used`; without one it counts its Trainer clock."""
    if not isinstance(report, ReportInput) or not all(isinstance(job, JobRun) for job in report.jobs):
        raise TypeError("write_report takes a core.runs.ReportInput of the run root's JobRun records")
    jobs, run_root, tasks, sweeps = report.jobs, report.run_root, report.tasks, report.sweeps
    base_evals, usage, gpu_hour_cost = report.base_evals, report.usage, report.gpu_hour_cost
    rows, bases, job_rows, stages = scored_rows(jobs, tasks, base_evals, gpu_hour_cost)
    published = published_baselines(report.baselines)
    groups = tasks_of(rows)
    extra = [b | {"task": task} for task in groups if task in published for b in published[task][0]]
    plain = [r for r in rows if r["experiment"] not in sweeps]  # sweep points get their sweep's table
    base_rows = [b for task in groups for b in bases[task]]
    # Each experiment's evaluated earlier stages just above it (base, SFT, DPO read top to bottom); a sweep
    # point's are left out with it (its sweep's table has none).
    in_order = [
        line for r in rows for line in [*([] if r["experiment"] in sweeps else stages[r["experiment"]]), r]
    ]
    staged = [line for line in in_order if line["experiment"] not in sweeps]
    columns = with_deltas(present_columns(staged + base_rows), staged)
    extra_columns = sorted({k for r in extra for k in r} - set(columns) - {"name", "task"})
    run_root.mkdir(parents=True, exist_ok=True)
    written = [*plot_losses(jobs, [row["experiment"] for row in rows], run_root, sweeps)]
    md = ["# Experiment report", ""]
    for task in groups:
        if len(groups) > 1:
            md += [f"## Task: {task or '(no task set)'}", ""]
        members = (
            bases[task] + [r for r in staged if r["task"] == task] + [r for r in extra if r["task"] == task]
        )
        if members or not sweeps:
            md += [to_markdown(members, columns + extra_columns), ""]
        md += incomparable_lines([r for r in staged if r["task"] == task])
        md += left_out_lines([r["experiment"] for r in plain if r["task"] == task], base_evals)
        md += description_lines(
            [r["experiment"] for r in rows if r["task"] == task], report.descriptions, sweeps
        )
        if task in published and published[task][1]:
            md += [f"Published baselines ({task}): {published[task][1]}.", ""]
        for sweep, points in sweep_points([r for r in rows if r["task"] == task], sweeps).items():
            md += sweep_section(sweep, points, sweeps, base_evals, run_root)
    md += ["## Jobs", "", to_markdown(list(job_rows.values()), list(JOB_COLUMNS)), ""]
    md += [totals_text(list(job_rows.values()), usage, gpu_hour_cost), ""]
    md += [f"![loss curves]({p.relative_to(run_root)})" for p in written[:1]]
    root = RunRoot(run_root)
    write_atomic(root.report, "\n".join(md) + "\n")
    write_atomic(root.report_table, csv_text(in_order, extra, sweeps, base_rows))
    return [root.report, root.report_table, *written]


def published_baselines(baselines: Path | list[Path] | None) -> dict[str, tuple[list[dict], str]]:
    """Task → (its published rows, their source), from every baselines.yaml found."""
    published: dict[str, tuple[list[dict], str]] = {}
    for path in [baselines] if isinstance(baselines, Path) else baselines or []:
        published = baseline_sets(path) | published  # the first file naming a task wins
    return published
