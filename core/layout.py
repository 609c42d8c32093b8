"""The names the pipeline gives its own files and folders beside the user's experiments and stages.

An experiment's folders are RUN_ROOT/EXP and LOG_DIR/EXP, a stage's RUN_ROOT/EXP/STAGE and LOG_DIR/EXP/STAGE:
a user's name shares those folders with the names below, so validation refuses every one of them
(`taken_experiment_name`, `taken_stage_name`). The writers take their names from here, so a name added here
is refused from then on; tests/test_layout.py runs every writer and checks that what it leaves is refused.
Torch-free and standard library only: the experiment schema (core/config.py) imports it.
"""

from __future__ import annotations

import os
from pathlib import Path

# RUN_ROOT/: files of the whole run root.
SPEED_BOOK = "speeds.jsonl"  # core/speeds.py
PREFLIGHT_TOKENS = (
    "preflight-tokens.json"  # slurm/planning/preflight_books.py, through core/rundir.py RunRoot
)
PREFLIGHT_SPLITS = "preflight-splits.json"  # slurm/planning/preflight_books.py
REPORT_MD = "report.md"  # eval/report.py
REPORT_CSV = "report.csv"  # eval/report.py
LOSS_CURVES = "loss_curves.png"  # eval/report_plots.py
LAUNCH_LOCK = ".launch.lock"  # slurm/queueing/lock.py
RUNGS = ".rungs"  # core/pruning.py: RUNGS/SWEEP/RUNG.jsonl, a pruned sweep's losses at each rung
RUN_ROOT = {
    SPEED_BOOK: "the speed book",
    PREFLIGHT_TOKENS: "preflight's token counts",
    PREFLIGHT_SPLITS: "preflight's batch splits",
    REPORT_MD: "the report",
    REPORT_CSV: "the report's table",
    LOSS_CURVES: "the report's loss curves",
    LAUNCH_LOCK: "the launch lock",
    RUNGS: "the pruned sweeps' rung records",
}

# LOG_DIR/: folders beside the experiments' log folders.
PACKS = "packs"  # slurm/queueing/backends.py: packed allocations' submitit folders
ARRAYS = "arrays"  # slurm/queueing/backends.py: job arrays' submitit folder
SHARED_EVALS = "shared-evals"  # slurm/queueing/backends.py: shared evals' submitit folder and progress
CODE_SNAPSHOTS = ".code"  # slurm/queueing/snapshot.py
LOG_ROOT = {
    PACKS: "the packed allocations' logs",
    ARRAYS: "the job arrays' logs",
    SHARED_EVALS: "the shared evals' logs",
    CODE_SNAPSHOTS: "the code snapshots",
}

# RUN_ROOT/EXP/: what shares an experiment's folder with its stages.
EVAL = "eval"  # the eval of the last stage; the others' are eval-STAGE (eval_folder)
EXPORT = "export"  # the export job's folder
EXPERIMENT_LOSS_PLOT = "loss.png"  # eval/report_plots.py
ORIGIN = "origin.json"  # core/rundir.py: the config file and folder the experiment was launched from
EXPERIMENT_FOLDER = {
    EVAL: "the eval job's folder",
    EXPORT: "the export job's folder",
    EXPERIMENT_LOSS_PLOT: "the report's loss plot of the experiment",
    ORIGIN: "where the experiment was launched from",
}
EVAL_PREFIX = f"{EVAL}-"
EXPORT_PREFIX = f"{EXPORT}-"
# RUN_ROOT/_base-MODEL-KEY/eval: a base-model eval, shared by the experiments it is the base row of. No
# experiment's name starts with '_' (core/config.py SAFE_NAME), so it cannot take an experiment's folder.
BASE_EVAL_PREFIX = "_base-"
CALIBRATION_SUFFIX = "-calibrate"
ARCHIVE_INFIX = ".old-"


def eval_folder(stage: str, last: bool) -> str:
    """The eval job of `stage`: `eval` after the last stage, `eval-STAGE` after the others."""
    return EVAL if last else f"{EVAL_PREFIX}{stage}"


def export_folder(stage: str, last: bool) -> str:
    """The export of `stage` (launch.py --export): `export` for the last stage, `export-STAGE` for another."""
    return EXPORT if last else f"{EXPORT_PREFIX}{stage}"


def calibration_folder(stage: str) -> str:
    """A `launch.py --calibrate` run of `stage`."""
    return f"{stage}{CALIBRATION_SUFFIX}"


def archive_folder(name: str, stamp: str) -> str:
    """A run folder moved aside (another config, or --force): never deleted."""
    return f"{name}{ARCHIVE_INFIX}{stamp}"


# Names are compared without case: on a case-insensitive file system (a laptop running the local backend),
# Report.md is report.md.


def taken_experiment_name(name: str) -> str | None:
    """What already goes by `name` in RUN_ROOT/ or LOG_DIR/, where an experiment's folders go; else None."""
    for root, names in (("RUN_ROOT", RUN_ROOT), ("LOG_DIR", LOG_ROOT)):
        for taken, what in names.items():
            if taken.casefold() == name.casefold():
                return f"{what} ({root}/{taken})"
    return None


def taken_stage_name(name: str) -> str | None:
    """What already goes by `name` in RUN_ROOT/EXP/ or LOG_DIR/EXP/, where a stage's folders go; else
    None. Whole families are taken, not only the names of this experiment's other stages: a stage added
    later, or eval.after_each_stage turned on, must not take over a folder that holds a result."""
    folded = name.casefold()
    if folded in EXPERIMENT_FOLDER:
        return f"{EXPERIMENT_FOLDER[folded]} (RUN_ROOT/EXP/{folded})"
    if folded.startswith(EVAL_PREFIX):
        return f"the folder of the eval after a stage '{name[len(EVAL_PREFIX) :]}' (RUN_ROOT/EXP/eval-STAGE)"
    if folded.startswith(EXPORT_PREFIX):
        return f"the export of a stage '{name[len(EXPORT_PREFIX) :]}' (RUN_ROOT/EXP/export-STAGE)"
    if folded.endswith(CALIBRATION_SUFFIX):
        stage = name[: -len(CALIBRATION_SUFFIX)]
        return (
            f"the folder of a --calibrate run of a stage '{stage}' (RUN_ROOT/EXP/STAGE{CALIBRATION_SUFFIX})"
        )
    if ARCHIVE_INFIX in folded:
        return f"the archives of run folders (RUN_ROOT/EXP/STAGE{ARCHIVE_INFIX}DATE)"
    return None


def cache_root() -> Path:
    """LORA_CACHE_DIR: the token cache (`tokenized/`), preflight's results and log (`preflight/`), shared by
    the login node and the jobs (a folder the nodes share, on a cluster)."""
    return Path(os.environ.get("LORA_CACHE_DIR", Path.home() / ".cache" / "lora-pipeline"))
