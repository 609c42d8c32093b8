"""The comparison report: one row per experiment (and per published baseline), one per job (what it held
of the cluster, its Trainer clock, GPU utilisation, tokens/s), loss curves, as files.

Reads run directories: `summary.json` and `metrics.jsonl` of each stage, `results.json` of the eval job.
GPU-hours are what the cluster charged: each job's elapsed time x the GPUs it held, every requeue, eval
jobs and a pack's idle lanes included, as the launcher found them (`usage`: slurm/usage.py, from sacct or
a local job's own clock). A job without such a figure (run by hand, unknown to the scheduler) counts its
Trainer clock x its GPUs, and the report says so; a CPU run (device "cpu") costs no GPU-hours.
An experiment that failed or never ran is a row that says so, never a silent gap.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import yaml

from spec.files import read_jsonl, write_atomic
from spec.names import REPORT_COLUMNS
from spec.rundir import METRICS_FIELDS, RunDir

COLUMNS = (
    "experiment",
    "status",
    "model",
    "method",
    "stages",
    "trainable_%",
    "train_min",
    "gpu_hours",
    "gpu_util_%",
    "tokens_per_s",
    "cost",
    "best_eval_loss",
    "eval_split",
    *REPORT_COLUMNS.values(),
)


def read_summary(run_dir: str | Path) -> dict:
    return RunDir.of(run_dir).read_summary()


def read_results(run_dir: str | Path) -> dict:
    return RunDir.of(run_dir).read_results()


def read_metrics(run_dir: str | Path) -> list[dict]:
    return read_jsonl(RunDir.of(run_dir).metrics, METRICS_FIELDS)


JOB_COLUMNS = (
    "job",
    "state",
    "gpus",
    "attempts",
    "held_min",
    "train_min",
    "gpu_hours",
    "counted_from",
    "gpu_util_%",
    "tokens_per_s",
)
TRAINER_CLOCK = "Trainer clock (no scheduler record)"


def job_row(job, states: dict[str, str], used) -> dict:
    """One job's use of the cluster: what it held (`used`: a JobUsage of slurm/usage.py, or None), and for
    a training stage its Trainer clock and speed: where a curriculum's time went."""
    train = job.kind == "train"
    summary = read_summary(job.run_dir) if train else {}
    ended = summary or (not train and RunDir.of(job.run_dir).results.is_file())
    runtime_s = summary.get("train_runtime_s") or 0
    return {
        "job": job.id,
        "state": states.get(job.id) or ("COMPLETED" if ended else None),
        **held(job, summary, used),
        "train_min": round(runtime_s / 60, 2) if runtime_s else None,
        "gpu_util_%": mean_gpu_util([job]) if train else None,
        "tokens_per_s": tokens_per_s([summary]),
    }


def held(job, summary: dict, used) -> dict:
    """gpus, attempts, held_min, gpu_hours and counted_from: the scheduler's figures, else the Trainer's
    clock x the GPUs the stage ran on (none when it ran on the CPU: a local run on a CPU machine)."""
    if used is not None:
        return {
            "gpus": used.gpus,
            "attempts": used.attempts,
            "held_min": round(used.held_s / 60, 2),
            "gpu_hours": round(used.gpu_hours, 4),
            "counted_from": used.source,
        }
    runtime_s = summary.get("train_runtime_s")
    if not runtime_s:
        return {}
    gpus = 0 if summary.get("device") == "cpu" else job.resources.gpus
    return {"gpus": gpus, "gpu_hours": round(runtime_s * gpus / 3600, 4), "counted_from": TRAINER_CLOCK}


def experiment_row(plan, experiment: str, states: dict[str, str], job_rows: dict[str, dict]) -> dict:
    """`job_rows`: job_row of every job, by job id."""
    jobs = [j for j in plan.jobs if j.experiment == experiment]
    train_jobs = [j for j in jobs if j.kind == "train"]
    first = train_jobs[0].spec
    summaries = [read_summary(j.run_dir) for j in train_jobs]
    runtime_s = sum(s.get("train_runtime_s") or 0 for s in summaries)
    losses = [s["best_eval_loss"] for s in summaries if s.get("best_eval_loss") is not None]
    eval_job = next((j for j in jobs if j.id == f"{experiment}/eval"), None)
    results = read_results(eval_job.run_dir) if eval_job else {}
    row = {
        "experiment": experiment,
        "status": status_text(jobs, states, bool(results)),
        "model": first.model.name_or_path,
        "method": first.adapter.method,
        "stages": " → ".join(j.stage for j in train_jobs),
        "trainable_%": next(
            (s.get("trainable_percent") for s in summaries if s.get("trainable_percent")), None
        ),
        "train_min": round(runtime_s / 60, 2) if runtime_s else None,
        "gpu_hours": total_gpu_hours([job_rows[j.id] for j in jobs]),
        "gpu_util_%": mean_gpu_util(train_jobs),
        "tokens_per_s": tokens_per_s(summaries),
        "best_eval_loss": min(losses) if losses else None,
    }
    row["eval_split"] = split_marker(results)
    row.update({column: results.get(key) for key, column in REPORT_COLUMNS.items()})
    return row


def total_gpu_hours(rows: list[dict]) -> float | None:
    """Their GPU-hours together; None when no job has a figure (none ran)."""
    known = [r["gpu_hours"] for r in rows if r.get("gpu_hours") is not None]
    return round(sum(known), 4) if known else None


def mean_gpu_util(train_jobs) -> float | None:
    """Mean GPU utilisation (%) over the metrics rows of every stage, each row being the mean of the samples
    since the row before (rows come every logging_steps, so about evenly in time); None when no row has
    one: no GPU, or no NVML on the node."""
    values = [
        row["gpu_util_percent"]
        for job in train_jobs
        for row in read_metrics(job.run_dir)
        if row.get("gpu_util_percent") is not None
    ]
    return round(sum(values) / len(values), 1) if values else None


def tokens_per_s(summaries: list[dict]) -> float | None:
    """Non-pad input tokens per second of training, over all stages and ranks: the Trainer counts only
    non-padding tokens (include_num_input_tokens_seen), so padding waste lowers the figure instead of
    hiding in it. Training time includes in-training evals and checkpoint saves, as GPU-hours do."""
    tokens = sum(s.get("num_input_tokens_seen") or 0 for s in summaries)
    runtime_s = sum(s.get("train_runtime_s") or 0 for s in summaries)
    return round(tokens / runtime_s, 1) if tokens and runtime_s else None


def split_marker(results: dict) -> str | None:
    """Which data the scores come from; scores on the training data are flagged, never mistaken for eval."""
    split = results.get("split")
    return "TRAIN (scored on training data)" if split == "train" else split


def status_text(jobs, states: dict[str, str], has_results: bool) -> str:
    if has_results:
        flagged = any(
            read_results(j.run_dir).get("adapter_changes_output") is False for j in jobs if j.kind == "eval"
        )
        return "complete (adapter did not change outputs!)" if flagged else "complete"
    bad = [
        f"{j.stage} {states[j.id]}" for j in jobs if states.get(j.id) not in (None, "COMPLETED", "PLANNED")
    ]
    return ("missing: " + ", ".join(bad)) if bad else "missing: not run yet"


class BaselinesError(ValueError):
    """baselines.yaml is not as documented (configs/README.md)."""

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


def to_markdown(rows: list[dict], columns: list[str]) -> str:
    def cell(value) -> str:
        if value is None:
            return "–"
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_report(
    plan,
    run_root: Path,
    states: dict[str, str] | None = None,
    baselines: Path | list[Path] | None = None,
    tasks: dict[str, str | None] | None = None,
    gpu_hour_cost: float | None = None,
    usage=None,
) -> list[Path]:
    """report.md (one table per task, each with the published baselines of that task), report.csv (every
    row, with its task) and the loss curves. `tasks`: experiment name → its `task:` (None: not set);
    `gpu_hour_cost` (cluster.yaml) adds a cost per experiment and in total; `usage` (a PlanUsage of
    slurm/usage.py) is what each job held, without it every job counts its Trainer clock."""
    states, tasks = states or {}, tasks or {}
    used = usage.jobs if usage is not None else {}
    experiments = list(dict.fromkeys(j.experiment for j in plan.jobs))
    job_rows = {j.id: job_row(j, states, used.get(j.id)) for j in plan.jobs}
    rows = [experiment_row(plan, name, states, job_rows) | {"task": tasks.get(name)} for name in experiments]
    if gpu_hour_cost is not None:
        for row in rows:
            row["cost"] = round(row["gpu_hours"] * gpu_hour_cost, 2) if row["gpu_hours"] is not None else None
    published: dict[str, tuple[list[dict], str]] = {}
    for path in [baselines] if isinstance(baselines, Path) else baselines or []:
        published = baseline_sets(path) | published  # the first file naming a task wins
    groups = list(dict.fromkeys(row["task"] for row in rows))
    extra = [b | {"task": task} for task in groups if task in published for b in published[task][0]]
    columns = [c for c in COLUMNS if c in ("experiment", "status") or any(r.get(c) is not None for r in rows)]
    extra_columns = sorted({k for r in extra for k in r} - set(columns) - {"name", "task"})
    run_root.mkdir(parents=True, exist_ok=True)
    written = [*plot_losses(plan, experiments, run_root)]
    md = ["# Experiment report", ""]
    for task in groups:
        if len(groups) > 1:
            md += [f"## Task: {task or '(no task set)'}", ""]
        members = [r for r in rows if r["task"] == task] + [r for r in extra if r["task"] == task]
        md += [to_markdown(members, columns + extra_columns), ""]
        if task in published and published[task][1]:
            md += [f"Published baselines ({task}): {published[task][1]}.", ""]
    md += ["## Jobs", "", to_markdown(list(job_rows.values()), list(JOB_COLUMNS)), ""]
    md += [totals_text(list(job_rows.values()), usage, gpu_hour_cost), ""]
    md += [f"![loss curves]({p.relative_to(run_root)})" for p in written[:1]]
    write_atomic(run_root / "report.md", "\n".join(md) + "\n")
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns + extra_columns + ["task"], extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows + extra)
    write_atomic(run_root / "report.csv", buffer.getvalue())
    return [run_root / "report.md", run_root / "report.csv", *written]


def totals_text(job_rows: list[dict], usage, gpu_hour_cost: float | None) -> str:
    """The whole plan's GPU-hours and cost, each pack's allocation, and which jobs had no scheduler figure."""
    gpu_hours = total_gpu_hours(job_rows) or 0.0
    train_h = sum(r["train_min"] or 0 for r in job_rows) / 60
    total = (
        f"All jobs: {gpu_hours:.2f} GPU-hours allocated (elapsed x GPUs held: every requeue, model loading, "
        f"eval jobs and packs' idle lanes included); the Trainer's clocks add up to {train_h:.2f} hours"
    )
    if gpu_hour_cost is not None:
        total += f"; cost {gpu_hours * gpu_hour_cost:.2f} (at {gpu_hour_cost:g} per GPU-hour)"
    lines = [total + "."]
    for pack in usage.packs if usage is not None else ():
        busy = f", lanes busy {pack.busy:.0%}" if pack.busy is not None else ""
        lines.append(
            f"Pack {pack.job_id}: {pack.gpus} GPUs x {pack.held_s / 60:.1f} min = {pack.gpu_hours:.2f} "
            f"GPU-hours{busy}, shared by its units in proportion to their lane time."
        )
    clocked = [r["job"] for r in job_rows if r.get("counted_from") == TRAINER_CLOCK]
    if clocked:
        unknown = (
            f"; sacct knew nothing of job(s) {', '.join(usage.unanswered)}"
            if usage and usage.unanswered
            else ""
        )
        lines.append(
            f"{len(clocked)} job(s) counted from the Trainer's clock, a lower bound (model loading, restarts "
            f"and evals left out): {', '.join(clocked)}{unknown}."
        )
    return "\n\n".join(lines)


def loss_series(plan, experiment: str) -> tuple[list, list, list]:
    """(train points, eval points, stage boundaries) with steps counted across stages."""
    train, evals, boundaries, offset = [], [], [], 0
    for job in (j for j in plan.jobs if j.experiment == experiment and j.kind == "train"):
        rows = read_metrics(job.run_dir)
        train += [(offset + r["step"], r["loss"]) for r in rows if "loss" in r and "step" in r]
        evals += [(offset + r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r and "step" in r]
        offset += max((r.get("step", 0) for r in rows), default=0)
        boundaries.append((offset, job.stage))
    return train, evals, boundaries[:-1]


def plot_losses(plan, experiments: list[str], run_root: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {name: loss_series(plan, name) for name in experiments}
    series = {k: v for k, v in series.items() if v[0] or v[1]}
    if not series:
        return []
    paths = [run_root / "loss_curves.png"]
    fig, ax = plt.subplots(figsize=(9, 5))
    for name, (train, evals, boundaries) in series.items():
        draw(ax, name, train, evals, boundaries)
    finish(ax, "Loss of every experiment (dotted lines: stage boundaries)")
    fig.savefig(paths[0], dpi=110, bbox_inches="tight")
    plt.close(fig)
    for name, (train, evals, boundaries) in series.items():
        fig, ax = plt.subplots(figsize=(7, 4))
        draw(ax, name, train, evals, boundaries, label_stages=True)
        finish(ax, f"{name}: loss")
        paths.append(run_root / name / "loss.png")
        paths[-1].parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)
    return paths


def draw(ax, name, train, evals, boundaries, label_stages=False) -> None:
    line = None
    if train:
        (line,) = ax.plot(*zip(*train, strict=True), label=f"{name} train")
    if evals:
        color = line.get_color() if line else None
        ax.plot(*zip(*evals, strict=True), "o--", color=color, label=f"{name} eval")
    for step, stage in boundaries:
        ax.axvline(step, color=line.get_color() if line else "grey", linestyle=":", alpha=0.7)
        if label_stages:
            ax.annotate(
                f"end of {stage}",
                (step, 1),
                xycoords=("data", "axes fraction"),
                fontsize=8,
                rotation=90,
                va="top",
                ha="right",
            )


def finish(ax, title: str) -> None:
    ax.set_xlabel("optimizer step (across stages)")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
