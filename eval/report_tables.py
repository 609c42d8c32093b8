"""The report's rows as text: report.md's Markdown tables (a `|` in a cell escaped, a Δ column headed
`Δ rouge_l`), the lines under a table (experiments without a base row, descriptions), the whole plan's
GPU-hours and cost, and report.csv (one row per replicate, never a mean: a sum over the file counts each
run once). The rows come from eval/report_rows.py."""

from __future__ import annotations

import csv
import io

from core.runs import BaseEval, PlanUsage
from core.sweep import SweepMember
from eval.report_rows import DELTA, TRAINER_CLOCK, present_columns, total_gpu_hours, with_deltas


def incomparable_lines(rows: list[dict]) -> list[str]:
    """A line for each row whose Δ is left out because it scored another file than its base (eval/report_rows.py
    deltas), then a blank line; none when every Δ compares like with like."""
    notes = [row["no_delta_because"] for row in rows if row.get("no_delta_because")]
    return [*(f"{note}." for note in notes), ""] if notes else []


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
    name): what docs/configuring.md promises `description:` is for."""
    shown: dict[str, str] = {}
    for name in names:
        text = " ".join(str(descriptions.get(name) or "").split())
        if text:
            shown.setdefault(sweeps[name].sweep if name in sweeps else name, text)
    return [f"- **{escaped(name)}**: {text}" for name, text in shown.items()] + ([""] if shown else [])


def header(column: str) -> str:
    """A column's heading in report.md: delta_rouge_l is shown as Δ rouge_l."""
    return f"Δ {column.removeprefix(DELTA)}" if column.startswith(DELTA) else column


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
