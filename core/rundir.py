"""The run folder of one job, `RUN_ROOT/EXP/STAGE/` (a training stage) or `RUN_ROOT/EXP/eval*/` (an eval):
`RunDir` names every file in it, as submitit's JobPaths names a job's, and nobody else spells them.

config.yaml    the resolved spec the job runs (the launcher, at submission)
job.json       every scheduler job id this folder ever had, oldest first, with the code it ran; while a
               submission is under way, its intent (`submitting`: the token its SLURM comment carries)
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
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from core import layout
from core.files import is_kind, read_json, read_text, warn_unreadable, write_atomic
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
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def adapter(self) -> Path:
        return self.path / ADAPTER

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
        write_atomic(path, json.dumps(body, indent=1) + "\n")


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
        elif any((stage / "job.json").exists() for stage in folder.iterdir() if stage.is_dir()):
            found[folder.name] = None
    return found


# done_hash of a DONE that is there but cannot be read: matches no config hash, and is not None (absent).
UNREADABLE = "(unreadable)"
TIME_STAMP = "%Y-%m-%dT%H:%M:%S"  # job.json's times, local


def write_spec(run_dir: Path, spec: dict, code: dict | None = None) -> None:
    """The spec as YAML. The code it runs with (git commit, dirty tree, snapshot folder) heads the file as
    comments: provenance for people, invisible to every reader of the spec, so a new commit is never
    taken for a changed config (job.json holds the same facts per submission, for programs)."""
    header = "".join(f"# code.{key}: {value}\n" for key, value in (code or {}).items())
    write_atomic(RunDir(run_dir).config, header + yaml.safe_dump(spec, sort_keys=False))


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


@dataclass(frozen=True)
class JobRecord:
    """One submission of a run folder, as job.json holds it (`jobs`, oldest first). `backend`: "slurm" or
    "local" (a record without one predates local runs: SLURM). `pack`: the job id is a packed allocation's,
    which runs this job as one of its units (lane.json). `gpus`: the devices a local job was given (SLURM
    keeps its own record, read back through sacct). `code`: the code it ran (git commit, dirty tree,
    snapshot folder). `cancelled_at`: a local job's cancellation (SLURM's is in its own record)."""

    job_id: str
    backend: str = "slurm"
    submitted_at: str | None = None
    pack: bool = False
    gpus: tuple[str, ...] | None = None
    code: dict | None = None
    cancelled_at: str | None = None

    @property
    def local(self) -> bool:
        return self.backend == "local"

    @property
    def on_slurm(self) -> bool:
        return not self.local

    @classmethod
    def from_json(cls, raw) -> JobRecord | None:
        """The record an entry of `jobs` holds; None for one that is not an object with a job id (a hand
        edit). A key of another kind is read as absent."""
        if not is_kind(raw, dict) or not is_kind(raw.get("job_id"), (str, int)):
            return None
        gpus, code = raw.get("gpus"), raw.get("code")
        return cls(
            job_id=str(raw["job_id"]),
            backend=_text(raw.get("backend")) or "slurm",
            submitted_at=_text(raw.get("submitted_at")),
            pack=raw.get("pack") is True,
            gpus=tuple(str(g) for g in gpus) if is_kind(gpus, list) else None,
            code=code if is_kind(code, dict) and code else None,
            cancelled_at=_text(raw.get("cancelled_at")),
        )

    def to_json(self) -> dict:
        """The entry as job.json has always spelt it: a key that holds nothing is left out."""
        body: dict = {"job_id": self.job_id, "backend": self.backend}
        if self.submitted_at is not None:
            body["submitted_at"] = self.submitted_at
        if self.gpus is not None:
            body["gpus"] = list(self.gpus)
        if self.pack:
            body["pack"] = True
        if self.code:
            body["code"] = self.code
        if self.cancelled_at is not None:
            body["cancelled_at"] = self.cancelled_at
        return body


@dataclass(frozen=True)
class Submission:
    """A submission under way (job.json's `submitting`, see record_intent): the token its SLURM comment
    carries, when it was written, whether it is a pack's unit, the code it runs."""

    token: str
    at: str | None = None
    pack: bool = False
    code: dict | None = None

    @classmethod
    def from_json(cls, raw) -> Submission | None:
        if not is_kind(raw, dict) or not is_kind(raw.get("token"), str):
            return None
        code = raw.get("code")
        return cls(
            token=raw["token"],
            at=_text(raw.get("at")),
            pack=raw.get("pack") is True,
            code=code if is_kind(code, dict) and code else None,
        )

    def to_json(self) -> dict:
        return {
            "token": self.token,
            "at": self.at,
            "pack": self.pack,
            **({"code": self.code} if self.code else {}),
        }


def _text(value) -> str | None:
    return value if is_kind(value, str) else None


def record_job(
    run_dir: Path,
    job_id: str,
    backend: str,
    code: dict | None = None,
    pack: bool = False,
    gpus: tuple[str, ...] | None = None,
) -> None:
    """Records a submission (JobRecord says what each argument is). The folder's submission intent is
    cleared: the job it announced is recorded. Recording the job that is already the last record adds
    nothing (a --cancel may adopt it while its launch records it)."""
    jobs = job_records(run_dir)
    record = JobRecord(
        str(job_id),
        backend,
        time.strftime(TIME_STAMP),
        pack=pack,
        gpus=tuple(gpus) if gpus is not None else None,
        code=code or None,
    )
    if not jobs or (jobs[-1].job_id, jobs[-1].backend) != (record.job_id, backend):
        jobs.append(record)
    write_jobs(run_dir, jobs)


def record_intent(
    run_dir: Path, code: dict | None = None, pack: bool = False, token: str | None = None
) -> str:
    """Before sbatch: the token the job's SLURM comment will carry (slurm/queueing/backends.py). If the launch dies or
    cannot write job.json once sbatch has queued it, the next launch (or --cancel, --status) finds the
    job in the queue by this token and records it (slurm/queueing/decisions.py adopt_unrecorded), instead of
    queueing it a second time. Raises OSError when job.json cannot be written: then nothing is queued."""
    token = token or uuid.uuid4().hex  # a pack's units share their allocation's
    intent = Submission(token, time.strftime(TIME_STAMP), pack, code or None)
    write_jobs(run_dir, job_records(run_dir), intent)
    return token


def pending_submission(run_dir: Path) -> Submission | None:
    """The intent of a submission that was never recorded (see record_intent), or None."""
    return Submission.from_json(read_json(RunDir(run_dir).job, {}, expected=dict).get("submitting"))


def forget_intent(run_dir: Path) -> None:
    """Nothing was queued under the folder's intent (sbatch failed, or never ran)."""
    if pending_submission(run_dir) is not None:
        write_jobs(run_dir, job_records(run_dir))


def write_jobs(run_dir: Path, jobs: list[JobRecord], submitting: Submission | None = None) -> None:
    body = {
        "jobs": [r.to_json() for r in jobs],
        **({"submitting": submitting.to_json()} if submitting else {}),
    }
    write_atomic(RunDir(run_dir).job, json.dumps(body, indent=1))


def mark_cancelled(run_dir: Path, job_id: str | None = None) -> None:
    """A local job leaves no scheduler record: its cancellation is noted on its job.json entry (the last
    one; with `job_id`, only if it is that job's and not noted yet)."""
    jobs = job_records(run_dir)
    if not jobs or (job_id is not None and (jobs[-1].job_id != str(job_id) or jobs[-1].cancelled_at)):
        return
    jobs[-1] = replace(jobs[-1], cancelled_at=time.strftime(TIME_STAMP))
    write_jobs(run_dir, jobs, pending_submission(run_dir))


def job_records(run_dir: Path) -> list[JobRecord]:
    """Every submission of the folder, oldest first; records without a job id (a hand edit) are left out
    and warned about."""
    path = RunDir(run_dir).job
    jobs = read_json(path, {}, expected=dict, fields={"jobs": list}).get("jobs", [])
    kept = [record for r in jobs if (record := JobRecord.from_json(r)) is not None]
    if len(kept) < len(jobs):
        warn_unreadable(
            path, f"{len(jobs) - len(kept)} of its {len(jobs)} job record(s) are not an object with a job id"
        )
    return kept


def read_lane(run_dir: Path) -> dict:
    return RunDir(run_dir).read_lane()


def current_job(run_dir: Path) -> JobRecord | None:
    jobs = job_records(run_dir)
    return jobs[-1] if jobs else None


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
    write_atomic(RunDir(run_dir).done, config_hash + "\n")


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
