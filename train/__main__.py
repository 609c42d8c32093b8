"""`python -m train JOB.yaml`: run one stage by hand from a resolved TrainJob (YAML or JSON, e.g. a run
folder's job.json). Ctrl-C or SIGTERM checkpoints at the next step end, like SLURM's signal does; running
the same command again resumes from there. It holds the stage folder as a job does (core/writer_lock.py):
refused, naming the holder, while another trainer writes there."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path

import yaml


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m train path/to/job.yaml", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from core.config import TrainJob
    from core.writer_lock import FolderHeld, hold_folder
    from train.libraries import hide, unused_libraries

    spec = yaml.safe_load(Path(argv[0]).read_text())
    hide(unused_libraries(spec))  # before peft is imported (train/libraries.py)
    job = TrainJob.model_validate(spec)
    try:
        with hold_folder(Path(job.run_dir)):  # before torch loads: a refusal comes at once
            outcome = train(job)
    except FolderHeld as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(outcome)
    return 3 if outcome == "interrupted" else 0  # a pruned run ended as it should


def train(job) -> str:
    from train.stage import run_stage

    stop = threading.Event()
    previous = {
        signum: signal.signal(signum, lambda *_: stop.set()) for signum in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        return run_stage(job, stop)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
