"""Tables for people: the plan before submission, and where every job stands after."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from core.durations import format_duration, format_eta, slurm_time
from core.files import NotARegularFile, read_window
from core.layout import BASE_EVAL_PREFIX
from core.states import NEVER_STARTS, NEVER_STARTS_MARK, State
from slurm.planning.arrays import JobArray
from slurm.planning.estimate import GUESS_MARGIN
from slurm.planning.pack import Packing
from slurm.planning.plan import Plan, PlannedJob
from slurm.planning.shared_evals import SharedEval
from slurm.watching.status import JobStatus

WIDE = 160  # columns, when output goes to a file or a CI log: no terminal to fit
# Each table's columns, most important first: in a narrow terminal the last ones are left out.
PLAN_PRIORITY = ("job", "state", "estimate", "resources", "depends on", "eff. batch", "kind", "tasks", "wave")
STATUS_PRIORITY = (
    "job",
    "state",
    "reason",
    "step",
    "eta",
    "loss",
    "slurm id",
    "pid",  # the id column of a status whose every job ran here (the local backend)
    "elapsed",
    "nodes",  # where it runs or ran: kept over the GPU readings, dropped before the job's own figures
    "gpu",
    "gpu mem",
    "micro",
)


def console(stderr: bool = False) -> Console:
    """A console as wide as the terminal it writes to (a table wider than that is wrapped by the terminal
    into broken boxes); WIDE when it writes to a file or a pipe. It reads no markup: what it prints (a
    problem quoting `[/INST]`, gloo's `[/__w/pytorch/…]` in a log tail, a path) is text, never a tag, and
    colour comes from `labelled` and styled cells."""
    probe = Console(stderr=stderr, markup=False)
    return Console(stderr=stderr, width=probe.width if probe.is_terminal else WIDE, markup=False)


def labelled(label: str, style: str, text: object) -> Text:
    """`label` in `style`, then `text` exactly as it is: the one way a line of ours is coloured."""
    return Text.assemble((label, style), " ", str(text))


def warning(text: object) -> Text:
    return labelled("warning:", "yellow", text)


def error(text: object) -> Text:
    return labelled("error:", "red", text)


# Every command's output: the terminal's width (tables fit it), or WIDE columns into a file or a CI log.
out = console()
err = console(stderr=True)


def fit(table: Table, width: int, priority: tuple[str, ...]) -> Table:
    """`table` without its least important columns (the end of `priority`) until it fits `width`; the
    caption names what was left out. Cells may still fold inside their box, which never breaks."""
    columns = list(table.columns)
    needed = {id(c): natural_width(c) for c in columns}
    rank = {name: k for k, name in enumerate(priority)}
    dropping = sorted(columns[1:], key=lambda c: rank.get(str(c.header), len(priority)), reverse=True)
    kept = list(columns)
    while dropping and 1 + sum(needed[id(c)] for c in kept) > width:
        kept.remove(dropping.pop(0))
    if len(kept) == len(columns):
        return table
    left_out = [str(c.header) for c in columns if c not in kept]
    fitted = Table(
        title=table.title,
        title_justify=table.title_justify,
        caption=f"left out to fit {width} columns: {', '.join(left_out)} (a wider terminal shows them)",
        caption_justify="left",
    )
    for column in kept:
        fitted.add_column(column.header, no_wrap=column.no_wrap)
    for row in range(table.row_count):
        fitted.add_row(*(column._cells[row] for column in kept))
    return fitted


def natural_width(column) -> int:
    """Cells' widest line, with the column's padding and border."""
    cells = [column.header, *column._cells]
    texts = [Text(c) if isinstance(c, str) else c for c in cells]
    return 3 + max(
        (
            max((Text(line).cell_len for line in t.plain.splitlines()), default=0)
            for t in texts
            if isinstance(t, Text)
        ),
        default=0,
    )


STATE_STYLE = {
    State.COMPLETED: "green",
    State.PRUNED: "green",
    State.RUNNING: "cyan",
    State.PENDING: "yellow",
    State.FAILED: "red",
    State.TIMEOUT: "red",
    State.CANCELLED: "red",
    State.BLOCKED: "magenta",
}


def resources_text(job: PlannedJob) -> str:
    res = job.resources
    gpus = f"{res.node_count} nodes x {res.gpus} gpu" if res.nodes > 1 else f"{res.gpus} gpu"
    parts = [gpus, f"{res.cpus} cpu", f"{res.mem_gb:g}G", res.time]
    parts += [value for value in (res.partition, res.constraint) if value]
    return " ".join(parts)


def batch_text(job: PlannedJob) -> str:
    """`32 (8x2x2, micro 16x1)`: examples per optimizer step = batch_size x grad_accum x tasks, and how each
    task splits its part: known (an explicit micro_batch, or preflight's choice on this GPU) or `auto`
    (chosen at the job's start; a CPU job keeps the written split). A GRPO stage's examples are prompts, each
    with G completions (`8 x 4 completions (...)`), and its micro-batch counts completions."""
    if job.effective_batch is None:
        return "-"
    train = job.spec.train
    split = job.estimate.split or ("auto" if job.resources.gpus else "as written")
    completions = train.completions_per_example
    each = f" x {completions} completions" if completions > 1 else ""
    return f"{job.effective_batch}{each} ({train.batch_size}x{train.grad_accum}x{job.tasks}, micro {split})"


def estimate_text(job: PlannedJob) -> str:
    """`~1h12m (guess)`; `? (unknown)` when there was nothing to count."""
    seconds = job.estimate.seconds
    return f"{'~' + format_duration(seconds) if seconds is not None else '?'} ({job.estimate.source})"


def totals_text(plan: Plan) -> str:
    """Makespan (the longest dependency chain, each job starting when its parents end) and GPU-hours."""
    makespan, path = plan.critical_path()
    unknown = plan.unestimated()
    if len(unknown) == len(plan.jobs):
        return "No estimates: every job's data is fetched on the node and not yet in the speed book"
    at_least = "at least " if unknown else ""
    lines = [
        f"Makespan {at_least}~{format_duration(makespan)} (critical path: {' -> '.join(path) or '-'}), "
        f"{at_least}{plan.gpu_hours():.1f} GPU-hours; no queue waits counted. Each experiment's own chain:"
    ]
    if unknown:
        lines.append(
            f"  not estimated (data fetched on the node, not in the speed book): {', '.join(unknown)}"
        )
    sweeps = plan.sweeps()
    sweep_of = {point: sweep for sweep, points in sweeps.items() for point in points}
    for name in plan.experiments():
        if name not in sweep_of:
            seconds, path = plan.critical_path(name)
            lines.append(f"  {name}: ~{format_duration(seconds)} ({' -> '.join(path)})")
        elif name == sweeps[sweep_of[name]][0]:  # a sweep is one line, where its first point is
            sweep = plan.of_sweep(sweep_of[name])
            seconds, path = sweep.critical_path()
            lines.append(
                f"  sweep {sweep_of[name]}: {len(sweep.experiments())} point(s), {sweep_hours(sweep)}, "
                f"~{format_duration(seconds)} with every point at once ({' -> '.join(path)})"
            )
    for job in plan.jobs:
        step_s, delay = job.estimate.step_s, job.resources.signal_delay_s
        if step_s is not None and step_s > delay:
            lines.append(
                f"One step of {job.id} takes ~{format_duration(step_s)} (its generation included), longer than "
                f"its resources.signal_delay_s {delay}: the time-limit stop saves only between steps, so at "
                f"its limit the job may be killed mid-step; set signal_delay_s to {math.ceil(2 * step_s)} or more"
            )
    guessed = [j.id for j in plan.jobs if j.estimate.source == "guess"]
    if plan.gpus_here == 0 and any(job.resources.gpus for job in plan.jobs):
        lines.append(
            "This machine has no GPU: the local backend runs every job on its CPUs, so their estimates and "
            "`time: auto` limits are a CPU's (the speed book's CPU rows, else a CPU guess), not a GPU's"
        )
    if guessed:
        shown = ", ".join(guessed[:6]) + (f" and {len(guessed) - 6} more" if len(guessed) > 6 else "")
        lines.append(
            f"On a guessed speed (nothing measured yet; `time: auto` gives them {GUESS_MARGIN:g}x their "
            f"estimate; `--calibrate` measures it): {shown}"
        )
    return "\n".join(lines)


def sweep_hours(sweep: Plan) -> str:
    """`1.2 GPU-hours`; a pruned sweep's worst case (no run stopped) and what it is expected to cost."""
    worst = f"{sweep.gpu_hours():.1f} GPU-hours"
    if not sweep.pruned():
        return worst
    return f"{worst} at worst (no run pruned), {sweep.gpu_hours('expected'):.1f} expected with pruning"


def packing_text(packing: Packing) -> str:
    """The simulated lanes: which units each GPU runs in order, and whether the makespan fits the budget."""
    lines = [
        f"Pack: one allocation of {packing.gpus} GPU(s) for {slurm_time(packing.budget_s)}; simulated makespan "
        f"~{format_duration(packing.makespan_s)}, lanes busy {packing.utilisation:.0%} "
        "(a free lane takes the ready job with the longest estimate)"
        + (
            "; pruned sweeps counted as expected (--budget-basis expected)"
            if packing.basis == "expected"
            else ""
        )
    ]
    for lane, units in enumerate(packing.lanes):
        steps = [
            f"{u} [{slurm_time(round(packing.starts[u]))}-{slurm_time(round(packing.ends[u]))}]"
            for u in units
        ]
        lines.append(f"  lane {lane}: " + (" -> ".join(steps) or "(idle)"))
    return "\n".join(lines)


def batches_text(batches) -> list[str]:
    """How a launch on SLURM would queue what is left: one line per job array (its points, stage, %K, its
    time limit, what it follows) and per shared eval (the evals it scores), then the count of jobs queued
    one sbatch each. Nothing when every job is queued on its own."""
    together = [b for b in batches if isinstance(b, JobArray | SharedEval)]
    if not together:
        return []
    lines = [f"On SLURM, {len(batches)} submission(s):"]
    for batch in together:
        first = batch.jobs[0]
        if isinstance(batch, SharedEval):
            lines.append(
                f"  shared eval {batch.name}: scores {len(batch.jobs)} adapters of one base in one job, "
                f"after their trainings ended, {batch.resources.time} in all"
            )
            continue
        waits = f", task i after task i of {batch.follows.name}" if batch.follows is not None else ""
        lines.append(
            f"  job array {batch.name}: {len(batch.jobs)} points of sweep {first.sweep}, at most "
            f"{batch.parallel} at once, {batch.resources.time} each{waits}"
        )
    alone = len(batches) - len(together)
    if alone:
        lines.append(f"  {alone} other job(s), one sbatch each")
    return lines


def depends_text(job: PlannedJob) -> str:
    return ", ".join(f"{d.job_id} ({d.kind})" for d in job.depends_on) or "-"


def folded_sweeps(plan: Plan, asked: tuple[str, ...] | None) -> set[str]:
    """The sweeps a dry run shows as one line each: all of them, but those `--exp` named (the sweep, or one
    of its points), whose jobs are shown one by one."""
    asked_for = set(asked or ())
    return {
        sweep
        for sweep, points in plan.sweeps().items()
        if sweep not in asked_for and not asked_for.intersection(points)
    }


def by_folded_sweep(items: list, sweep_of, folded: set[str]) -> dict[str, list]:
    """Each folded sweep's items (jobs or status rows), in order: its one row goes where its first one is."""
    found: dict[str, list] = {}
    for item in items:
        if sweep_of(item) in folded:
            found.setdefault(sweep_of(item), []).append(item)
    return found


def counted_states(states: list[str]) -> str:
    """`1190 PLANNED, 11 COMPLETED (done)`: how many of each state, in the order first seen."""
    return ", ".join(f"{n} {state}" for state, n in Counter(states).items())


def sweep_row(sweep: Plan, states: dict[str, str]) -> list[str]:
    """A folded sweep's one row (`sweep` its part of the plan): its points, their jobs' resources (where
    all alike), its GPU-hours and its jobs by state."""
    jobs = sweep.jobs
    kinds = ", ".join(dict.fromkeys(j.kind for j in jobs))
    resources = {resources_text(j) for j in jobs if j.kind == jobs[0].kind}
    return [
        f"sweep {jobs[0].sweep}: {len(sweep.experiments())} points",
        f"{len(jobs)} jobs ({kinds})",
        "-",
        "each point's own",
        resources.pop() if len(resources) == 1 else "various",
        f"{'at least ' if sweep.unestimated() else '~'}{sweep.gpu_hours():.1f} GPU-hours",
        "-",
        "-",
        counted_states([states.get(j.id, State.PLANNED.value) for j in jobs]),
    ]


def plan_table(
    plan: Plan, states: dict[str, str] | None = None, width: int = WIDE, folded: set[str] = frozenset()
) -> Table:
    """The plan, a row a job; each sweep in `folded` one row, where its first job is (sweep_row)."""
    # Every run folder is RUN_ROOT/JOB: named once in the title, not in a column of its own.
    title = f"Plan: {len(plan.jobs)} jobs, run folders {plan.run_root}/JOB"
    table = Table(title=title, title_justify="left")
    columns = (
        "job",
        "kind",
        "wave",
        "depends on",
        "resources",
        "estimate",
        "tasks",
        "eff. batch",
        "state",
    )
    for column in columns:
        table.add_column(column, no_wrap=column in ("job", "resources", "estimate"))
    of_sweep = by_folded_sweep(list(plan.jobs), lambda job: job.sweep, folded)
    for job in plan.jobs:
        if job.sweep in folded:
            if job is of_sweep[job.sweep][0]:
                table.add_row(*sweep_row(plan.of_sweep(job.sweep), states or {}))
            continue
        state = (states or {}).get(job.id, State.PLANNED.value)
        table.add_row(
            job.id,
            job.kind,
            str(job.wave),
            depends_text(job),
            resources_text(job),
            estimate_text(job),
            str(job.tasks),
            batch_text(job),
            state,
        )
    return fit(table, width, PLAN_PRIORITY)


def edges_text(plan: Plan, folded: set[str] = frozenset()) -> str:
    """Each dependency edge; an edge with an end in a folded sweep is counted under the sweep's name instead
    (`sweep lr-sweep --afterok--> report/train (12 edges)`), those inside it in one line."""
    sweep_of = {j.id: j.sweep for j in plan.jobs if j.sweep in folded}
    lines, counted = [], {}
    for a, b, kind in plan.edges():
        if a not in sweep_of and b not in sweep_of:
            lines.append(f"  {a} --{kind}--> {b}")
            continue
        key = (
            f"sweep {sweep_of[a]}" if a in sweep_of else a,
            f"sweep {sweep_of[b]}" if b in sweep_of else b,
            kind,
        )
        counted[key] = counted.get(key, 0) + 1
    for (a, b, kind), n in counted.items():
        inside = a == b
        lines.append(
            f"  {a}: {n} {kind} edge(s) between its points' own jobs (--exp {a[6:]} lists them)"
            if inside
            else f"  {a} --{kind}--> {b} ({n} edge(s))"
        )
    return "Dependency edges:\n" + ("\n".join(lines) if lines else "  (none)")


def sweep_status_row(sweep: str, rows: list[JobStatus], plan: Plan) -> list:
    """A folded sweep's one status row: its points, its jobs by state, and what is left of it (the GPU-hours
    of its jobs not finished, a pruned run being finished, and their makespan with every point at once)."""
    left = plan.only({row.job.id for row in rows if not row.state.finished})
    left_text = (
        f"left: ~{left.gpu_hours():.1f} GPU-hours, ~{format_duration(left.critical_path()[0])} with every "
        "point at once"
        if left.jobs
        else "all done"
    )
    points = len({row.job.experiment for row in rows})
    return [f"sweep {sweep}: {points} points", "", counted_states([r.state.value for r in rows]), left_text]


def status_table(
    rows: list[JobStatus], width: int = WIDE, folded: set[str] = frozenset(), plan: Plan | None = None
) -> Table:
    """A row a job; each sweep in `folded` one row (sweep_status_row, from `plan`), where its first job is."""
    table = Table(title="Status", title_justify="left")
    backends = {row.backend for row in rows if row.backend}
    columns = (
        "job",
        "pid" if backends == {"local"} else "slurm id",  # before: a local run's pids read as SLURM ids
        "state",
        "reason",
        "elapsed",
        "nodes",
        "step",
        "loss",
        "eta",
        "gpu",
        "gpu mem",
        "micro",
    )
    for column in columns:
        table.add_column(column)
    of_sweep = by_folded_sweep(rows, lambda row: row.job.sweep, folded)
    for row in rows:
        if row.job.sweep in folded:
            if row is of_sweep[row.job.sweep][0]:
                table.add_row(*sweep_status_row(row.job.sweep, of_sweep[row.job.sweep], plan))
            continue
        style = STATE_STYLE.get(row.state, "")
        step = f"{row.step}/{row.total_steps}" if row.step is not None and row.total_steps else ""
        loss = f"{row.last_loss:.4f}" if isinstance(row.last_loss, (int, float)) else ""
        running = row.state is State.RUNNING
        eta = format_eta(row.eta_s) if running else ""
        table.add_row(
            row.job.id,
            row.scheduler_id,
            Text(row.state.value, style=style),
            row.reason,
            row.elapsed,
            row.nodes,  # SLURM's NodeList (`n[1-2]`); blank while pending, and for a local job (this machine)
            step,
            loss,
            eta,
            *(gpu_texts(row) if running else ("", "")),
            (row.split or "") if running else "",  # micro-batch x accumulation the job chose
        )
    return fit(table, width, STATUS_PRIORITY)


def gpu_texts(row: JobStatus) -> tuple[str, str]:
    """`87%` and `41.2/85.5 GB` from a running job's latest GPU samples; blank without them (no GPU, no
    NVML, or before the first sample)."""
    util = f"{row.gpu_util_percent:.0f}%" if row.gpu_util_percent is not None else ""
    memory = ""
    if row.gpu_mem_gb is not None:
        memory = (
            f"{row.gpu_mem_gb:.1f}" + (f"/{row.gpu_mem_total_gb:.1f}" if row.gpu_mem_total_gb else "") + " GB"
        )
    return util, memory


def problem_lines(rows: list[JobStatus], tail_lines: int = 5) -> list[str]:
    """For each job that did not complete: why, where its log is, and the log's last lines."""
    lines = []
    for row in rows:
        if row.reason.startswith(NEVER_STARTS_MARK):
            cause = row.reason.partition(": ")[2]
            lines.append(
                f"{row.job.id}: PENDING, {NEVER_STARTS_MARK} (slurm job {row.scheduler_id}, {cause}: "
                f"{NEVER_STARTS.get(cause, 'a limit it is over')}); cancel it ({cancel_hint(row)}) and "
                "relaunch within the limit"
            )
        elif row.state is State.BLOCKED:
            lines.append(f"{row.job.id}: BLOCKED, will not run: {row.reason}")
        elif (
            row.state is State.CANCELLED
        ):  # asked for: no cause to fix, and its log's traceback is the stop's
            why = f", {row.reason}" if row.reason else ""
            lines.append(
                f"{row.job.id}: CANCELLED ({which_job(row)}{why}): stopped as asked, not failed; the same "
                "launch (or --retry-failed) runs it again"
            )
        elif row.state.failed or row.state is State.UNKNOWN:
            lines.append(f"{row.job.id}: {row.state.value} ({which_job(row)}) {row.reason}".rstrip())
            lines.append(f"  log: {row.log_path}")
            lines += [f"  | {line}" for line in last_lines(row.log_path, tail_lines)]
    if any(r.state.failed and r.state is not State.CANCELLED for r in rows):
        lines.append("Fix the cause, then: python launch.py --retry-failed (same --config-dir)")
    return lines


def which_job(row: JobStatus) -> str:
    return f"local pid {row.scheduler_id}" if row.backend == "local" else f"slurm job {row.scheduler_id}"


def cancel_hint(row: JobStatus) -> str:
    """How to cancel one job: its experiment; a base-model eval (no experiment of its own) by its id."""
    if row.job.experiment.startswith(BASE_EVAL_PREFIX):
        return f"scancel {row.scheduler_id}"
    return f"--cancel --exp {row.job.experiment}"


def last_lines(path: str, count: int) -> list[str]:
    """The log's last `count` non-blank lines (from its last 8 KiB: a FIFO or a device is never read)."""
    try:
        text = read_window(Path(path), None, 8192)[0].decode("utf-8", "replace")
    except NotARegularFile as exc:
        return [f"(log not read: {exc.strerror})"]
    except OSError:
        return ["(no log)"]
    return [line for line in text.splitlines() if line.strip()][-count:]
