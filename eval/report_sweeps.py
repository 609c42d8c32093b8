"""The sweep tables: the points of a `sweep:` block (core/sweep.py) compared like with like, one table per
sweep, a row per point, its replicates (one per seed) as mean ± sample standard deviation; a point whose
seeds have not all finished says so instead of averaging fewer. Which point is best by the sweep's
`select`, on the eval split only. A pruned sweep's table is followed by its runs' losses at each rung,
where each was pruned and against which cutoff (core/pruning.py's records), and what pruning spent and
saved; a point with a pruned seed is never the best."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from core.names import REPORT_COLUMNS
from core.pruning import latest_by_run, rung_records
from core.rundir import RunDir, RunRoot, read_spec
from core.runs import BaseEval
from core.sweep import SweepMember
from eval.report_rows import DELTA, PRUNED, UNCHANGED, split_marker, with_deltas
from eval.report_tables import left_out_lines, to_markdown

# Sweeps: a table per sweep, a row per point, its replicates' numbers as mean ± standard deviation.

# The numbers a sweep's points are compared on: losses, scores, and what a point cost.
SWEEP_METRICS = ("best_eval_loss", *REPORT_COLUMNS.values(), "train_min", "gpu_hours", "cost")
INCOMPLETE = "incomplete"
EVAL_LOSS = "best_eval_loss"  # the in-training eval on the eval split, of the last stage that evaluated


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
        stage = RunRoot(run_root).stage(f"{name}/{row['stages']}").path
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
