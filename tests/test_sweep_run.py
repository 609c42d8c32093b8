"""A sweep run for real, one YAML, locally and on the dev cluster: a report of one row per point with mean ±
std over its seeds and a marked best, a relaunch that queues nothing, and a learning rate removed from the
file listed as removed points. Locally 2 learning rates x 2 ranks x 2 seeds (eight trainings, a report of
four points over two swept keys); on the cluster 2 learning rates x 1 rank x 2 seeds (four jobs: what SLURM
adds is the queue, not the grid). Two seeds are all a mean ± sample std needs; each training is two steps
on 32 examples, scored on 16, since no assertion looks at what was learned, only at what ran and was kept."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

import launch
from tests.conftest import squeue_ids, write_cluster_yaml
from tests.helpers import first_examples, slurm_id, tiny_sql_base, wait_until

SWEEP = """\
name: sweep
inherits: _tiny-sql.yaml
adapter: {{max_trainable_percent: 40}}
data: {{train: {train}, eval: {eval}}}
train: {{epochs: 1, batch_size: 16, eval_every_epochs: 1}}
sweep:
  grid:
    train.learning_rate: [{rates}]
    adapter.rank: [{ranks}]
  seeds: [{seeds}]
  select: {{metric: eval_loss, mode: min}}
"""
SEEDS = 2
# What the local test launches and the cluster test's smaller sweep, both trained on a few examples (the
# cancel tests keep sweep_folder's defaults: twelve points on the whole demo split, queued for minutes).
LOCAL = {"ranks": "4, 8", "seeds": "1, 2", "few_examples": True}
CLUSTER = {"ranks": "4", "seeds": "1, 2", "few_examples": True}


def sweep_folder(
    tmp: Path,
    repo_root: Path,
    rates: str = "1.0e-3, 3.0e-3",
    ranks: str = "4, 8",
    seeds: str = "1, 2, 3",
    few_examples: bool = False,
) -> Path:
    """The sweep's configs under tmp; `few_examples`: trained on 32 examples (two steps of 16) and scored
    on 16 (one batch), else on the demo's easy split (85) and dev split (48)."""
    folder = tmp / "configs"
    folder.mkdir(exist_ok=True)
    write_cluster_yaml(folder, tmp, local_parallel_jobs=2)
    tiny_sql_base(folder)
    train, dev = (repo_root / "data" / "demo" / "sql" / f"{split}.jsonl" for split in ("easy", "dev"))
    if few_examples:
        train = first_examples("easy", 32, tmp / "data" / "train.jsonl")
        dev = first_examples("dev", 16, tmp / "data" / "dev.jsonl")
    (folder / "sweep.yaml").write_text(
        SWEEP.format(train=train, eval=dev, rates=rates, ranks=ranks, seeds=seeds)
    )
    return folder


def sweep_table(report: str) -> list[str]:
    section = report.split("### Sweep: sweep", 1)[1]
    return [line for line in section.splitlines() if line.startswith("| lr")]


def check_the_report_and_the_removed_points(tmp: Path, repo_root: Path, folder: Path, capsys, shape) -> None:
    ranks = len(shape["ranks"].split(","))  # two learning rates, each point trained with SEEDS seeds
    rows = sweep_table((tmp / "runs" / "report.md").read_text())
    assert len(rows) == 2 * ranks  # one row per point, its seeds collapsed
    assert all(f"{SEEDS}/{SEEDS} done" in row and "±" in row for row in rows), rows
    assert sum("✓" in row for row in rows) == 1  # the best point by eval_loss, marked once
    sweep_folder(tmp, repo_root, rates="1.0e-3", **shape)  # one learning rate removed from the file
    capsys.readouterr()
    assert launch.main(["--all", "--dry-run", "--config-dir", str(folder)]) == 0
    said = " ".join(capsys.readouterr().err.split())
    removed = re.search(r"holds (\d+) experiment\(s\) launched from this folder that it no longer has", said)
    assert removed and removed.group(1) == str(ranks * SEEDS), said
    assert "sweep-lr0.003-r4-s1" in said and "sweep-lr0.001-r4-s1" not in said
    assert launch.main(["--status"]) == 0  # from tmp: the run root holds them
    assert "also holds sweep-lr0.003-r4-s1" in " ".join(capsys.readouterr().out.split())


@pytest.mark.slow
def test_a_sweep_runs_locally_reports_mean_and_spread_and_relaunches_nothing(
    repo_root, tmp_path, tiny, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    folder = sweep_folder(tmp_path, repo_root, **LOCAL)
    (tmp_path / "configs" / "experiments").mkdir()  # the default folder of a plain --status
    assert launch.main(["--all", "--config-dir", str(folder), "--backend", "local"]) == 0
    assert "All 8 job(s) completed" in capsys.readouterr().out
    assert launch.main(["--all", "--config-dir", str(folder), "--backend", "local"]) == 0
    assert "Nothing to submit" in capsys.readouterr().out
    check_the_report_and_the_removed_points(tmp_path, repo_root, folder, capsys, LOCAL)


def test_a_sweep_runs_on_the_cluster_and_a_relaunch_queues_nothing(
    repo_root, tmp_path, tiny, slurm_cluster, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    folder = sweep_folder(tmp_path, repo_root, **CLUSTER)
    (tmp_path / "configs" / "experiments").mkdir()
    argv = ["--all", "--config-dir", str(folder), "--backend", "slurm", "--no-preflight"]
    assert launch.main([*argv, "--wait"]) == 0
    assert (
        "Submitted 4 job(s) in 1 submission(s): 1 job array(s), 0 shared eval(s)" in capsys.readouterr().out
    )
    array = array_tasks(tmp_path)
    assert sorted(array.values()) == [f"{array_id(array)}_{i}" for i in range(4)]
    # sacct keeps one record per task (its state may still read RUNNING while the task completes)
    assert sorted(accounted(array_id(array))) == sorted(array.values())
    leaving = squeue_ids(under=tmp_path)  # ended, perhaps still COMPLETING when --wait returns
    assert launch.main(argv) == 0
    assert "Nothing to submit" in capsys.readouterr().out and squeue_ids(under=tmp_path) <= leaving
    assert launch.main(["--report", "--config-dir", str(folder)]) == 0
    check_the_report_and_the_removed_points(tmp_path, repo_root, folder, capsys, CLUSTER)
    # The sweep edited: a rate added. Its two new points are a new array; the others are not touched.
    sweep_folder(tmp_path, repo_root, rates="1.0e-3, 3.0e-3, 5.0e-3", **CLUSTER)
    assert launch.main([*argv, "--wait"]) == 0
    assert (
        "Submitted 2 job(s) in 1 submission(s): 1 job array(s), 0 shared eval(s)" in capsys.readouterr().out
    )
    grown = array_tasks(tmp_path)
    added = {point: task for point, task in grown.items() if point not in array}
    assert sorted(added) == ["sweep-lr0.005-r4-s1", "sweep-lr0.005-r4-s2"]
    assert array_id(added) != array_id(array) and {p: grown[p] for p in array} == array


def array_tasks(tmp: Path) -> dict[str, str]:
    """Each point's recorded SLURM job: its array task (`123_4`)."""
    return {
        job.parent.parent.name: json.loads(job.read_text())["jobs"][-1]["job_id"]
        for job in (tmp / "runs").glob("sweep-*/train/job.json")
    }


def array_id(tasks: dict[str, str]) -> str:
    (found,) = {task.split("_")[0] for task in tasks.values()}  # one array
    return found


def accounted(job_id: str) -> dict[str, str]:
    """sacct's JobID → State for every task of the array `job_id`."""
    text = subprocess.run(
        ["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,State"], capture_output=True, text=True
    ).stdout
    return dict(line.split("|", 1) for line in text.splitlines() if line.strip())


def test_cancel_removed_stops_the_queued_points_a_sweep_no_longer_has_and_only_those(
    repo_root, tmp_path, tiny, slurm_cluster, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    folder = sweep_folder(tmp_path, repo_root)
    long = ["train.epochs=500", "--backend", "slurm", "--no-preflight"]  # queued or running for minutes
    try:
        assert launch.main(["--all", "--config-dir", str(folder), *long]) == 0
        queued = squeue_ids(under=tmp_path)
        assert len(queued) == 12
        sweep_folder(tmp_path, repo_root, rates="1.0e-3")
        capsys.readouterr()
        assert launch.main(["--cancel", "--removed", "--config-dir", str(folder)]) == 0
        said = " ".join(capsys.readouterr().out.split())
        assert "Cancelled 6 job(s) of experiments no config folder has any more" in said
        assert "sweep-lr0.003-r8-s3/train" in said and "sweep-lr0.001" not in said
        # Cancelled jobs leave the queue a moment after scancel (CANCELLED, then gone).
        wait_until(
            lambda: len(squeue_ids(under=tmp_path)) == 6, "the 6 cancelled jobs to leave the queue", 60
        )
        assert squeue_ids(under=tmp_path) < queued
        # The points are tasks of one array: cancelling one point, then retrying it, touches that task alone.
        tasks = array_tasks(tmp_path)
        assert len({task.split("_")[0] for task in tasks.values()}) == 1
        assert launch.main(["--cancel", "--exp", "sweep-lr0.001-r4-s1", "--config-dir", str(folder)]) == 0
        wait_until(lambda: len(squeue_ids(under=tmp_path)) == 5, "the cancelled task to leave the queue", 60)
        assert squeue_ids(under=tmp_path) == queued - {tasks[p] for p in tasks if "lr0.003" in p} - {
            tasks["sweep-lr0.001-r4-s1"]
        }
        capsys.readouterr()
        retry = ["--all", "--retry-failed", "--config-dir", str(folder), *long]
        assert launch.main(retry) == 0
        assert "Submitted 1 job(s)" in capsys.readouterr().out
        again = array_tasks(tmp_path)
        assert again["sweep-lr0.001-r4-s1"] != tasks["sweep-lr0.001-r4-s1"]
        assert {p: t for p, t in again.items() if p != "sweep-lr0.001-r4-s1"} == {
            p: t for p, t in tasks.items() if p != "sweep-lr0.001-r4-s1"
        }
    finally:
        launch.main(["--cancel", "--all", "--config-dir", str(folder), "train.epochs=500"])


def test_cancel_removed_cancels_nothing_a_broken_or_moved_config_still_holds(
    repo_root, tmp_path, tiny, slurm_cluster, monkeypatch, capsys
):
    """Issue 31, rule 2. Before: a typo in the running sweep's file made all twelve points 'gone' (a file
    that does not load gives its name, never its points'), and after `mv configs moved` a --cancel --removed
    --config-dir moved cancelled the folder's own jobs (gone was decided from origin.json's path alone)."""
    monkeypatch.chdir(tmp_path)
    folder = sweep_folder(tmp_path, repo_root)
    long = ["train.epochs=500", "--backend", "slurm", "--no-preflight"]  # queued or running for minutes
    moved = tmp_path / "moved"
    try:
        assert launch.main(["--all", "--config-dir", str(folder), *long]) == 0
        queued = squeue_ids(under=tmp_path)
        assert len(queued) == 12
        sweep = folder / "sweep.yaml"
        sweep.write_text(
            sweep.read_text().replace("adapter.rank:", "adapter.rnak:")
        )  # a typo: it no longer loads
        capsys.readouterr()
        assert launch.main(["--cancel", "--removed", "--config-dir", str(folder)]) == 0
        assert "Cancelled 0 job(s)" in " ".join(capsys.readouterr().out.split())
        sweep.write_text(sweep.read_text().replace("adapter.rnak:", "adapter.rank:"))
        folder.rename(moved)
        assert launch.main(["--cancel", "--removed", "--config-dir", str(moved)]) == 0
        assert "Cancelled 0 job(s)" in " ".join(capsys.readouterr().out.split())
        assert squeue_ids(under=tmp_path) == queued
    finally:
        for where in (folder, moved):
            if where.is_dir():
                launch.main(["--cancel", "--all", "--config-dir", str(where), "train.epochs=500"])


SHARED = """\
name: sweep
inherits: _tiny-sql.yaml
data: {{train: {train}, eval: {eval}}}
train: {{batch_size: 16}}
eval: {{metrics: [exact_match], baseline: true, max_new_tokens: 8}}
sweep:
  grid:
    train.epochs: [1, 400]
    train.learning_rate: [1.0e-3, 2.0e-3]
"""


def test_a_sweeps_evals_are_one_shared_job_that_scores_each_trained_point_and_not_a_cancelled_one(
    repo_root, tmp_path, tiny, slurm_cluster, monkeypatch, capsys
):
    """Issue 50, item 2 on the cluster: four points and their base row are scored by one eval job after
    every training ended (two trained, two cancelled), each into its own eval folder; the cancelled points
    are BLOCKED "not scored", and --cancel --exp of a point leaves the shared job to the others."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "configs"
    folder.mkdir()
    write_cluster_yaml(folder, tmp_path)
    tiny_sql_base(folder)
    train = first_examples("easy", 32, tmp_path / "data" / "train.jsonl")
    dev = first_examples("dev", 8, tmp_path / "data" / "dev.jsonl")
    (folder / "sweep.yaml").write_text(SHARED.format(train=train, eval=dev))
    argv = ["--all", "--config-dir", str(folder), "--backend", "slurm", "--no-preflight"]
    assert launch.main(argv) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "Submitted 9 job(s) in 2 submission(s): 1 job array(s), 1 shared eval(s)" in said
    long_points = ["sweep-ep400-lr0.001", "sweep-ep400-lr0.002"]
    for point in long_points:  # the long trainings cancelled: the shared eval stays for the others
        assert launch.main(["--cancel", "--exp", point, "--config-dir", str(folder)]) == 0
        assert f"{point}/eval is scored by a shared eval with other points: left queued" in " ".join(
            capsys.readouterr().out.split()
        )
    runs = tmp_path / "runs"
    shared = {slurm_id(tmp_path, f"{point}/eval") for point in array_points(runs)}
    assert len(shared) == 1  # one eval job for every point

    def rows_once_ended() -> dict[str, str] | None:
        """--status's rows, once no row is live (sacct may say RUNNING a moment after squeue lost it)."""
        capsys.readouterr()
        assert launch.main(["--status", "--exp", "sweep", "--config-dir", str(folder)]) == 0
        lines = [line for line in capsys.readouterr().out.splitlines() if "│" in line]
        live = any(state in line for line in lines for state in ("RUNNING", "PENDING", "COMPLETING"))
        return None if live else {line.split("│")[1].strip(): line for line in lines}

    rows = wait_until(rows_once_ended, "the shared eval to end", 300)
    for point in ("sweep-ep1-lr0.001", "sweep-ep1-lr0.002"):
        results = json.loads((runs / point / "eval" / "results.json").read_text())
        assert "exact_match" in results and (runs / point / "eval" / "DONE").exists()
    for point in long_points:
        assert not (runs / point / "eval" / "DONE").exists()
        assert "BLOCKED" in rows[f"{point}/eval"] and "not scored" in rows[f"{point}/eval"], rows
    (base,) = [p for p in runs.iterdir() if p.name.startswith("_base-")]
    assert json.loads((base / "eval" / "job.json").read_text())["jobs"][-1]["job_id"] in shared
    assert (base / "eval" / "DONE").exists()


def array_points(runs: Path) -> list[str]:
    return sorted(p.name for p in runs.glob("sweep-*") if (p / "eval" / "job.json").exists())
