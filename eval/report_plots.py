"""The loss curves (matplotlib, drawn headless): loss_curves.png of every experiment, a sweep point's
replicates as one mean line with a min–max band, and each experiment's own loss.png, steps counted across
its stages: each training method's loss on a panel of its own (an SFT cross-entropy and a DPO or GRPO loss
are different quantities: on one axis a DPO loss of 0.6 after an SFT loss of 0.04 read as "17x worse"), and
beside them a DPO stage's reward accuracy and margin, a GRPO stage's mean reward and its share of groups
without reward variance. Reads each stage's `metrics.jsonl` (eval/report_rows.py read_metrics)."""

from __future__ import annotations

import statistics
from functools import partial
from pathlib import Path

from core.files import write_atomic_with
from core.rundir import RunRoot
from core.runs import JobRun
from core.sweep import SweepMember
from eval.report_rows import read_metrics


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


# A DPO or GRPO stage's curves (TRL's log rows in metrics.jsonl), each method's on a panel beside the losses
REWARD_KEYS_OF = {
    "dpo": ("rewards/accuracies", "rewards/margins"),
    "grpo": ("reward", "frac_reward_zero_std"),
}
REWARD_KEYS = tuple(key for keys in REWARD_KEYS_OF.values() for key in keys)
REWARD_AXES = {
    "dpo": ("reward accuracy (share) / margin", "DPO rewards (against its reference)"),
    "grpo": ("mean reward / share of groups without variance", "GRPO rewards"),
}


def reward_series(jobs: list[JobRun], experiment: str) -> dict[str, list]:
    """Each REWARD_KEYS curve the experiment's stages logged, steps counted across stages as loss_series
    counts them; {} when none did (no preference or GRPO stage)."""
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


def method_of(job: JobRun, rows: list[dict]) -> str:
    """A training stage's method: its summary.json's, or, while it runs, what its rows log."""
    if job.summary.get("method"):
        return job.summary["method"]
    for method, keys in REWARD_KEYS_OF.items():
        if any(keys[0] in row for row in rows):
            return method
    return "sft"


def losses_by_method(jobs: list[JobRun], experiment: str) -> dict[str, tuple[list, list]]:
    """method -> (its stages' training loss points, their eval loss points), steps counted across all stages
    as loss_series counts: an SFT cross-entropy and a DPO or GRPO loss are not one quantity, so neither are
    their evals (before: every stage's eval on the SFT panel, one dashed line from SFT's to DPO's)."""
    found: dict[str, tuple[list, list]] = {}
    offset = 0
    for job in (j for j in jobs if j.experiment == experiment and j.kind == "train"):
        rows = read_metrics(job.run_dir)
        points = [(offset + r["step"], r["loss"]) for r in rows if "loss" in r and "step" in r]
        evals = [(offset + r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r and "step" in r]
        if points or evals:
            train, evaluated = found.setdefault(method_of(job, rows), ([], []))
            train.extend(points)
            evaluated.extend(evals)
        offset += max((r.get("step", 0) for r in rows), default=0)
    return found


def numeric(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def draw_rewards(ax, name: str, rewards: dict[str, list], method: str = "dpo") -> None:
    for key, points in rewards.items():
        ax.plot(*zip(*points, strict=True), label=f"{name} {key}", **dots(points))
    ax.axhline(0, color="grey", linewidth=0.8)
    ylabel, title = REWARD_AXES[method]
    ax.set_xlabel("optimizer step (across stages)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{name}: {title}")
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
    paths = [RunRoot(run_root).loss_curves]
    fig, ax = plt.subplots(figsize=(9, 5))
    draw_all(ax, series, experiments, sweeps)
    banded = "; sweep points: mean of their seeds, band min–max" if sweeps.keys() & series.keys() else ""
    finish(ax, f"Loss of every experiment (dotted lines: stage boundaries{banded})")
    write_atomic_with(paths[0], partial(fig.savefig, dpi=110, bbox_inches="tight"))
    plt.close(fig)
    for name, (train, evals, boundaries) in series.items():
        fig = experiment_figure(plt, jobs, name, (train, evals, boundaries))
        paths.append(RunRoot(run_root).loss_plot(name))
        paths[-1].parent.mkdir(parents=True, exist_ok=True)
        write_atomic_with(paths[-1], partial(fig.savefig, dpi=110, bbox_inches="tight"))
        plt.close(fig)
    return paths


def experiment_figure(plt, jobs: list[JobRun], name: str, series: tuple):
    """One experiment's loss.png: its loss (one panel per training method when it has several, each with
    that method's stages), then each DPO or GRPO method's reward panel."""
    train, evals, boundaries = series
    by_method = losses_by_method(jobs, name)
    rewards = reward_series(jobs, name)
    beside = [m for m, keys in REWARD_KEYS_OF.items() if any(k in rewards for k in keys)]
    panels = max(1, len(by_method)) + len(beside)
    fig, axes = plt.subplots(1, panels, figsize=(7 + 6 * (panels - 1), 4), squeeze=False)
    axes = list(axes[0])
    if len(by_method) <= 1:
        draw(axes[0], name, train, evals, boundaries, label_stages=True)
        finish(axes[0], f"{name}: loss")
    else:
        for ax, (method, (points, own_evals)) in zip(axes, by_method.items(), strict=False):
            draw(ax, f"{name} {method}", points, own_evals, boundaries, label_stages=True)
            finish(ax, f"{name}: {method} loss")
    for ax, method in zip(axes[max(1, len(by_method)) :], beside, strict=True):
        draw_rewards(ax, name, {k: v for k, v in rewards.items() if k in REWARD_KEYS_OF[method]}, method)
    return fig


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


# A curve of this many points or fewer shows each one: a line through a single point draws nothing (a short
# stage's rows: the first step and the last).
FEW_POINTS = 25


def dots(points: list) -> dict:
    """matplotlib's style for a curve of `points`: a marker on each when they are few."""
    return {"marker": "o", "markersize": 3} if len(points) <= FEW_POINTS else {}


def draw(ax, name, train, evals, boundaries, label_stages=False) -> None:
    line = None
    if train:
        (line,) = ax.plot(*zip(*train, strict=True), label=f"{name} train", **dots(train))
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
