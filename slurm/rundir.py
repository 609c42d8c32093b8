"""The run directory of one job, `runs/EXP/STAGE/`: what the launcher writes and reads there.

config.yaml    the resolved spec the job runs (written at submission)
job.json       every scheduler job id this folder ever had, oldest first
progress.json  step / total / loss / ETA, rewritten by the trainer while it runs
DONE           the config hash, written last: a stage with a matching DONE never runs again
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import yaml


def write_atomic(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_json(path: Path, default=None):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return default


def write_spec(run_dir: Path, spec: dict) -> None:
    write_atomic(run_dir / "config.yaml", yaml.safe_dump(spec, sort_keys=False))


def read_spec(run_dir: Path) -> dict | None:
    try:
        return yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None


def record_job(run_dir: Path, job_id: str, backend: str) -> None:
    jobs = job_records(run_dir)
    jobs.append({"job_id": job_id, "backend": backend, "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
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
