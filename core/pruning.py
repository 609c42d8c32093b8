"""Asynchronous successive halving (ASHA, Li et al. 2018, stopping form): the rule, and its records on disk.

A run of a pruned sweep (core/config.py PruneSpec) that reaches a rung (an epoch) records its eval_loss
there and reads every loss recorded at that rung so far, its own included. With fewer than `min_points`
it goes on; otherwise it stops if its loss is above the `keep` quantile of those losses (linear
interpolation, numpy's default), else it goes on. No run ever waits for another: early runs are judged
against few records and so are rarely stopped; later ones are judged against them all. Ray Tune's
AsyncHyperBand scheduler does the same for rewards.

The records: RUN_ROOT/.rungs/SWEEP/RUNG.jsonl, one row per decision (`RungRecord`), appended under an
exclusive flock on RUNG.lock beside it, so two runs deciding at once each read the other's loss or neither
does, never half of it. One value per run counts (its latest row): a run rerun under another config
replaces its value. A run that finds its own decision recorded for its config (a requeue after deciding)
takes that decision back and never decides again. Torch-free: the trainer calls `judged`, the report and
--status read `rung_records`.
"""

from __future__ import annotations

import fcntl
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from core.config import PruneSpec
from core.files import open_append, open_lock, read_jsonl, write_json_atomic
from core.layout import RUNGS
from core.rundir import RunDir

RECORD_FIELDS = {
    "run": str,
    "config_hash": str,
    "rung": (int, float),
    "eval_loss": (int, float),
    "stop": bool,
    "cutoff": (int, float, type(None)),
    "points": int,
}


@dataclass(frozen=True)
class Decision:
    stop: bool
    cutoff: float | None  # the keep quantile of the losses judged against; None below min_points
    points: int  # how many runs' losses were recorded at the rung, this one's included


@dataclass(frozen=True)
class RungRecord:
    """One run's loss at one rung and what was decided from it (a row of RUNG.jsonl)."""

    run: str  # the run's experiment name: a sweep point's seed
    config_hash: str
    rung: float
    eval_loss: float
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
    diverged eval) stops at once and is left out of the others' judgements."""
    if not math.isfinite(own_loss):
        return Decision(True, None, len(recorded))
    recorded = [loss for loss in recorded if math.isfinite(loss)]
    if len(recorded) < min_points:
        return Decision(False, None, len(recorded))
    cutoff = quantile(recorded, keep)
    return Decision(own_loss > cutoff, cutoff, len(recorded))


def expected_epochs(epochs: float, rungs: list[float], keep: float) -> float:
    """One run's expected epochs when every rung keeps `keep` of the runs: r1 + k(r2 - r1) + ... +
    k^m(E - rm). The worst case (no run stopped) is `epochs`."""
    bounds = [0.0, *rungs, epochs]
    return sum(
        keep**index * (end - start)
        for index, (start, end) in enumerate(zip(bounds, bounds[1:], strict=False))
    )


def rung_name(rung: float) -> str:
    return f"{rung:g}"


def rung_file(run_root: Path, sweep: str, rung: float) -> Path:
    return Path(run_root) / RUNGS / sweep / f"{rung_name(rung)}.jsonl"


def rung_records(run_root: Path, sweep: str, rung: float) -> list[RungRecord]:
    """Every row recorded at the rung, oldest first; a torn or foreign row is left out (and warned about)."""
    rows = read_jsonl(rung_file(run_root, sweep, rung), RECORD_FIELDS)
    return [
        RungRecord(**row)
        for row in rows
        if RECORD_FIELDS.keys() <= row.keys() and len(row) == len(RECORD_FIELDS)
    ]


def latest_by_run(records: list[RungRecord]) -> dict[str, RungRecord]:
    """Each run's latest record: the value that counts for it."""
    return {record.run: record for record in records}


def judged(
    run_root: Path, sweep: str, run: str, config_hash: str, rung: float, eval_loss: float, prune: PruneSpec
) -> RungRecord:
    """Record `run`'s loss at `rung` and decide, under the rung's lock; a decision already recorded for
    this run and config (a requeued run) is returned as it was, and nothing is written."""
    path = rung_file(run_root, sweep, rung)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open_lock(path.with_suffix(".lock")) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, however this process ends
        records = rung_records(run_root, sweep, rung)
        mine = [r for r in records if (r.run, r.config_hash) == (run, config_hash)]
        if mine:
            return mine[-1]
        losses = [r.eval_loss for r in latest_by_run(records).values() if r.run != run] + [eval_loss]
        decided = decision(eval_loss, losses, prune.keep, prune.min_points)
        record = RungRecord(run, config_hash, rung, eval_loss, decided.stop, decided.cutoff, decided.points)
        with open_append(path) as fh:
            fh.write(json.dumps(asdict(record)) + "\n")
            fh.flush()
        return record


def mark_pruned(run_dir: Path, record: RungRecord, evaluate: bool = True) -> None:
    """The stage's own note that it stopped at a rung (RunDir.pruned): --status, the report and the eval
    read it (`evaluate`: prune.eval_pruned); its DONE, written when the stage ends, says it ended."""
    write_json_atomic(RunDir(run_dir).pruned, {**asdict(record), "evaluate": evaluate}, indent=1)


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
