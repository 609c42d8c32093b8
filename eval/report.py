"""The comparison report: one row per experiment (and per published baseline), one per job (what it held
of the cluster, its Trainer clock, GPU utilisation, tokens/s), loss curves, as files.

Takes the run root's jobs as typed records (core/runs.py `JobRun`: each job's state, resources and
summary.json, read once by slurm/commands/report.py) and reads the rest of the run folders itself:
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
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from functools import partial
from pathlib import Path

import yaml

from core.files import read_jsonl, write_atomic, write_atomic_with
from core.names import REPORT_COLUMNS
from core.pruning import latest_by_run, rung_records
from core.rundir import METRICS_FIELDS, RunDir, read_spec
from core.runs import BaseEval, JobRun, PlanUsage
from core.split import label as split_label
from core.states import State
from core.sweep import SweepMember

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
    "eval_turns",
    *REPORT_COLUMNS.values(),
)


# The score columns a Δ is computed for (not losses, time or cost: "did it help" is a question of scores).
SCORE_COLUMNS = tuple(REPORT_COLUMNS.values())
DELTA = "delta_"  # report.csv's name of a score's Δ column: delta_rouge_l; report.md shows "Δ rouge_l"
BASE_LABEL = "base (no adapter)"


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
    "micro_batch",
)
TRAINER_CLOCK = "Trainer clock (no scheduler record)"


def job_row(job: JobRun) -> dict:
    """One job's use of the cluster: what it held (`job.used`), and for a training stage its Trainer clock
    and speed: where a curriculum's time went."""
    train = job.kind == "train"
    summary = job.summary
    ended = summary or (not train and RunDir.of(job.run_dir).results.is_file())
    runtime_s = summary.get("train_runtime_s") or 0
    state = job.state or (State.COMPLETED if ended else None)
    return {
        "job": job.id,
        "state": state.value if state else None,
        **held(job),
        "train_min": round(runtime_s / 60, 2) if runtime_s else None,
        "gpu_util_%": mean_gpu_util([job]) if train else None,
        "tokens_per_s": tokens_per_s([summary]),
        "micro_batch": split_label(summary.get("split")),
    }


def held(job: JobRun) -> dict:
    """gpus, attempts, held_min, gpu_hours and counted_from: the scheduler's figures, else the Trainer's
    clock x the GPUs the stage ran on (none when it ran on the CPU: a local run on a CPU machine)."""
    used, summary = job.used, job.summary
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
    gpus = 0 if summary.get("device") == "cpu" else job.gpus
    return {"gpus": gpus, "gpu_hours": round(runtime_s * gpus / 3600, 4), "counted_from": TRAINER_CLOCK}


def experiment_row(jobs: list[JobRun], experiment: str, job_rows: dict[str, dict]) -> dict:
    """`jobs`: the experiment's; `job_rows`: job_row of every job, by job id."""
    train_jobs = [j for j in jobs if j.kind == "train"]
    first = train_jobs[0]
    summaries = [j.summary for j in train_jobs]
    runtime_s = sum(s.get("train_runtime_s") or 0 for s in summaries)
    losses = [s["best_eval_loss"] for s in summaries if s.get("best_eval_loss") is not None]
    eval_job = next((j for j in jobs if j.id == f"{experiment}/eval"), None)
    results = read_results(eval_job.run_dir) if eval_job else {}
    row = {
        "experiment": experiment,
        "status": status_text(jobs, bool(results)),
        "model": first.model,
        "method": first.method,
        "stages": " → ".join(j.stage for j in train_jobs),
        "trainable_%": next(
            (s.get("trainable_percent") for s in summaries if s.get("trainable_percent")), None
        ),
        "train_min": round(runtime_s / 60, 2) if runtime_s else None,
        "gpu_hours": total_gpu_hours([job_rows[j.id] for j in jobs]),
        "gpu_util_%": mean_gpu_util(train_jobs),
        "tokens_per_s": tokens_per_s(summaries),
        "best_eval_loss": min(finite) if (finite := [v for v in losses if math.isfinite(v)]) else None,
    }
    row["eval_split"] = split_marker(results)
    row["eval_turns"] = turns_marker(results)
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


def turns_marker(results: dict) -> str | None:
    """Which assistant turns of conversations were scored (eval.turns): `last`, or `all (57 answers)`;
    None for data that is no conversation."""
    turns = results.get("turns")
    if turns == "all":
        return f"all ({results.get('answers_scored', '?')} answers)"
    return turns


UNCHANGED = "complete (adapter did not change outputs!)"  # done, but the adapter changed no prediction


PRUNED = "pruned"  # a pruned sweep's run stopped at a rung: ended, but not a complete run


def status_text(jobs: list[JobRun], has_results: bool) -> str:
    pruned = next(
        (note for j in jobs if j.kind == "train" and (note := RunDir.of(j.run_dir).read_pruned())), None
    )
    if pruned:
        return f"{PRUNED} at rung {pruned['rung']:g}" if "rung" in pruned else PRUNED
    if has_results:
        flagged = any(
            read_results(j.run_dir).get("adapter_changes_output") is False for j in jobs if j.kind == "eval"
        )
        return UNCHANGED if flagged else "complete"
    if all(j.kind == "train" and j.state and j.state.finished for j in jobs):
        return "complete (no eval asked)"  # before: "missing: not run yet" for a trained experiment
    bad = [
        f"{j.stage} {j.state.value}"
        for j in jobs
        if j.state not in (None, State.COMPLETED, State.PRUNED, State.PLANNED)
    ]
    return ("missing: " + ", ".join(bad)) if bad else "missing: not run yet"


# Base-model evals: the base model without any adapter, scored as the experiments are; their rows and Δs.


def base_row(base: BaseEval, state: State | None, job_rows: dict[str, dict]) -> dict:
    """A base eval's numbers, in the experiment rows' columns (labelled by task_base_rows). `job_rows`: its
    GPU-hours, when the job is in the plan."""
    results = read_results(base.out_dir)
    scores = {column: results.get(key) for key, column in REPORT_COLUMNS.items()}
    has_scores = any(v is not None for v in scores.values())
    return {
        "job_id": base.job_id,
        "status": "complete" if has_scores else base_status(state),
        "model": base.model,
        "gpu_hours": job_rows.get(base.job_id, {}).get("gpu_hours"),
        "eval_split": split_marker(results),
        "eval_turns": turns_marker(results),
        **scores,
    }


def base_status(state: State | None) -> str:
    """What a base eval without scores is: as status_text says of an experiment's eval job. A COMPLETED
    job without scores is said as such, not 'not run yet': it ran, and its results.json is missing."""
    return "missing: not run yet" if state in (None, State.PLANNED) else f"missing: eval {state.value}"


def deltas(row: dict, base: dict | None) -> dict:
    """delta_<score>: the experiment's score minus its base's, for every score column; None where either
    is missing, where there is no base (`base` None: left out), or where they scored different splits (a
    results.json without `split` predates the setting, when only the eval data was scored)."""
    comparable = base is not None and (base.get("eval_split") or "eval") == (row.get("eval_split") or "eval")
    found = {}
    for column in SCORE_COLUMNS:
        mine, theirs = row.get(column), base.get(column) if base else None
        ok = comparable and mine is not None and theirs is not None
        # Rounded to 10 places: 0.6 - 0.5 is 0.09999999999999998 in floats, and report.csv shows it raw.
        found[DELTA + column] = round(float(mine) - float(theirs), 10) if ok else None
    return found


def tasks_of(rows: list[dict]) -> list:
    """The rows' tasks, in plan order: a table each."""
    return list(dict.fromkeys(row["task"] for row in rows))


def task_base_rows(task, rows: list[dict], base_evals: dict[str, BaseEval], scored: dict[str, dict]) -> list:
    """The base rows heading `task`'s table: one per distinct base eval of its experiments (a sweep
    point's included: its Δs are against them), `base (no adapter)`, or with the model when there are
    several (and the job when two score one model: two eval sets of one task)."""
    jobs = [
        base_evals[r["experiment"]].job_id
        for r in rows
        if r["task"] == task and r["experiment"] in base_evals
    ]
    jobs = list(dict.fromkeys(job for job in jobs if job in scored))
    models = [scored[job]["model"] for job in jobs]
    found = []
    for job, model in zip(jobs, models, strict=True):
        label = BASE_LABEL if len(jobs) == 1 else f"{BASE_LABEL}: {model}"
        label += f" ({job})" if models.count(model) > 1 else ""
        found.append(scored[job] | {"experiment": label, "task": task})
    return found


def with_deltas(columns: list[str], rows: list[dict]) -> list[str]:
    """`columns` with each score's Δ column after it, where some row has a base eval (its delta_ key)."""
    found = []
    for column in columns:
        found.append(column)
        if column in SCORE_COLUMNS and any(DELTA + column in r for r in rows):
            found.append(DELTA + column)
    return found


def left_out_lines(experiments: list[str], base_evals: dict[str, BaseEval]) -> list[str]:
    """`No base row for EXP: REASON.`, experiments left out for one reason on one line."""
    reasons: dict[str, list[str]] = {}
    for name in experiments:
        base = base_evals.get(name)
        if base is not None and base.left_out:
            reasons.setdefault(base.left_out.rstrip(". "), []).append(name)
    return [
        line
        for reason, names in reasons.items()
        for line in (f"No base row for {', '.join(names)}: {reason}.", "")
    ]


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
    def cell(value, signed: bool) -> str:
        if value is None:
            return "–"
        if isinstance(value, float):
            return f"{value:+.4g}" if signed else f"{value:.4g}"
        return escaped(str(value))

    lines = ["| " + " | ".join(escaped(header(c)) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c), c.startswith(DELTA)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def escaped(text: str) -> str:
    """A table cell's text as Markdown shows it: a `|` (a baseline named `T5 | base`) would end the cell
    and move every number after it one column right; a line break would end the row."""
    return " ".join(text.replace("\\", "\\\\").replace("|", "\\|").split())


def description_lines(
    names: list[str], descriptions: dict[str, str], sweeps: dict[str, SweepMember]
) -> list[str]:
    """`- **NAME**: its description` for each experiment of a table that has one (a sweep's once, by its
    name): what configs/README.md promises `description:` is for."""
    shown: dict[str, str] = {}
    for name in names:
        text = " ".join(str(descriptions.get(name) or "").split())
        if text:
            shown.setdefault(sweeps[name].sweep if name in sweeps else name, text)
    return [f"- **{escaped(name)}**: {text}" for name, text in shown.items()] + ([""] if shown else [])


def header(column: str) -> str:
    """A column's heading in report.md: delta_rouge_l is shown as Δ rouge_l."""
    return f"Δ {column.removeprefix(DELTA)}" if column.startswith(DELTA) else column


def write_report(
    jobs: list[JobRun],
    run_root: Path,
    baselines: Path | list[Path] | None = None,
    tasks: dict[str, str | None] | None = None,
    gpu_hour_cost: float | None = None,
    usage: PlanUsage | None = None,
    sweeps: dict[str, SweepMember] | None = None,
    base_evals: dict[str, BaseEval] | None = None,
    descriptions: dict[str, str] | None = None,
) -> list[Path]:
    """report.md (one table per task, each with the published baselines of that task, then one table per
    sweep), report.csv (every row, with its task) and the loss curves. `jobs`: the run root's, in plan
    order (core/runs.py; nothing else: the report never drives the plan). `tasks`: experiment name → its
    `task:` (None: not set); `gpu_hour_cost` (cluster.yaml) adds a cost per experiment and in total;
    `usage`: what the packs held, which jobs sacct knew nothing of (a job's own figure is its `used`;
    without one it counts its Trainer clock); `sweeps`: experiment name → the sweep point it is (absent:
    not a sweep point); `base_evals`: experiment name → its base-model eval (absent: none, no Δ);
    `descriptions`: experiment name → its `description:`, listed under its task's table."""
    if not all(isinstance(job, JobRun) for job in jobs):  # a plan handed in would be read half-right
        raise TypeError("write_report takes the run root's jobs as core.runs.JobRun records")
    tasks, sweeps, base_evals = tasks or {}, sweeps or {}, base_evals or {}
    rows, bases, job_rows = scored_rows(jobs, tasks, base_evals, gpu_hour_cost)
    published = published_baselines(baselines)
    groups = tasks_of(rows)
    extra = [b | {"task": task} for task in groups if task in published for b in published[task][0]]
    plain = [r for r in rows if r["experiment"] not in sweeps]  # sweep points get their sweep's table
    base_rows = [b for task in groups for b in bases[task]]
    columns = with_deltas(present_columns(plain + base_rows), plain)
    extra_columns = sorted({k for r in extra for k in r} - set(columns) - {"name", "task"})
    run_root.mkdir(parents=True, exist_ok=True)
    written = [*plot_losses(jobs, [row["experiment"] for row in rows], run_root, sweeps)]
    md = ["# Experiment report", ""]
    for task in groups:
        if len(groups) > 1:
            md += [f"## Task: {task or '(no task set)'}", ""]
        members = (
            bases[task] + [r for r in plain if r["task"] == task] + [r for r in extra if r["task"] == task]
        )
        if members or not sweeps:
            md += [to_markdown(members, columns + extra_columns), ""]
        md += left_out_lines([r["experiment"] for r in plain if r["task"] == task], base_evals)
        md += description_lines(
            [r["experiment"] for r in rows if r["task"] == task], descriptions or {}, sweeps
        )
        if task in published and published[task][1]:
            md += [f"Published baselines ({task}): {published[task][1]}.", ""]
        for sweep, points in sweep_points([r for r in rows if r["task"] == task], sweeps).items():
            md += sweep_section(sweep, points, sweeps, base_evals, run_root)
    md += ["## Jobs", "", to_markdown(list(job_rows.values()), list(JOB_COLUMNS)), ""]
    md += [totals_text(list(job_rows.values()), usage, gpu_hour_cost), ""]
    md += [f"![loss curves]({p.relative_to(run_root)})" for p in written[:1]]
    write_atomic(run_root / "report.md", "\n".join(md) + "\n")
    write_atomic(run_root / "report.csv", csv_text(rows, extra, sweeps, base_rows))
    return [run_root / "report.md", run_root / "report.csv", *written]


def published_baselines(baselines: Path | list[Path] | None) -> dict[str, tuple[list[dict], str]]:
    """Task → (its published rows, their source), from every baselines.yaml found."""
    published: dict[str, tuple[list[dict], str]] = {}
    for path in [baselines] if isinstance(baselines, Path) else baselines or []:
        published = baseline_sets(path) | published  # the first file naming a task wins
    return published


def scored_rows(
    jobs: list[JobRun], tasks: dict, base_evals: dict[str, BaseEval], gpu_hour_cost: float | None
) -> tuple[list[dict], dict[str, list[dict]], dict[str, dict]]:
    """(each experiment's row with its Δs and cost, each task's base rows, each job's row by its id)."""
    state_of = {j.id: j.state for j in jobs}
    # Only experiments with a training job get a row: a base-model eval job is a plan job of its own
    # (experiment "baselines"), with no adapter to describe; it shows as its own row via base_evals.
    experiments = list(dict.fromkeys(j.experiment for j in jobs if j.kind == "train"))
    job_rows = {j.id: job_row(j) for j in jobs}
    rows = [
        experiment_row([j for j in jobs if j.experiment == name], name, job_rows) | {"task": tasks.get(name)}
        for name in experiments
    ]
    scored = {  # each base eval's row, by its job id: one job may serve many experiments
        base.job_id: base_row(base, state_of.get(base.job_id), job_rows)
        for base in base_evals.values()
        if not base.left_out
    }
    for row in rows:
        if row["experiment"] in base_evals:
            base = base_evals[row["experiment"]]
            row.update(deltas(row, None if base.left_out else scored[base.job_id]))
    bases = {task: task_base_rows(task, rows, base_evals, scored) for task in tasks_of(rows)}
    if gpu_hour_cost is not None:
        for row in rows + [b for task_bases in bases.values() for b in task_bases]:
            row["cost"] = round(row["gpu_hours"] * gpu_hour_cost, 2) if row["gpu_hours"] is not None else None
    return rows, bases, job_rows


def present_columns(rows: list[dict]) -> list[str]:
    """COLUMNS that some row has a value for (experiment and status always)."""
    return [c for c in COLUMNS if c in ("experiment", "status") or any(r.get(c) is not None for r in rows)]


def csv_text(
    rows: list[dict], extra: list[dict], sweeps: dict[str, SweepMember], base_rows: list[dict] = ()
) -> str:
    """Every experiment's row (each replicate of a sweep point its own, with its sweep, point, seed and
    swept values: the means of report.md can be recomputed from them, and its delta_<score> columns), the
    base-model evals' rows and the published baselines. No mean or std rows: a sum over the file (of
    gpu_hours, cost) would count a point twice; for the same reason a base eval shared by two tasks'
    experiments is one row, under the first task."""
    first: dict[str, dict] = {}
    for base in base_rows:
        first.setdefault(base["job_id"], base)
    rows = list(first.values()) + rows
    columns = with_deltas(present_columns(rows), rows)
    fields = columns + sorted({k for r in extra for k in r} - set(columns) - {"name", "task"}) + ["task"]
    members = [sweeps[r["experiment"]] for r in rows if r["experiment"] in sweeps]
    if members:
        fields += ["sweep", "point", "seed", *dict.fromkeys(key for m in members for key in m.swept)]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=fields, extrasaction="ignore")
    writer.writeheader()
    writer.writerows([row | sweep_fields(sweeps.get(row["experiment"])) for row in rows] + extra)
    return buffer.getvalue()


def sweep_fields(member: SweepMember | None) -> dict:
    if member is None:
        return {}
    return {"sweep": member.sweep, "point": member.point, "seed": member.seed, **member.values}


# Sweeps: a table per sweep, a row per point, its replicates' numbers as mean ± standard deviation.

# The numbers a sweep's points are compared on: losses, scores, and what a point cost.
SWEEP_METRICS = ("best_eval_loss", *REPORT_COLUMNS.values(), "train_min", "gpu_hours", "cost")
INCOMPLETE = "incomplete"
EVAL_LOSS = "best_eval_loss"  # the in-training eval on the eval split, the best of all stages


def sweep_points(rows: list[dict], sweeps: dict[str, SweepMember]) -> dict[str, dict[str, list[dict]]]:
    """Sweep name → point → the rows of its replicates, in plan order."""
    found: dict[str, dict[str, list[dict]]] = {}
    for row in rows:
        member = sweeps.get(row["experiment"])
        if member is not None:
            found.setdefault(member.sweep, {}).setdefault(member.point, []).append(row)
    return found


def finished(row: dict) -> bool:
    return row["status"].startswith("complete")


def was_pruned(row: dict) -> bool:
    return row["status"].startswith(PRUNED)


def sweep_section(
    name: str,
    points: dict[str, list[dict]],
    sweeps: dict[str, SweepMember],
    base_evals: dict[str, BaseEval] | None = None,
    run_root: Path | None = None,
) -> list[str]:
    """### Sweep: NAME, its table (a Δ per score where its replicates have a base eval), which point is
    best by its `select` (and why none is), which replicates did not finish or have no base row."""
    first = sweeps[next(iter(points.values()))[0]["experiment"]]
    replicates = [r for reps in points.values() for r in reps]
    metrics = with_deltas(
        [c for c in SWEEP_METRICS if any(r.get(c) is not None for r in replicates)], replicates
    )
    table = [point_row(point, reps, sweeps, metrics) for point, reps in points.items()]
    columns = ["point", *first.swept, "seeds"]
    columns += ["eval_split"] if any(r.get("eval_split") for r in replicates) else []
    lines = [f"### Sweep: {name}", ""]
    best, verdict = None, None
    if first.select is not None:
        best, verdict = best_point(points, first.select)
    if best is not None:
        columns.append("best")
        next(row for row in table if row["point"] == best)["best"] = "✓"
    lines += [to_markdown(table, columns + metrics), ""]
    lines += [verdict, ""] if verdict else []
    unfinished = [
        f"{r['experiment']} ({r['status']})" for r in replicates if not finished(r) and not was_pruned(r)
    ]
    if unfinished:
        lines += [f"Replicates not complete: {', '.join(unfinished)}.", ""]
    flagged = [
        f"{r['experiment']} ({r['status']})" for r in replicates if finished(r) and r["status"] == UNCHANGED
    ]
    if flagged:  # counted as done, but a mean hides what its row would have said
        lines += [f"Replicates complete with a warning: {', '.join(flagged)}.", ""]
    lines += pruning_lines(first, replicates, run_root) if first.prune and run_root else []
    return lines + left_out_lines([r["experiment"] for r in replicates], base_evals or {})


def pruning_lines(sweep: SweepMember, replicates: list[dict], run_root: Path) -> list[str]:
    """A pruned sweep's runs: each one's eval_loss at each rung (as recorded: core/pruning.py), where it was
    pruned and against which cutoff, and the GPU-hours (and training minutes) spent and saved against
    running every run to the end: a pruned run's own figure scaled to its full epochs, less what it spent."""
    prune = sweep.prune
    recorded = {rung: latest_by_run(rung_records(run_root, sweep.sweep, rung)) for rung in prune.rungs}
    rows, spent, saved = [], {"gpu_hours": 0.0, "train_min": 0.0}, {"gpu_hours": 0.0, "train_min": 0.0}
    for row in replicates:
        name = row["experiment"]
        stage = run_root / name / row["stages"]
        note = RunDir(stage).read_pruned()
        share = unrun_share(stage, note)
        # Training minutes from the stage's own runtime: the row's are rounded to 0.01, and a tiny run's
        # round to 0, which once made the saving read 0.
        runtime_s = RunDir(stage).read_summary().get("train_runtime_s")
        figures = {"gpu_hours": row.get("gpu_hours"), "train_min": runtime_s / 60 if runtime_s else None}
        for key in spent:
            spent[key] += figures[key] or 0.0
            saved[key] += (figures[key] or 0.0) * share
        rows.append(
            {
                "run": name,
                **{f"rung {rung:g}": loss_at(recorded[rung].get(name)) for rung in prune.rungs},
                "pruned": f"at rung {note['rung']:g} ({note['eval_loss']:.4g} > cutoff {note['cutoff']:.4g} "
                f"of {note['points']})"
                if all(note.get(key) is not None for key in ("rung", "eval_loss", "cutoff", "points"))
                else (
                    f"at rung {note['rung']:g} (eval_loss {note.get('eval_loss')})"
                    if note.get("rung")
                    else ""
                ),
                "gpu_hours": row.get("gpu_hours"),
                "train_min": row.get("train_min"),
            }
        )
    columns = ["run", *(f"rung {rung:g}" for rung in prune.rungs), "pruned", "gpu_hours", "train_min"]
    rungs = ", ".join(f"{rung:g}" for rung in prune.rungs)
    return [
        f"Pruning (asynchronous successive halving: rungs {rungs}, keep {prune.keep:g}, min_points "
        f"{prune.min_points}; each run is judged against every run recorded at its rung before it, so early "
        "runs are rarely stopped). A point with a pruned seed is out of the selection.",
        "",
        to_markdown(rows, columns),
        "",
        f"Spent {spent['gpu_hours']:.4g} GPU-hours ({spent['train_min']:.4g} training minutes); pruning saved "
        f"~{saved['gpu_hours']:.4g} GPU-hours (~{saved['train_min']:.4g} training minutes) against running "
        "every run to the end.",
        "",
    ]


def loss_at(record) -> str:
    return f"{record.eval_loss:.4g}" if record is not None else "-"


def unrun_share(stage: Path, note: dict) -> float:
    """The epochs a pruned run did not train, per epoch it trained (0 for a run that was not pruned):
    what running it to the end would have cost more, as a share of what it cost."""
    if not note:
        return 0.0
    epochs = ((read_spec(stage) or {}).get("train") or {}).get("epochs")
    done = RunDir(stage).read_summary().get("epochs_done") or note.get("rung")
    if not isinstance(epochs, (int, float)) or not done:
        return 0.0
    return max(0.0, epochs / done - 1)


def point_row(point: str, replicates: list[dict], sweeps: dict[str, SweepMember], metrics: list[str]) -> dict:
    """One point: its swept values, how many of its seeds are done, and each metric over its replicates."""
    done = sum(finished(r) for r in replicates)
    complete = done == len(replicates)
    pruned = sum(was_pruned(r) for r in replicates)
    splits = dict.fromkeys(r["eval_split"] for r in replicates if r.get("eval_split"))
    return {
        "point": point,
        **sweeps[replicates[0]["experiment"]].values,
        "seeds": f"{done}/{len(replicates)} done" + (f", {pruned} pruned" if pruned else ""),
        "eval_split": ", ".join(splits) or None,
        "best": "",
        **{c: cell_of(c, [r.get(c) for r in replicates]) if complete else INCOMPLETE for c in metrics},
    }


def cell_of(column: str, values: list) -> str | None:
    """A point's cell: a Δ column's mean of its replicates' Δs (signed; their spread is the score's own,
    shown beside it), any other column's mean ± std."""
    if not column.startswith(DELTA):
        return replicates_cell(values)
    known = [float(v) for v in values if v is not None]
    if not known:
        return None
    return INCOMPLETE if len(known) < len(values) else f"{statistics.fmean(known):+.4g}"


def replicates_cell(values: list) -> str | None:
    """`mean ± std` (sample standard deviation) of the replicates' values, the value itself for one;
    `incomplete` when some replicate has none: a mean of fewer would compare unlike with like."""
    known = [float(v) for v in values if v is not None]
    if not known:
        return None
    if len(known) < len(values):
        return INCOMPLETE
    if broken := sum(not math.isfinite(v) for v in known):  # a diverged run: flagged, never averaged
        return f"not a number in {broken} of {len(known)}"
    if len(known) == 1:
        return f"{known[0]:.4g}"
    return f"{statistics.mean(known):.4g} ± {statistics.stdev(known):.4g}"


def select_field(metric: str) -> str | None:
    """The row field `select.metric` names: eval_loss is the in-training eval's (summary.json, on the
    eval split); a score is the eval job's, named by its key (bertscore_f1) or its column (bertscore)."""
    if metric in ("eval_loss", EVAL_LOSS):
        return EVAL_LOSS
    if metric in REPORT_COLUMNS:
        return REPORT_COLUMNS[metric]
    return metric if metric in REPORT_COLUMNS.values() else None


def best_point(points: dict[str, list[dict]], select) -> tuple[str | None, str]:
    """The point `select` picks (the best mean over its replicates) and the line that says so, or None and
    the line saying why none is picked. Only points with every seed done and scored compete, and only on
    the eval split: a point chosen on test scores makes those scores an optimistic estimate."""
    head = f"Best by {select.metric} ({select.mode}"
    field = select_field(select.metric)
    if field is None:
        known = ", ".join(["eval_loss", *REPORT_COLUMNS])
        return None, f"{head}): none marked: the report has no metric {select.metric!r} (it has {known})."
    if field != EVAL_LOSS:
        refused = split_refusal(field, [r for reps in points.values() for r in reps])
        if refused:
            return None, f"{head}): none marked: {refused}"
    scored = {
        point: [float(r[field]) for r in reps]
        for point, reps in points.items()
        if all(finished(r) and r.get(field) is not None for r in reps)
    }
    # A NaN compares false with everything, so min() kept a NaN met first as the best: a failed number
    # never wins, and the points left out for one are named.
    broken = sorted(point for point, values in scored.items() if not all(map(math.isfinite, values)))
    means = {point: statistics.mean(values) for point, values in scored.items() if point not in broken}
    left_out = f" (left out, {field} not a finite number: {', '.join(broken)})" if broken else ""
    if not means:
        return None, f"{head}, eval split): none yet: no point has every seed done with a {field}{left_out}."
    best = (min if select.mode == "min" else max)(means, key=means.__getitem__)  # a tie: the first point
    return best, f"{head}, eval split): {best}{left_out}"


def split_refusal(field: str, replicates: list[dict]) -> str | None:
    """Why `field` (an eval job's score) cannot select a point: some replicate scored another split than
    the eval data. A results.json without `split` predates the setting, when only the eval data was
    scored."""
    for row in replicates:
        marker = row.get("eval_split")
        if row.get(field) is None or marker in (None, "eval"):
            continue
        if marker == split_marker({"split": "train"}):
            where, what = "the training data", "on the training data"
        else:
            where, what = f"split {marker!r}", "on a test split"
        return (
            f"the selection cannot be made {what} ({row['experiment']}'s {field} was scored on {where}); "
            "select on eval_loss or on scores of the eval split."
        )
    return None


def totals_text(job_rows: list[dict], usage: PlanUsage | None, gpu_hour_cost: float | None) -> str:
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


def loss_series(jobs: list[JobRun], experiment: str) -> tuple[list, list, list]:
    """(train points, eval points, stage boundaries) with steps counted across stages."""
    train, evals, boundaries, offset = [], [], [], 0
    for job in (j for j in jobs if j.experiment == experiment and j.kind == "train"):
        rows = read_metrics(job.run_dir)
        train += [(offset + r["step"], r["loss"]) for r in rows if "loss" in r and "step" in r]
        evals += [(offset + r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r and "step" in r]
        offset += max((r.get("step", 0) for r in rows), default=0)
        boundaries.append((offset, job.stage))
    return train, evals, boundaries[:-1]


# A DPO stage's curves (TRL's log rows in metrics.jsonl), plotted beside the loss
REWARD_KEYS = ("rewards/accuracies", "rewards/margins")


def reward_series(jobs: list[JobRun], experiment: str) -> dict[str, list]:
    """Each REWARD_KEYS curve the experiment's stages logged, steps counted across stages as loss_series
    counts them; {} when none did (no preference stage)."""
    found: dict[str, list] = {}
    offset = 0
    for job in (j for j in jobs if j.experiment == experiment and j.kind == "train"):
        rows = read_metrics(job.run_dir)
        for key in REWARD_KEYS:
            points = [(offset + r["step"], r[key]) for r in rows if "step" in r and numeric(r.get(key))]
            if points:
                found.setdefault(key, []).extend(points)
        offset += max((r.get("step", 0) for r in rows), default=0)
    return found


def numeric(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def draw_rewards(ax, name: str, rewards: dict[str, list]) -> None:
    for key, points in rewards.items():
        ax.plot(*zip(*points, strict=True), label=f"{name} {key}")
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xlabel("optimizer step (across stages)")
    ax.set_ylabel("reward accuracy (share) / margin")
    ax.set_title(f"{name}: DPO rewards (against its reference)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_losses(
    jobs: list[JobRun], experiments: list[str], run_root: Path, sweeps: dict[str, SweepMember] | None = None
) -> list[Path]:
    """loss_curves.png (every experiment; a sweep point's replicates as one mean line with a band) and
    each experiment's own loss.png (a replicate's included; with a preference stage, its reward accuracy
    and margin curves beside the loss)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweeps = sweeps or {}
    series = {name: loss_series(jobs, name) for name in experiments}
    series = {k: v for k, v in series.items() if v[0] or v[1]}
    if not series:
        return []
    paths = [run_root / "loss_curves.png"]
    fig, ax = plt.subplots(figsize=(9, 5))
    draw_all(ax, series, experiments, sweeps)
    banded = "; sweep points: mean of their seeds, band min–max" if sweeps.keys() & series.keys() else ""
    finish(ax, f"Loss of every experiment (dotted lines: stage boundaries{banded})")
    write_atomic_with(paths[0], partial(fig.savefig, dpi=110, bbox_inches="tight"))
    plt.close(fig)
    for name, (train, evals, boundaries) in series.items():
        rewards = reward_series(jobs, name)
        if rewards:  # a preference stage: its reward curves beside the loss
            fig, (ax, beside) = plt.subplots(1, 2, figsize=(13, 4))
            draw_rewards(beside, name, rewards)
        else:
            fig, ax = plt.subplots(figsize=(7, 4))
        draw(ax, name, train, evals, boundaries, label_stages=True)
        finish(ax, f"{name}: loss")
        paths.append(run_root / name / "loss.png")
        paths[-1].parent.mkdir(parents=True, exist_ok=True)
        write_atomic_with(paths[-1], partial(fig.savefig, dpi=110, bbox_inches="tight"))
        plt.close(fig)
    return paths


def draw_all(ax, series: dict[str, tuple], experiments: list[str], sweeps: dict[str, SweepMember]) -> None:
    """Each experiment's curves, except a sweep point's replicates: drawn together as their mean, at the
    first replicate's place in plan order. `series`: loss_series of the experiments that logged any."""
    points: dict[tuple, list[str]] = {}  # (sweep, point) → its replicates in the plan
    for name in experiments:
        if name in sweeps:
            points.setdefault((sweeps[name].sweep, sweeps[name].point), []).append(name)
    drawn: set[tuple] = set()
    for name, (train, evals, boundaries) in series.items():
        member = sweeps.get(name)
        if member is None:
            draw(ax, name, train, evals, boundaries)
            continue
        key = (member.sweep, member.point)
        if key not in drawn:
            drawn.add(key)
            logged = [series[n] for n in points[key] if n in series]
            draw_mean(ax, f"{member.sweep}-{member.point}", logged, len(points[key]))


def draw_mean(ax, label: str, replicates: list[tuple], total: int) -> None:
    """A sweep point: the mean training loss of its replicates with a min–max band, and their mean eval
    loss, at the steps every replicate that logged has; the label says how many of its `total` seeds."""
    line = None
    train = mean_band([t for t, _, _ in replicates if t])
    seeds = f"mean of {sum(bool(t) for t, _, _ in replicates)}/{total} seeds"
    if train:
        steps, means, lows, highs = zip(*train, strict=True)
        (line,) = ax.plot(steps, means, label=f"{label} train ({seeds}, band min–max)")
        ax.fill_between(steps, lows, highs, color=line.get_color(), alpha=0.2, linewidth=0)
    evaluated = [e for _, e, _ in replicates if e]
    evals = mean_band(evaluated)
    if evals:
        steps, means, _, _ = zip(*evals, strict=True)
        color = line.get_color() if line else None
        ax.plot(
            steps, means, "o--", color=color, label=f"{label} eval (mean of {len(evaluated)}/{total} seeds)"
        )
    shared = [b for b in replicates[0][2] if all(b in r[2] for r in replicates)]
    for step, _ in shared:
        ax.axvline(step, color=line.get_color() if line else "grey", linestyle=":", alpha=0.7)


def mean_band(curves: list[list[tuple]]) -> list[tuple]:
    """(step, mean, min, max) of the curves' values at each step they all have: a mean over fewer
    replicates at the tail of the longest would jump where a shorter one ends."""
    by_step = [dict(curve) for curve in curves]
    if not by_step:
        return []
    steps = sorted(set.intersection(*(set(values) for values in by_step)))
    band = []
    for step in steps:
        values = [v[step] for v in by_step]
        band.append((step, statistics.fmean(values), min(values), max(values)))
    return band


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
