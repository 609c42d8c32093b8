"""One unit of a packed allocation, in its own process on its lane's GPU (slurm/queueing/lanes.py starts it):
`python -m slurm.queueing.unit ORDER.json` runs the same TrainStage or EvalStage a separate job would.

A stop (USR2 or TERM, from SLURM or forwarded by the lanes) checkpoints as in a separate job; the unit
then exits non-zero without a DONE and the allocation requeues: submitit's requeue handler belongs to the
allocation's process, not to this one, so TrainStage finds none here and leaves requeueing to the lanes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from slurm.planning.pack import Unit
from slurm.queueing.jobs import EvalStage, TrainStage


def main(order_file: str) -> None:
    # SLURM's USR2 reaches every process of the allocation; until the stage takes it over (training
    # checkpoints, an eval keeps its predictions), it must not kill the unit: the lanes forward it and wait.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    order = json.loads(Path(order_file).read_text(encoding="utf-8"))
    unit = Unit.of(order)
    if cpus := os.environ.get("LORA_PACK_CPUS"):
        os.sched_setaffinity(
            0, {int(c) for c in cpus.split(",")}
        )  # this lane's cores (slurm/queueing/lanes.py)
    lane, gpu = os.environ.get("LORA_PACK_LANE"), os.environ.get("CUDA_VISIBLE_DEVICES")
    print(f"{unit.id}: unit of packed job on lane {lane}, CUDA_VISIBLE_DEVICES={gpu}", flush=True)
    stage = TrainStage() if unit.kind == "train" else EvalStage()
    stage(unit.spec, unit.config_hash, order["workdir"])


if __name__ == "__main__":
    main(sys.argv[1])
