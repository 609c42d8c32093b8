"""The run directory of one job, `runs/EXP/STAGE/`: what the launcher writes and reads there.

config.yaml    the resolved spec the job runs (written at submission)
job.json       every scheduler job id this folder ever had, oldest first, with the code it ran
progress.json  step / total / loss / ETA / GPU use, rewritten by the trainer while it runs
lane.json      for a unit of a packed allocation: its lane, GPU and how it ended (slurm/lanes.py)
DONE           the config hash, written last: a stage with a matching DONE never runs again
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from train.files import read_json, write_atomic


def write_spec(run_dir: Path, spec: dict, code: dict | None = None) -> None:
    """The spec as YAML. The code it runs with (git commit, dirty tree, snapshot folder) heads the file as
    comments: provenance for people, invisible to every reader of the spec, so a new commit is never
    taken for a changed config (job.json holds the same facts per submission, for programs)."""
    header = "".join(f"# code.{key}: {value}\n" for key, value in (code or {}).items())
    write_atomic(run_dir / "config.yaml", header + yaml.safe_dump(spec, sort_keys=False))


def read_spec(run_dir: Path) -> dict | None:
    try:
        return yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None


def record_job(
    run_dir: Path,
    job_id: str,
    backend: str,
    code: dict | None = None,
    pack: bool = False,
    gpus: tuple[str, ...] | None = None,
) -> None:
    """`pack`: the job id is a packed allocation's, which runs this job as one of its units (lane.json).
    `gpus`: the devices a local job was given (SLURM keeps its own record, read back through sacct)."""
    jobs = job_records(run_dir)
    now = time.strftime("%Y-%m-%dT%H:%M:%S")
    record = {"job_id": job_id, "backend": backend, "submitted_at": now}
    if gpus is not None:
        record["gpus"] = list(gpus)
    jobs.append({**record, **({"pack": True} if pack else {}), **({"code": code} if code else {})})
    write_atomic(run_dir / "job.json", json.dumps({"jobs": jobs}, indent=1))


def mark_cancelled(run_dir: Path) -> None:
    """A local job leaves no scheduler record: its cancellation is noted on its job.json entry."""
    jobs = job_records(run_dir)
    if jobs:
        jobs[-1]["cancelled_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        write_atomic(run_dir / "job.json", json.dumps({"jobs": jobs}, indent=1))


def job_records(run_dir: Path) -> list[dict]:
    return read_json(run_dir / "job.json", {}).get("jobs", [])


def current_job(run_dir: Path) -> dict | None:
    jobs = job_records(run_dir)
    return jobs[-1] if jobs else None


def done_hash(run_dir: Path) -> str | None:
    try:
        return (run_dir / "DONE").read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def mark_done(run_dir: Path, config_hash: str) -> None:
    write_atomic(run_dir / "DONE", config_hash + "\n")


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
