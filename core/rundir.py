"""The run folder of one job, `RUN_ROOT/EXP/STAGE/` (a training stage) or `RUN_ROOT/EXP/eval*/` (an eval):
`RunDir` names every file in it, as submitit's JobPaths names a job's, and nobody else spells them.

config.yaml    the resolved spec the job runs (the launcher, at submission)
job.json       every scheduler job id this folder ever had, oldest first, with the code it ran; while a
               submission is under way, its intent (`submitting`: the token its SLURM comment carries);
               read and written, typed, by core/job_records.py
progress.json  step / total / loss / ETA / GPU use (the trainer's rank 0, while it runs)
metrics.jsonl  one row per logging step and per in-training eval (the trainer's rank 0)
checkpoints/   the trainer's checkpoints, each committed by a marker (train/checkpoints.py)
adapter/       the trained adapter and its tokenizer (the trainer, at its end)
split.json     how the effective batch was split (micro-batch, accumulation, checkpointing, why): the
               trainer's rank 0 at a fresh start; a resumed run keeps it (core/split.py)
summary.json   what the stage did: steps, runtime, tokens, device, precision, world size (the trainer, last)
lane.json      for a unit of a packed allocation: its lane, GPU and how it ended (slurm/queueing/lanes.py)
predictions.jsonl, predictions.partial.jsonl, results.json   an eval's (eval/job.py, eval/predictions.py)
PRUNED         a stage of a pruned sweep stopped at a rung: the rung, its loss and the cutoff it was above
               (core/pruning.py, the trainer's rank 0 when it decides; its DONE follows as for a completed one)
DONE           the config hash, written last: a stage with a matching DONE never runs again
.writer.lock   the lock its one writer (a training or eval job's rank 0) holds for its life, and
.writer.json   who holds it: host, pid, job id, since when (core/writer_lock.py)
tb/, wandb/    the stage's TensorBoard events and W&B's folder (train/tracking.py)
EXPORT_DONE    an export's identity, its files and self-check figures, written last (eval/export.py)

Beside the stages, RUN_ROOT/EXP/origin.json says which config file and folder the experiment was launched
from (`Origin`), so watching finds what the run root holds, not only what one config folder names.

Its readers tolerate what a crash, a full disk or a hand edit leaves (core/files.py): the file is named
in a warning and read as absent, except DONE, which is never taken for absent (the stage would run twice).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from core import layout
from core.files import read_json, read_text, warn_unreadable, write_atomic
from core.hashing import IDENTITY
from core.layout import ORIGIN
from core.names import REPORT_COLUMNS

# What the readers take from the trainer's and the eval's files, and the kind each must hold: a file or
# key of another shape is named in a warning and left out (core/files.py), never a traceback.
PROGRESS_FIELDS = {  # --status (absent keys are None, e.g. no GPU)
    "step": int,
    "total_steps": int,
    "last_loss": float,
    "eta_s": float,
    "gpu_util_percent": float,
    "gpu_mem_gb": float,
    "gpu_mem_total_gb": float,
    "split": str,
}
SUMMARY_FIELDS = {  # the report, the eval (precision), the next stage (steps), a relaunch (world size)
    "train_runtime_s": float,
    "num_input_tokens_seen": float,
    "best_eval_loss": float,
    "trainable_percent": float,
    "device": str,
    "precision": str,
    "world_size": int,
    "step_offset": int,
    "global_step": int,
    "split": dict,
}
RESULTS_FIELDS = {
    "split": str,
    "skipped": str,
    "adapter_changes_output": bool,
    **dict.fromkeys(REPORT_COLUMNS, float),
}
METRICS_FIELDS = {"step": int, "loss": float, "eval_loss": float, "gpu_util_percent": float}
# EXPORT_DONE as eval/export.py writes it (identity None: an export that was being moved in)
EXPORT_DONE_FIELDS = {"identity": str, "files": list, "result": dict}
# PRUNED as core/pruning.py writes it (a RungRecord)
PRUNED_FIELDS = {
    "rung": (int, float),
    "eval_loss": (int, float),
    "cutoff": (int, float),
    "points": int,
    "evaluate": bool,
}
# lane.json as slurm/queueing/lanes.py writes it
LANE_FIELDS = {
    "pack_job": (str, int),
    "lane": int,
    "gpu": (str, int),
    "state": str,
    "reason": str,
    "started_s": float,
    "ended_s": float,
}


CONFIG = "config.yaml"
ADAPTER = "adapter"


def run_folder(run_root: str, experiment: str, folder: str) -> str:
    """RUN_ROOT/EXP/FOLDER, a stage's, an eval's or an export's folder, spelt as every plan has spelt it:
    the string is part of a job's spec, so it must not change (a `./runs` root stays `./runs/...`)."""
    return f"{run_root}/{experiment}/{folder}"


def in_folder(folder: str, name: str) -> str:
    """A file of a run folder, as a spec names it (`{run_dir}/adapter`): run_folder's spelling."""
    return f"{folder}/{name}"


def log_folder(log_root: str | Path, job_id: str) -> Path:
    """LOG_DIR/EXP/STAGE: a job's submitit folder (its logs, pickled call and result)."""
    return LogRoot.of(log_root).job(job_id)


@dataclass(frozen=True)
class RunRoot:
    """RUN_ROOT: the experiments' folders and the files of the whole run root (core/layout.py names
    them), by what they are, as RunDir names a stage folder's."""

    path: Path

    @classmethod
    def of(cls, root: str | Path) -> RunRoot:
        return cls(Path(root))

    def experiment(self, name: str) -> Path:
        """RUN_ROOT/EXP, an experiment's folder (its stages, evals, origin.json)."""
        return self.path / name

    def stage(self, job_id: str) -> RunDir:
        """RUN_ROOT/EXP/STAGE, for a plan's job id EXP/STAGE."""
        return RunDir(self.path / job_id)

    @property
    def speed_book(self) -> Path:
        return self.path / layout.SPEED_BOOK

    @property
    def preflight_tokens(self) -> Path:
        return self.path / layout.PREFLIGHT_TOKENS

    @property
    def preflight_splits(self) -> Path:
        return self.path / layout.PREFLIGHT_SPLITS

    @property
    def launch_lock(self) -> Path:
        return self.path / layout.LAUNCH_LOCK

    @property
    def report(self) -> Path:
        return self.path / layout.REPORT_MD

    @property
    def report_table(self) -> Path:
        return self.path / layout.REPORT_CSV

    @property
    def loss_curves(self) -> Path:
        return self.path / layout.LOSS_CURVES

    def loss_plot(self, experiment: str) -> Path:
        """RUN_ROOT/EXP/loss.png: the report's plot of one experiment."""
        return self.experiment(experiment) / layout.EXPERIMENT_LOSS_PLOT

    def rungs(self, sweep: str) -> Path:
        """RUN_ROOT/.rungs/SWEEP: a pruned sweep's records at each rung (core/pruning.py)."""
        return self.path / layout.RUNGS / sweep


@dataclass(frozen=True)
class LogRoot:
    """LOG_DIR: each job's submitit folder, the packed allocations' and the code snapshots."""

    path: Path

    @classmethod
    def of(cls, root: str | Path) -> LogRoot:
        return cls(Path(root))

    def job(self, job_id: str) -> Path:
        """LOG_DIR/EXP/STAGE: a job's submitit folder (its logs, pickled call and result)."""
        return self.path / job_id

    @property
    def packs(self) -> Path:
        """LOG_DIR/packs: the packed allocations' submitit folder."""
        return self.path / layout.PACKS

    @property
    def arrays(self) -> Path:
        """LOG_DIR/arrays: the job arrays' submitit folder (each task's log is `ARRAY_TASK_0_log.out`)."""
        return self.path / layout.ARRAYS

    @property
    def shared_evals(self) -> Path:
        """LOG_DIR/shared-evals: the shared evals' submitit folder; each one's progress (scored.json) in
        a folder of its own there, named by its submission's token."""
        return self.path / layout.SHARED_EVALS

    def code_snapshot(self, digest: str) -> Path:
        return self.path / layout.CODE_SNAPSHOTS / digest


@dataclass(frozen=True)
class RunDir:
    """Every file of one run folder, by what it is (the module docstring says who writes each)."""

    path: Path

    @classmethod
    def of(cls, folder: str | Path) -> RunDir:
        return cls(Path(folder))

    @classmethod
    def of_adapter(cls, adapter_dir: str | Path) -> RunDir:
        """The stage folder an adapter was trained in (its summary.json says how)."""
        return cls(Path(adapter_dir).parent)

    @property
    def run_root(self) -> Path:
        """RUN_ROOT, for a folder in the plan's layout RUN_ROOT/EXP/STAGE."""
        return self.path.parent.parent

    @property
    def config(self) -> Path:
        return self.path / CONFIG

    @property
    def job(self) -> Path:
        return self.path / "job.json"

    @property
    def progress(self) -> Path:
        return self.path / "progress.json"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def completions(self) -> Path:
        """A GRPO stage's sampled completions with their rewards, a few per logging step (train/grpo.py)."""
        return self.path / "completions.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def adapter(self) -> Path:
        return self.path / ADAPTER

    def adapter_staging(self, pid: int) -> Path:
        """Where a process writes the adapter before renaming it into place (one per writer, hidden)."""
        return self.path / f".{ADAPTER}.{pid}.tmp"

    @property
    def summary(self) -> Path:
        return self.path / "summary.json"

    @property
    def split(self) -> Path:
        return self.path / "split.json"

    @property
    def lane(self) -> Path:
        return self.path / "lane.json"

    @property
    def predictions(self) -> Path:
        return self.path / "predictions.jsonl"

    @property
    def partial_predictions(self) -> Path:
        return self.path / "predictions.partial.jsonl"

    @property
    def results(self) -> Path:
        return self.path / "results.json"

    @property
    def done(self) -> Path:
        return self.path / "DONE"

    @property
    def export_done(self) -> Path:
        return self.path / "EXPORT_DONE"

    @property
    def pruned(self) -> Path:
        return self.path / "PRUNED"

    @property
    def writer_lock(self) -> Path:
        return self.path / ".writer.lock"

    @property
    def writer(self) -> Path:
        return self.path / ".writer.json"

    @property
    def tensorboard(self) -> Path:
        """tb/: the stage's TensorBoard events (train/tracking.py)."""
        return self.path / "tb"

    @property
    def wandb(self) -> Path:
        """wandb/: W&B's own folder for the stage's run (train/tracking.py)."""
        return self.path / "wandb"

    def read_progress(self) -> dict:
        return read_json(self.progress, {}, expected=dict, fields=PROGRESS_FIELDS)

    def read_summary(self) -> dict:
        return read_json(self.summary, {}, expected=dict, fields=SUMMARY_FIELDS)

    def read_results(self) -> dict:
        return read_json(self.results, {}, expected=dict, fields=RESULTS_FIELDS)

    def read_lane(self) -> dict:
        """What a packed unit's lane wrote; {} when nothing readable."""
        return read_json(self.lane, {}, expected=dict, fields=LANE_FIELDS)

    def read_pruned(self) -> dict:
        """Where and against what a pruned stage stopped; {} for a stage that was not pruned."""
        if not self.pruned.exists():
            return {}
        return read_json(self.pruned, {}, expected=dict, fields=PRUNED_FIELDS)

    def read_export_done(self) -> dict:
        """An export folder's marker; {} when absent or unreadable (the export is then redone)."""
        return read_json(self.export_done, {}, expected=dict, fields=EXPORT_DONE_FIELDS)


@dataclass(frozen=True)
class Origin:
    """Where an experiment of the run root was launched from (RUN_ROOT/EXP/origin.json, written at each
    launch that submits it): --status, --tail and --report find its config there, whatever --config-dir is."""

    file: Path
    config_dir: Path


def record_origin(experiment_dir: Path, file: Path, config_dir: Path) -> None:
    body = {"file": str(Path(file).resolve()), "config_dir": str(Path(config_dir).resolve())}
    path = Path(experiment_dir) / ORIGIN
    if read_json(path, {}, expected=dict) != body:
        write_atomic(path, json.dumps(body, indent=1) + "\n", root=Path(experiment_dir).parent)


def run_root_experiments(run_root: Path) -> dict[str, Origin | None]:
    """Every experiment the run root holds (a folder with an origin, or with a job's record in one of its
    folders), by name, with where it was launched from: None when that was not recorded (launched before
    origins were) or cannot be read (warned about)."""
    found: dict[str, Origin | None] = {}
    try:
        # Not experiments: hidden folders, and the base-model evals (`_base-*`, core/layout.py)
        folders = sorted(p for p in Path(run_root).iterdir() if p.is_dir() and p.name[0] not in "._")
    except OSError:
        return found
    for folder in folders:
        origin = folder / ORIGIN
        if origin.exists():
            record = read_json(origin, {}, expected=dict, fields={"file": str, "config_dir": str})
            has = {"file", "config_dir"} <= set(record)
            found[folder.name] = Origin(Path(record["file"]), Path(record["config_dir"])) if has else None
        elif any(RunDir(stage).job.exists() for stage in folder.iterdir() if stage.is_dir()):
            found[folder.name] = None
    return found


# done_hash of a DONE that is there but cannot be read: matches no config hash, and is not None (absent).
UNREADABLE = "(unreadable)"


def write_spec(run_dir: Path, spec: dict, code: dict | None = None) -> None:
    """The spec as YAML. The code it runs with (git commit, dirty tree, snapshot folder) heads the file as
    comments: provenance for people, invisible to every reader of the spec, so a new commit is never
    taken for a changed config (job.json holds the same facts per submission, for programs)."""
    header = "".join(f"# code.{key}: {value}\n" for key, value in (code or {}).items())
    folder = RunDir(run_dir)
    write_atomic(folder.config, header + yaml.safe_dump(spec, sort_keys=False), root=folder.run_root)


def read_spec(run_dir: Path) -> dict | None:
    path = RunDir(run_dir).config
    text = read_text(path)
    try:
        spec = yaml.safe_load(text) if text is not None else None
    except (yaml.YAMLError, RecursionError) as exc:
        warn_unreadable(path, f"not YAML ({str(exc).splitlines()[0]})")
        return None
    if spec is not None and not isinstance(spec, dict):
        warn_unreadable(path, f"holds a {type(spec).__name__}, not a spec")
        return None
    return spec


def read_lane(run_dir: Path) -> dict:
    return RunDir(run_dir).read_lane()


def done_hash(run_dir: Path) -> str | None:
    """The config hash DONE holds; None without one; UNREADABLE when DONE is there but cannot be read:
    the stage is then neither done nor run again (--status says UNKNOWN, a relaunch refuses)."""
    then = "the stage counts as neither done nor to be run until it is removed (or --force)"
    text = read_text(RunDir(run_dir).done, UNREADABLE, then)
    return (text or "").strip() or None


def foreign_done(run_dir: Path, ranks: int, has_parents: bool, config_changed: bool) -> str | None:
    """Why the DONE of a stage whose hash differs from the plan's was not written by this plan for another
    config: it cannot be read, holds no config hash, or holds a hash that nothing explains (config.yaml
    unchanged, no stage it starts from, the same number of ranks); None when something may explain it."""
    held = done_hash(run_dir)
    if held == UNREADABLE:
        return "its DONE cannot be read (see the warning above)"
    if held and not IDENTITY.fullmatch(held):
        return f"its DONE holds {held[:40]!r}, which is no config hash"
    summary = RunDir(run_dir).read_summary()
    if config_changed or has_parents or summary.get("world_size", ranks) != ranks:
        return None
    return "its DONE holds a hash this plan never wrote for this config (copied from another run, or edited by hand)"


def is_done(run_dir: Path, config_hash: str, kind: str) -> bool:
    """The one test of "this job finished with this config": its DONE holds the config hash, and an eval's
    results.json is there and readable. An eval's DONE without its results (torn by a full disk, removed by
    hand) is not trusted: the eval runs again, from the predictions it kept, instead of the report saying
    "not run yet" for ever."""
    if done_hash(run_dir) != config_hash:
        return False
    return kind != "eval" or bool(RunDir(run_dir).read_results())


def results_lost(run_dir: Path, config_hash: str, kind: str) -> bool:
    """An eval whose DONE says it finished with this config but whose results.json cannot be read."""
    return kind == "eval" and done_hash(run_dir) == config_hash and not is_done(run_dir, config_hash, kind)


def mark_done(run_dir: Path, config_hash: str) -> None:
    folder = RunDir(run_dir)
    write_atomic(folder.done, config_hash + "\n", root=folder.run_root)


def changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two resolved specs (for the --force refusal)."""
    keys = []
    for key in sorted(set(old) | set(new)):
        a, b, path = old.get(key), new.get(key), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            keys += changed_keys(a, b, path + ".")
        elif a != b:
            keys.append(path)
    return keys
