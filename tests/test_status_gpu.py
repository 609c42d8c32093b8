"""`--status`'s GPU columns: read from progress.json (as the trainer writes it), shown for running jobs only,
blank where a job has no GPU samples. No cluster needed: the scheduler's answer is given."""

from __future__ import annotations

import json
from pathlib import Path

from core.job_records import JobRecord
from core.states import State
from slurm.watching.status import SchedulerInfo, job_status
from tests.helpers import first_stages, rendered_status


def test_running_jobs_show_gpu_use_from_progress_and_others_stay_blank(tmp_path):
    on_gpu, on_cpu, finished = first_stages(tmp_path, ["on-gpu", "on-cpu", "finished"])
    gpu_progress = {"step": 5, "total_steps": 10, "gpu_util_percent": 87.4, "gpu_mem_gb": 41.23}
    gpu_progress["gpu_mem_total_gb"] = 85.52
    for job, progress in ((on_gpu, gpu_progress), (on_cpu, {"step": 5, "total_steps": 10})):
        Path(job.run_dir).mkdir(parents=True)
        (Path(job.run_dir) / "progress.json").write_text(json.dumps(progress))
    Path(finished.run_dir).mkdir(parents=True)
    (Path(finished.run_dir) / "progress.json").write_text(json.dumps(gpu_progress))
    scheduler = {
        "1": SchedulerInfo(State.RUNNING),
        "2": SchedulerInfo(State.RUNNING),
        "3": SchedulerInfo(State.FAILED),
    }
    rows = [
        job_status(job, JobRecord(job_id, "slurm"), scheduler, {}, str(tmp_path / "logs"))
        for job, job_id in ((on_gpu, "1"), (on_cpu, "2"), (finished, "3"))
    ]
    assert (rows[0].gpu_util_percent, rows[0].gpu_mem_gb, rows[1].gpu_util_percent) == (87.4, 41.23, None)
    lines = {line.split("│")[1].strip(): line for line in rendered_status(rows).splitlines() if "│" in line}
    assert "87%" in lines["on-gpu/train"] and "41.2/85.5 GB" in lines["on-gpu/train"]
    assert "%" not in lines["on-cpu/train"] and "GB" not in lines["on-cpu/train"]
    assert "%" not in lines["finished/train"]  # a job that ended: its last samples are no longer news
    assert "gpu mem" in rendered_status(rows)
