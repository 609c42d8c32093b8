"""`--status`'s nodes column (issue 39): the nodes a SLURM job holds or held, as squeue/sacct name them
(`n[1-2]`), blank while it waits and for a local job (it runs on this machine; its record names no host).
No cluster needed: the scheduler's answer is given, as tests/test_status_gpu.py gives it."""

from __future__ import annotations

import json
from pathlib import Path

from core.job_records import JobRecord
from core.states import State
from slurm.watching.render import STATUS_PRIORITY, status_table
from slurm.watching.status import SchedulerInfo, job_status, packed_unit_info
from tests.helpers import first_stages, rendered_status


def rows_of(tmp_path: Path, answers: dict[str, tuple[str, SchedulerInfo | None]]):
    """One row per experiment: `answers` maps its name to its job id and the scheduler's answer (None: a
    local job with that pid, which no scheduler answers for)."""
    jobs = first_stages(tmp_path, list(answers))
    scheduler = {job_id: info for job_id, info in answers.values() if info is not None}
    rows = []
    for job, (job_id, info) in zip(jobs, answers.values(), strict=True):
        record = JobRecord(job_id, "slurm" if info is not None else "local")
        rows.append(job_status(job, record, scheduler, {}, str(tmp_path / "logs")))
    return rows


def test_status_names_the_nodes_a_two_node_job_holds(tmp_path):
    rows = rows_of(
        tmp_path,
        {
            "two-nodes": ("11", SchedulerInfo(State.RUNNING, nodes="n[1-2]")),
            "ended": ("12", SchedulerInfo(State.FAILED, exit_code="1:0", nodes="vm")),
            "waiting": ("13", SchedulerInfo(State.PENDING, "Resources")),
            # requeued: waiting to start again, its last nodes are not where it will run
            "requeued": ("14", SchedulerInfo(State.PENDING, "BeginTime", nodes="n1")),
            "local": ("999999999", None),  # a pid no process has: an ended local job
        },
    )
    nodes = {row.job.experiment: row.nodes for row in rows}
    assert nodes == {"two-nodes": "n[1-2]", "ended": "vm", "waiting": "", "requeued": "", "local": ""}
    text = rendered_status(rows)
    header = next(line for line in text.splitlines() if "slurm id" in line)
    assert [cell.strip() for cell in header.split("┃")[1:-1]][4:6] == ["elapsed", "nodes"]
    lines = {line.split("│")[1].strip(): line for line in text.splitlines() if "│" in line}
    assert "n[1-2]" in lines["two-nodes/train"] and "vm" in lines["ended/train"]
    assert "n1" not in lines["requeued/train"]


def test_a_narrow_terminal_leaves_out_the_gpu_readings_before_the_nodes_and_the_nodes_before_elapsed(
    tmp_path,
):
    rows = rows_of(tmp_path, {"two-nodes": ("11", SchedulerInfo(State.RUNNING, "", "1:02", nodes="n[1-2]"))})
    order = list(STATUS_PRIORITY)
    assert order.index("elapsed") < order.index("nodes") < order.index("gpu")
    dropped_at = {}
    for width in range(200, 20, -1):
        kept = {str(column.header) for column in status_table(rows, width).columns}
        for name in set(order) - kept:
            dropped_at.setdefault(name, width)
    assert dropped_at["micro"] >= dropped_at["gpu"] >= dropped_at["nodes"] >= dropped_at["elapsed"]
    assert dropped_at["nodes"] > dropped_at["elapsed"]  # at some width the nodes are gone, elapsed kept


def test_a_packed_unit_shows_its_allocations_nodes_once_a_lane_took_it(tmp_path):
    run_dir = tmp_path / "unit"
    run_dir.mkdir()
    pack = SchedulerInfo(State.RUNNING, nodes="n1")
    assert packed_unit_info(run_dir, "9", pack).nodes == ""  # no lane yet: waits inside the allocation
    (run_dir / "lane.json").write_text(
        json.dumps({"pack_job": "9", "lane": 0, "gpu": "0", "state": "RUNNING"})
    )
    assert packed_unit_info(run_dir, "9", pack) == SchedulerInfo(
        State.RUNNING, "lane 0 (GPU 0) of packed job 9", nodes="n1"
    )
    ended = SchedulerInfo(State.CANCELLED, exit_code="0:15", nodes="n1")
    assert packed_unit_info(run_dir, "9", ended).nodes == "n1"  # it ran there before the cancel


def test_a_status_of_local_jobs_heads_their_ids_pid_not_slurm_id(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    local = rows_of(tmp_path / "a", {"here": ("999999999", None)})
    mixed = rows_of(
        tmp_path / "b", {"here": ("999999999", None), "queued": ("11", SchedulerInfo(State.PENDING))}
    )
    assert [str(c.header) for c in status_table(local).columns][1] == "pid"
    assert [str(c.header) for c in status_table(mixed).columns][1] == "slurm id"
