"""The report's rows, built from the run root's typed records (core/runs.py `JobRun`, `BaseEval`): one per
job (what it held of the cluster, its Trainer clock, GPU utilisation, tokens/s), one per experiment (its
status, stages, GPU-hours, best eval loss and the eval job's scores) and one per base-model eval, with each
experiment's Δ per score against its own base. Reads `metrics.jsonl` of each stage and `results.json` of the
eval jobs; eval/report.py lays the rows out (eval/report_tables.py, eval/report_sweeps.py)."""

from __future__ import annotations

import functools
import math
from pathlib import Path

from core.files import command_number, iter_jsonl, thinned
from core.layout import EVAL, eval_folder
from core.names import REPORT_COLUMNS
from core.rundir import METRICS_FIELDS, RunDir
from core.runs import BaseEval, JobRun
from core.split import label as split_label
from core.states import State

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
    "stage_eval_losses",
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


# The most points of each curve the report reads from a stage's metrics.jsonl (thinned evenly beyond):
# plots and means read the same from a few thousand; a million steps parsed whole took gigabytes (M3).
CURVE_POINTS = 2000


def read_metrics(run_dir: str | Path) -> list[dict]:
    """A stage's metrics rows, streamed, at most 2 x CURVE_POINTS of the training curve and of the eval
    curve (core/files.py thinned), each curve's last row kept (its step ends the stage's axis). Read once
    per version of the file and command: the table, the plots and the means all ask, and each command
    names what it found wrong there."""
    path = RunDir.of(run_dir).metrics
    try:
        info = path.stat()
    except OSError:
        return []
    return list(_thinned_metrics(str(path), info.st_mtime_ns, info.st_size, command_number()))


@functools.lru_cache(maxsize=256)
def _thinned_metrics(path: str, mtime_ns: int, size: int, command: int) -> tuple[dict, ...]:
    rows = iter_jsonl(Path(path), METRICS_FIELDS)
    return tuple(thinned(rows, CURVE_POINTS, lambda row: "eval" if "eval_loss" in row else "train"))


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
    eval_job = next((j for j in jobs if j.id == f"{experiment}/{EVAL}"), None)
    return scores_row(experiment, jobs, train_jobs, eval_job, job_rows)


def stage_rows(jobs: list[JobRun], experiment: str, job_rows: dict[str, dict]) -> list[dict]:
    """The experiment's earlier stages that were evaluated (eval.after_each_stage), each as the
    experiment's row would read had its curriculum ended there: `EXP @ STAGE`, the scores of that stage's
    eval job (eval-STAGE), the training up to that stage. An SFT -> DPO curriculum's SFT row."""
    train_jobs = [j for j in jobs if j.kind == "train"]
    rows = []
    for done, stage_job in enumerate(train_jobs[:-1], start=1):
        eval_id = f"{experiment}/{eval_folder(stage_job.stage, last=False)}"
        eval_job = next((j for j in jobs if j.id == eval_id), None)
        if eval_job is not None:
            upto = train_jobs[:done]
            label = f"{experiment} @ {stage_job.stage}"
            rows.append(scores_row(label, [*upto, eval_job], upto, eval_job, job_rows))
    return rows


def scores_row(
    label: str, jobs: list[JobRun], train_jobs: list[JobRun], eval_job: JobRun | None, job_rows: dict
) -> dict:
    """A row of the report's table: `train_jobs` (and `jobs`, for the status and GPU-hours), scored by
    `eval_job`'s results."""
    first = train_jobs[0]
    summaries = [j.summary for j in train_jobs]
    runtime_s = sum(s.get("train_runtime_s") or 0 for s in summaries)
    # Each stage's own best eval loss: an SFT stage's cross-entropy and a DPO stage's loss are not one
    # quantity, so the row's figure is the stage it scores (the last that evaluated), not their minimum
    # (before: an SFT -> DPO row showed the SFT stage's).
    losses = [
        (job.stage, s["best_eval_loss"])
        for job, s in zip(train_jobs, summaries, strict=True)
        if isinstance(s.get("best_eval_loss"), int | float) and math.isfinite(s["best_eval_loss"])
    ]
    results = read_results(eval_job.run_dir) if eval_job else {}
    row = {
        "experiment": label,
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
        "best_eval_loss": losses[-1][1] if losses else None,
        "stage_eval_losses": " → ".join(f"{stage} {loss:.4g}" for stage, loss in losses)
        if len(losses) > 1
        else None,
    }
    row["eval_split"] = split_marker(results)
    row["eval_source"] = results.get("source")  # the file scored: a Δ compares rows of one file only
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
        "eval_source": results.get("source"),
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
    results.json without `split` predates the setting, when only the eval data was scored) or different
    files (M6: an `EXP @ STAGE` row's eval scores that stage's data, the base the last stage's; then
    `no_delta_because` says so, for the line under the table)."""
    comparable = base is not None and (base.get("eval_split") or "eval") == (row.get("eval_split") or "eval")
    mine_source, base_source = row.get("eval_source"), (base or {}).get("eval_source")
    if comparable and mine_source and base_source and mine_source != base_source:
        comparable = False
        row["no_delta_because"] = (
            f"{row['experiment']}: no Δ, its eval scored {mine_source} and the base {base_source}"
        )
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


def scored_rows(
    jobs: list[JobRun], tasks: dict, base_evals: dict[str, BaseEval], gpu_hour_cost: float | None
) -> tuple[list[dict], dict[str, list[dict]], dict[str, dict], dict[str, list[dict]]]:
    """(each experiment's row with its Δs and cost, each task's base rows, each job's row by its id, each
    experiment's evaluated earlier stages' rows with their Δs against its base)."""
    state_of = {j.id: j.state for j in jobs}
    # Only experiments with a training job get a row: a base-model eval job is a plan job of its own
    # (experiment "baselines"), with no adapter to describe; it shows as its own row via base_evals.
    experiments = list(dict.fromkeys(j.experiment for j in jobs if j.kind == "train"))
    job_rows = {j.id: job_row(j) for j in jobs}
    jobs_of = {name: [j for j in jobs if j.experiment == name] for name in experiments}
    rows = [experiment_row(jobs_of[name], name, job_rows) | {"task": tasks.get(name)} for name in experiments]
    scored = {  # each base eval's row, by its job id: one job may serve many experiments
        base.job_id: base_row(base, state_of.get(base.job_id), job_rows)
        for base in base_evals.values()
        if not base.left_out
    }
    stages = {
        row["experiment"]: [
            stage | {"task": row["task"]}
            for stage in stage_rows(jobs_of[row["experiment"]], row["experiment"], job_rows)
        ]
        for row in rows
    }
    for row in rows:
        if row["experiment"] in base_evals:
            base = base_evals[row["experiment"]]
            for scored_row in [*stages[row["experiment"]], row]:
                scored_row.update(deltas(scored_row, None if base.left_out else scored[base.job_id]))
    bases = {task: task_base_rows(task, rows, base_evals, scored) for task in tasks_of(rows)}
    if gpu_hour_cost is not None:
        earlier = [stage for rows_of_stages in stages.values() for stage in rows_of_stages]
        for row in rows + earlier + [b for task_bases in bases.values() for b in task_bases]:
            row["cost"] = round(row["gpu_hours"] * gpu_hour_cost, 2) if row["gpu_hours"] is not None else None
    return rows, bases, job_rows, stages


def present_columns(rows: list[dict]) -> list[str]:
    """COLUMNS that some row has a value for (experiment and status always)."""
    return [c for c in COLUMNS if c in ("experiment", "status") or any(r.get(c) is not None for r in rows)]
