"""job.json: every scheduler job a run folder had, typed. `jobs` holds each submission, oldest first
(`JobRecord`: its job id, backend, the code it ran); while a submission is under way, `submitting` holds its
intent (`Submission`: the token its SLURM comment carries). core/rundir.py's `RunDir.job` names the file;
its reader tolerates what a crash or a hand edit leaves (core/files.py)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from core.files import is_kind, read_json, warn_unreadable, write_atomic
from core.rundir import RunDir

TIME_STAMP = "%Y-%m-%dT%H:%M:%S"  # job.json's times, local


@dataclass(frozen=True)
class JobRecord:
    """One submission of a run folder, as job.json holds it (`jobs`, oldest first). `backend`: "slurm" or
    "local" (a record without one predates local runs: SLURM). `pack`: the job id is a packed allocation's,
    which runs this job as one of its units (lane.json). `gpus`: the devices a local job was given (SLURM
    keeps its own record, read back through sacct). `code`: the code it ran (git commit, dirty tree,
    snapshot folder). `cancelled_at`: a local job's cancellation, or an array task's (SLURM keeps no record
    of one cancelled before it started). `shared`:
    the job id is a shared eval's, which scores this eval folder among others (slurm/queueing/jobs.py
    SharedEvalStage)."""

    job_id: str
    backend: str = "slurm"
    submitted_at: str | None = None
    pack: bool = False
    shared: bool = False
    gpus: tuple[str, ...] | None = None
    code: dict | None = None
    cancelled_at: str | None = None

    @property
    def local(self) -> bool:
        return self.backend == "local"

    @property
    def on_slurm(self) -> bool:
        return not self.local

    @property
    def array(self) -> bool:
        """A task of a SLURM job array (`123_4`, SLURM's own spelling: a job of its own has no `_`)."""
        return self.on_slurm and "_" in self.job_id

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
            shared=raw.get("shared") is True,
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
        if self.shared:
            body["shared"] = True
        if self.code:
            body["code"] = self.code
        if self.cancelled_at is not None:
            body["cancelled_at"] = self.cancelled_at
        return body


@dataclass(frozen=True)
class Submission:
    """A submission under way (job.json's `submitting`, see record_intent): the token its SLURM comment
    carries, when it was written, whether it is a pack's unit or a shared eval's member, its task in a job
    array, the code it runs."""

    token: str
    at: str | None = None
    pack: bool = False
    code: dict | None = None
    array_task: int | None = None
    shared: bool = False

    def job_id(self, queued_as: str) -> str:
        """Its job's id, from the id squeue shows for its token (an array's tasks share one token)."""
        return queued_as if self.array_task is None else f"{queued_as.split('_')[0]}_{self.array_task}"

    @classmethod
    def from_json(cls, raw) -> Submission | None:
        if not is_kind(raw, dict) or not is_kind(raw.get("token"), str):
            return None
        code = raw.get("code")
        task = raw.get("array_task")
        return cls(
            token=raw["token"],
            at=_text(raw.get("at")),
            pack=raw.get("pack") is True,
            code=code if is_kind(code, dict) and code else None,
            array_task=task if is_kind(task, int) else None,
            shared=raw.get("shared") is True,
        )

    def to_json(self) -> dict:
        return {
            "token": self.token,
            "at": self.at,
            "pack": self.pack,
            **({"code": self.code} if self.code else {}),
            **({"array_task": self.array_task} if self.array_task is not None else {}),
            **({"shared": True} if self.shared else {}),
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
    shared: bool = False,
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
        shared=shared,
        gpus=tuple(gpus) if gpus is not None else None,
        code=code or None,
    )
    if not jobs or (jobs[-1].job_id, jobs[-1].backend) != (record.job_id, backend):
        jobs.append(record)
    write_jobs(run_dir, jobs)


def record_intent(
    run_dir: Path,
    code: dict | None = None,
    pack: bool = False,
    token: str | None = None,
    array_task: int | None = None,
    shared: bool = False,
) -> str:
    """Before sbatch: the token the job's SLURM comment will carry (slurm/queueing/backends.py). If the launch dies or
    cannot write job.json once sbatch has queued it, the next launch (or --cancel, --status) finds the
    job in the queue by this token and records it (slurm/queueing/decisions.py adopt_unrecorded), instead of
    queueing it a second time. Raises OSError when job.json cannot be written: then nothing is queued."""
    token = token or uuid.uuid4().hex  # a pack's units share their allocation's, an array's tasks theirs
    intent = Submission(token, time.strftime(TIME_STAMP), pack, code or None, array_task, shared)
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
    folder = RunDir(run_dir)
    write_atomic(folder.job, json.dumps(body, indent=1), root=folder.run_root)


def mark_cancelled(run_dir: Path, job_id: str | None = None) -> None:
    """A local job leaves no scheduler record, nor does a SLURM array task cancelled before it started: its
    cancellation is noted on its job.json entry (the last one; with `job_id`, only if it is that job's and
    not noted yet)."""
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


def current_job(run_dir: Path) -> JobRecord | None:
    jobs = job_records(run_dir)
    return jobs[-1] if jobs else None
