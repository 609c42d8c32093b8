"""Asynchronous successive halving (ASHA, Li et al. 2018, stopping form): the rule, and its records on disk.

A run of a pruned sweep (core/config.py PruneSpec) that reaches a rung (an epoch) records its eval_loss
there and reads every loss recorded at that rung so far, its own included. With fewer than `min_points`
it goes on; otherwise it stops if its loss is above the `keep` quantile of those losses (linear
interpolation, numpy's default), else it goes on. No run ever waits for another: early runs are judged
against few records and so are rarely stopped; later ones are judged against them all. Ray Tune's
AsyncHyperBand differs: it leaves the run itself out of the quantile, has no min_points, and never stops
a NaN; this rule is a slightly more lenient ASHA. `expected_epochs` counts the early runs that go on.

The records: RUN_ROOT/.rungs/SWEEP/RUNG.jsonl, one row per decision (`RungRecord`), appended under an
exclusive flock on RUNG.lock beside it, so two runs deciding at once each read the other's loss or neither
does, never half of it. A row carries what its loss was measured under (`measured_under`: the sweep's
definition, `definition_hash`), and a decision counts only rows of its own: an edited sweep, or another
sweep under a reused name, starts clean. One value per run counts (its latest row). A run that finds its
own decision recorded for its config (a requeue after deciding) takes that decision back and never decides
again. Every write goes below the run root without following a link (core/below.py), at the moment it is
made. Torch-free: the trainer calls `judged`, the report and --status read `rung_records`.
"""

from __future__ import annotations

import fcntl
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from core.below import check as check_no_link
from core.config import PruneJob, what_it_computes
from core.files import append_json_line, finite_or_null, json_line, open_lock, read_jsonl, write_atomic
from core.hashing import content_hash
from core.rundir import RunDir, RunRoot

RECORD_FIELDS = {
    "run": str,
    "config_hash": str,
    "measured_under": str,
    "rung": (int, float),
    "eval_loss": (int, float, type(None)),
    "stop": bool,
    "cutoff": (int, float, type(None)),
    "points": int,
}


@dataclass(frozen=True)
class Decision:
    stop: bool
    cutoff: float | None  # the keep quantile of the losses judged against; None below min_points
    points: int  # the finite losses at the rung the decision weighed (this run's, when finite, included)


@dataclass(frozen=True)
class RungRecord:
    """One run's loss at one rung and what was decided from it (a row of RUNG.jsonl)."""

    run: str  # the run's experiment name: a sweep point's seed
    config_hash: str
    measured_under: str  # the sweep's definition (definition_hash): only rows of one definition compare
    rung: float
    eval_loss: float  # NaN for a loss that was not a finite number (written null: strict JSON)
    stop: bool
    cutoff: float | None
    points: int

    @property
    def decision(self) -> Decision:
        return Decision(self.stop, self.cutoff, self.points)


def quantile(values: list[float], q: float) -> float:
    """numpy.quantile(values, q) with its default linear interpolation, written out (no numpy here)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (position - below) * (ordered[above] - ordered[below])


def decision(own_loss: float, recorded: list[float], keep: float, min_points: int) -> Decision:
    """Whether a run with `own_loss` stops, judged against `recorded` (every loss at the rung, its own
    included). A loss equal to the cutoff goes on: ties are kept. A loss that is not a finite number (a
    diverged eval) stops at once and is left out of the others' judgements (and of `points`)."""
    finite = [loss for loss in recorded if math.isfinite(loss)]
    if not math.isfinite(own_loss):
        return Decision(True, None, len(finite))
    if len(finite) < min_points:
        return Decision(False, None, len(finite))
    cutoff = quantile(finite, keep)
    return Decision(own_loss > cutoff, cutoff, len(finite))


def definition_hash(spec: dict, swept: list[str]) -> str:
    """What a sweep's losses are measured under: a point's training spec (a TrainJob's model_dump) without
    what differs between its points (the swept keys, the seed, its name and folders) nor how it is watched.
    Its eval set, model, data and every unswept setting are in it: edit any, and the losses are another
    sweep's. Adding a value to a swept key keeps it (the points already run stay comparable)."""
    kept = what_it_computes({k: v for k, v in spec.items() if k in ("model", "adapter", "data", "train")})
    for dotted in [*swept, "train.seed"]:
        *parents, last = dotted.split(".")
        section = kept
        for part in parents:
            section = section.get(part) if isinstance(section, dict) else None
        if isinstance(section, dict):
            section.pop(last, None)
    rungs = spec.get("prune", {}).get("rungs") if isinstance(spec.get("prune"), dict) else None
    return content_hash({"spec": kept, "rungs": rungs})


def expected_epochs(
    epochs: float, rungs: list[float], keep: float, runs: int | None = None, min_points: int = 1
) -> float:
    """One run's expected epochs in a sweep of `runs` runs: r1 + s1(r2 - r1) + ... + sm(E - rm), where s is
    the share of the runs still going after each rung (`surviving`). `runs` None: a sweep too large to
    count, where every rung keeps `keep` (s = k, k^2, ...). The worst case (no run stopped) is `epochs`.
    Checked against a simulation of the rule itself (tests/test_pruning.py)."""
    bounds = [0.0, *rungs, epochs]
    arriving, total = float(runs or 1), 0.0
    for index, (start, end) in enumerate(zip(bounds, bounds[1:], strict=False)):
        share = arriving / runs if runs else keep**index
        total += share * (end - start)
        if runs and index < len(rungs):
            arriving = surviving(arriving, keep, min_points)
    return total


def surviving(arriving: float, keep: float, min_points: int) -> float:
    """How many of `arriving` runs are expected to go on at a rung, deciding one after another: the i-th to
    arrive goes on below `min_points`, else when its loss is among the lowest floor((i - 1) k) + 1 of the i
    recorded, which for exchangeable losses is a chance of (floor((i - 1) k) + 1) / i. Early runs are judged
    against few records, so more go on than `keep` of them (8 runs, keep 1/3, min_points 3: 4.4). A count
    between two whole numbers is interpolated."""

    def going_on(count: int) -> float:
        return sum(
            1.0 if i < min_points else (math.floor((i - 1) * keep) + 1) / i for i in range(1, count + 1)
        )

    whole = math.floor(arriving)
    return going_on(whole) + (arriving - whole) * (going_on(whole + 1) - going_on(whole))


def rung_name(rung: float) -> str:
    return f"{rung:g}"


def rung_file(run_root: Path, sweep: str, rung: float) -> Path:
    return RunRoot.of(run_root).rungs(sweep) / f"{rung_name(rung)}.jsonl"


def rung_records(run_root: Path, sweep: str, rung: float) -> list[RungRecord]:
    """Every row recorded at the rung, oldest first; a torn or foreign row is left out (and warned about)."""
    rows = read_jsonl(rung_file(run_root, sweep, rung), RECORD_FIELDS)
    return [
        RungRecord(**{**row, "eval_loss": math.nan if row["eval_loss"] is None else row["eval_loss"]})
        for row in rows
        if RECORD_FIELDS.keys() <= row.keys() and len(row) == len(RECORD_FIELDS)
    ]


def latest_by_run(records: list[RungRecord]) -> dict[str, RungRecord]:
    """Each run's latest record: the value that counts for it."""
    return {record.run: record for record in records}


def judged(
    run_root: Path, sweep: str, run: str, config_hash: str, rung: float, eval_loss: float, prune: PruneJob
) -> RungRecord:
    """Record `run`'s loss at `rung` and decide, under the rung's lock, against the rows measured under
    `prune.measured_under`; a decision already recorded for this run, config and definition (a requeued
    run) is returned as it was, and nothing is written. An OSError (a link, a FIFO, a file where the
    folder belongs) names the path; nothing is recorded then."""
    path = rung_file(run_root, sweep, rung)
    with open_lock(path.with_suffix(".lock"), root=run_root) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, however this process ends
        records = [r for r in rung_records(run_root, sweep, rung) if r.measured_under == prune.measured_under]
        mine = [r for r in records if (r.run, r.config_hash) == (run, config_hash)]
        if mine:
            return mine[-1]
        losses = [r.eval_loss for r in latest_by_run(records).values() if r.run != run] + [eval_loss]
        decided = decision(eval_loss, losses, prune.keep, prune.min_points)
        record = RungRecord(
            run,
            config_hash,
            prune.measured_under,
            rung,
            eval_loss,
            decided.stop,
            decided.cutoff,
            decided.points,
        )
        append_json_line(path, asdict(record), root=run_root)
        return record


def archive_run_records(run_root: Path, sweep: str, run: str, archive: str) -> int:
    """Move `run`'s rows out of its sweep's rung files into RUN_ROOT/.rungs/SWEEP/ARCHIVE/ (its run folder
    was archived: --force), each file rewritten whole under its lock. Returns the rows moved."""
    folder = RunRoot.of(run_root).rungs(sweep)
    if not folder.is_dir() or folder.is_symlink():
        return 0
    moved = 0
    for path in sorted(folder.glob("*.jsonl")):
        with open_lock(path.with_suffix(".lock"), root=run_root) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            rows = read_jsonl(path)
            theirs = [row for row in rows if row.get("run") == run]
            if not theirs:
                continue
            for row in theirs:
                append_json_line(folder / archive / path.name, row, root=run_root)
            check_no_link(run_root, path)
            write_atomic(path, "".join(json_line(row) for row in rows if row.get("run") != run))
            moved += len(theirs)
    return moved


def mark_pruned(run_dir: Path, record: RungRecord, evaluate: bool = True) -> None:
    """The stage's own note that it stopped at a rung (RunDir.pruned): --status, the report and the eval
    read it (`evaluate`: prune.eval_pruned); its DONE, written when the stage ends, says it ended."""
    text = json.dumps(finite_or_null({**asdict(record), "evaluate": evaluate}), indent=1, allow_nan=False)
    write_atomic(RunDir(run_dir).pruned, text + "\n", root=RunDir(run_dir).run_root)


def decided_text(decided: dict, min_points: int | None = None) -> str:
    """A rung's decision in words, from a RungRecord's fields (a PRUNED file's, read tolerantly: a missing
    figure is left out): `rung 1: eval_loss 3.21 > cutoff 1.15 of 4 runs: stop`. A loss that is no number
    (NaN, or null in strict JSON) says so: it stops at once, with no cutoff (before: "at a rung")."""
    rung, loss, cutoff, points = (decided.get(k) for k in ("rung", "eval_loss", "cutoff", "points"))
    where = f"rung {rung:g}" if isinstance(rung, (int, float)) else "a rung"
    verdict = "stop" if decided.get("stop", True) else "go on"
    if not isinstance(loss, (int, float)) or not math.isfinite(loss):
        return f"{where}: eval_loss is not a number ({loss}: the eval diverged): {verdict}"
    if cutoff is None:
        fewer = f" (fewer than min_points {min_points})" if min_points is not None else ""
        counted = f"{points} run(s) recorded{fewer}" if points is not None else "no cutoff"
        return f"{where}: eval_loss {loss:.4g}, {counted}: {verdict}"
    sign = ">" if loss > cutoff else "<="
    of = f" of {points} runs" if points is not None else ""
    return f"{where}: eval_loss {loss:.4g} {sign} cutoff {cutoff:.4g}{of}: {verdict}"
