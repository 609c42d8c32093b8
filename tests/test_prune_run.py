"""A pruned sweep run for real on the tiny model (issue 33): six learning rates, the three hopeless ones
(1e-9) last, judged at epoch 1 of 2 with keep 0.5 and min_points 3. The hopeless runs stop at rung 1
(PRUNED, their best checkpoint saved as their adapter), the others train to the end; --status shows PRUNED
with its rung; a relaunch queues nothing. The local runs train on 32 examples (two steps an epoch) and score on
16: the rung needs the good rates' eval_loss below the hopeless ones', not a model that learned much."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

import launch
from core.config import PruneJob
from core.job_records import current_job, record_job
from core.pruning import judged, rung_records
from core.rundir import RunDir
from tests.conftest import squeue_ids, write_cluster_yaml
from tests.helpers import first_examples, plan_for, slurm_id, tiny_sql_base, wait_until
from tests.train_helpers import make_job, sql_data
from train.recipe import run_stage

PRUNED_SWEEP = """\
name: asha
inherits: _tiny-sql.yaml
adapter: {{max_trainable_percent: 40}}
data: {{train: {train}, eval: {eval}}}
train: {{epochs: 2, batch_size: 16, eval_every_epochs: 1}}
sweep:
  grid:
    train.learning_rate: [3.0e-3, 5.0e-3, 8.0e-3, 1.0e-9, 1.1e-9, 1.2e-9]
  prune: {{rungs: [1], keep: 0.5, min_points: 3}}
  select: {{metric: eval_loss, mode: min}}
"""
GOOD = ["asha-lr0.003", "asha-lr0.005", "asha-lr0.008"]
HOPELESS = ["asha-lr1e-09", "asha-lr1.1e-09", "asha-lr1.2e-09"]


def pruned_sweep_folder(
    tmp: Path, repo_root: Path, parallel: int, resources: str = "", few_examples: bool = False
) -> Path:
    """The sweep's configs under tmp; `resources`: its `resources:` block, where a test sets one;
    `few_examples`: trained on 32 examples (two steps of 16 an epoch) and scored on 16 (one batch), else
    on the demo's easy split (85) and dev split (48)."""
    folder = tmp / "configs"
    folder.mkdir(exist_ok=True)
    write_cluster_yaml(folder, tmp, local_parallel_jobs=parallel)
    tiny_sql_base(folder)
    extra = f"resources: {resources}\n" if resources else ""
    train, dev = (repo_root / "data" / "demo" / "sql" / f"{split}.jsonl" for split in ("easy", "dev"))
    if few_examples:
        train = first_examples("easy", 32, tmp / "data" / "train.jsonl")
        dev = first_examples("dev", 16, tmp / "data" / "dev.jsonl")
    (folder / "asha.yaml").write_text(PRUNED_SWEEP.format(train=train, eval=dev) + extra)
    return folder


def check_the_report_shows_the_pruning_and_picks_a_completed_point(runs: Path) -> None:
    report = (runs / "report.md").read_text()
    section = report.split("### Sweep: asha", 1)[1]
    assert "Pruning (asynchronous successive halving: rungs 1, keep 0.5, min_points 3" in section
    runs_table = [line for line in section.splitlines() if line.startswith("| asha-")]
    assert sum("at rung 1 (" in line and "> cutoff" in line for line in runs_table) == 3, runs_table
    saved = re.search(r"pruning saved ~\S+ GPU-hours \(~([0-9.e+-]+) training minutes\)", section)
    assert saved and float(saved.group(1)) > 0, section  # each pruned run ran 1 of its 2 epochs
    best = next(line for line in section.splitlines() if "✓" in line)
    assert any(f"| {name.removeprefix('asha-')} |" in best for name in GOOD), best  # never a pruned point
    assert sum("1/1 done" in line for line in section.splitlines()) == 3


def job_log(runs: Path, job: str) -> str:
    """The log of a job's last submission, where its record says it is (an array task's: the arrays')."""
    from slurm.cluster.scheduler import scheduler_job

    record = current_job(runs / job)
    return scheduler_job(str(runs.parent / "logs"), job, record, runs / job).paths.stdout.read_text()


def check_the_hopeless_runs_were_pruned_at_rung_1(runs: Path) -> None:
    records = {r.run: r for r in rung_records(runs, "asha", 1)}
    assert set(records) == set(GOOD + HOPELESS), records
    whole = RunDir(runs / GOOD[0] / "train").read_summary()["global_step"]  # two epochs' steps
    for name in HOPELESS:
        stage = RunDir(runs / name / "train")
        pruned = stage.read_pruned()
        assert pruned.get("rung") == 1 and pruned["eval_loss"] > pruned["cutoff"], (name, records)
        assert stage.read_summary()["global_step"] * 2 == whole  # stopped at the end of epoch 1 of 2
        assert stage.done.is_file() and (stage.adapter / "adapter_config.json").is_file()
    for name in GOOD:
        stage = RunDir(runs / name / "train")
        assert not stage.pruned.exists(), (name, records[name])
        assert json.loads(stage.summary.read_text())["epochs_done"] == 2
    for name in GOOD + HOPELESS:  # each run's job log says what its rung decided, and from what
        log = job_log(runs, f"{name}/train")
        verdict = ": stop" if name in HOPELESS else ": go on"
        assert "pruning, rung 1: eval_loss" in log and verdict in log, (name, log[-2000:])


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [1, 2])
def test_a_pruned_sweep_stops_its_hopeless_rates_at_rung_1_and_a_relaunch_queues_nothing(
    repo_root, tmp_path, tiny, monkeypatch, capsys, parallel
):
    monkeypatch.chdir(tmp_path)
    folder = pruned_sweep_folder(tmp_path, repo_root, parallel, few_examples=True)
    assert launch.main(["--all", "--config-dir", str(folder), "--backend", "local"]) == 0
    capsys.readouterr()
    check_the_hopeless_runs_were_pruned_at_rung_1(tmp_path / "runs")
    check_the_report_shows_the_pruning_and_picks_a_completed_point(tmp_path / "runs")
    assert launch.main(["--all", "--config-dir", str(folder), "--backend", "local"]) == 0
    assert "Nothing to submit" in capsys.readouterr().out
    check_the_status_shows_the_sweep_and_on_exp_each_pruned_run(folder, capsys)


def check_the_status_shows_the_sweep_and_on_exp_each_pruned_run(folder: Path, capsys) -> None:
    """The sweep is one row of --status (its runs by state); --exp asha shows each run, a pruned one with
    its rung, eval_loss and cutoff."""
    assert launch.main(["--status", "--config-dir", str(folder)]) == 0
    status = " ".join(capsys.readouterr().out.split())
    assert "sweep asha: 6 points" in status and "3 PRUNED" in status and "all done" in status, status
    assert launch.main(["--status", "--exp", "asha", "--config-dir", str(folder)]) == 0
    status = " ".join(capsys.readouterr().out.split())
    assert status.count("PRUNED") >= 3 and "at rung 1: eval_loss" in status, status


def launch_on_slurm(folder: Path, *extra: str) -> int:
    return launch.main(["--all", "--config-dir", str(folder), "--backend", "slurm", "--no-preflight", *extra])


def test_a_pruned_sweep_on_the_cluster_stops_its_hopeless_rates_and_a_relaunch_queues_nothing(
    repo_root, tmp_path, tiny, slurm_cluster, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    # Two jobs at a time on the node's 8 CPUs, started in submission order: the hopeless rates come last,
    # as they do locally (all six at once would reach the rung in any order: asynchronous, early runs go on).
    folder = pruned_sweep_folder(tmp_path, repo_root, 2, "{cpus: 4}")
    assert launch_on_slurm(folder, "--wait") == 0
    assert "Submitted 6 job(s)" in capsys.readouterr().out
    check_the_hopeless_runs_were_pruned_at_rung_1(tmp_path / "runs")
    leaving = squeue_ids(under=tmp_path)  # ended, perhaps still COMPLETING when --wait returns
    assert launch_on_slurm(folder) == 0
    assert "Nothing to submit" in capsys.readouterr().out and squeue_ids(under=tmp_path) <= leaving
    check_the_status_shows_the_sweep_and_on_exp_each_pruned_run(folder, capsys)
    assert launch.main(["--report", "--config-dir", str(folder)]) == 0
    check_the_report_shows_the_pruning_and_picks_a_completed_point(tmp_path / "runs")


def test_in_a_pack_a_pruned_unit_frees_its_lane_for_the_next_unit(
    repo_root, tmp_path, tiny, slurm_cluster, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    folder = pruned_sweep_folder(tmp_path, repo_root, 2, "{gpus: 1, cpus: 1, mem_gb: 2}")
    assert launch_on_slurm(folder, "--pack", "2", "--budget", "00:30:00", "--wait") == 0
    runs = tmp_path / "runs"
    # --wait ends when every unit's DONE is there; the lanes write each unit's end when they reap it.
    pack_id = slurm_id(tmp_path, f"{GOOD[0]}/train")
    wait_until(lambda: pack_id not in squeue_ids(tmp_path), "the packed job to end", 120)
    check_the_hopeless_runs_were_pruned_at_rung_1(runs)
    lanes = {name: json.loads((runs / name / "train" / "lane.json").read_text()) for name in GOOD + HOPELESS}
    assert {name: lane["state"] for name, lane in lanes.items()} == {
        **dict.fromkeys(GOOD, "COMPLETED"),
        **dict.fromkeys(HOPELESS, "PRUNED"),
    }
    # Each lane ran its units one after another; a unit pruned before the lane's last was followed at
    # once by the next, which started after it ended (two lanes, six units: three each).
    by_lane: dict[int, list[dict]] = {}
    for lane in lanes.values():
        by_lane.setdefault(lane["lane"], []).append(lane)
    assert sorted(len(units) for units in by_lane.values()) == [3, 3]
    for units in by_lane.values():
        units.sort(key=lambda lane: lane["started_s"])
        for before, after in zip(units, units[1:], strict=False):
            assert after["started_s"] >= before["ended_s"]
    assert launch_on_slurm(folder, "--pack", "2", "--budget", "00:30:00") == 0
    assert "Nothing to submit" in capsys.readouterr().out


# The trainer's side, on one run: a requeue after its decision never decides again; a fresh folder does.
PRUNE = {"rungs": [1], "keep": 0.5, "min_points": 3, "sweep": "sw"}


def pruned_job(tiny, run_dir: Path):
    # 85 examples / 8 = 11 steps an epoch, two epochs; judged at the eval of epoch 1 (step 11).
    job = make_job(
        tiny, run_dir, data=sql_data("easy", eval_split="dev"), max_steps=None, epochs=2, eval_every_epochs=1
    )
    return job.model_copy(update={"prune": PruneJob.model_validate(PRUNE)})


def record_others(
    run_root: Path, losses: list[float], prefix: str, sweep: str = "sw", measured_under: str = ""
) -> None:
    """Rung records of other runs; a launched sweep's decisions count only rows of its own definition
    (`measured_under`, which its plan gives each point)."""
    spec = PruneJob.model_validate({**PRUNE, "measured_under": measured_under})
    for index, loss in enumerate(losses):
        judged(run_root, sweep, f"{prefix}{index}", "h", 1, loss, spec)


@pytest.mark.slow
def test_a_run_requeued_after_it_was_pruned_stops_again_without_deciding_and_a_fresh_folder_decides_anew(
    tiny, tmp_path
):
    run_root, stage = tmp_path / "runs", tmp_path / "runs" / "t" / "s"
    stage.mkdir(parents=True)
    record_job(stage, "101", "local")
    record_others(run_root, [0.1, 0.1, 0.1], "low")  # every earlier run far better: this one stops
    assert run_stage(pruned_job(tiny, stage)) == "pruned"
    note = RunDir(stage).read_pruned()
    assert note["rung"] == 1 and note["points"] == 4 and note["cutoff"] == pytest.approx(0.1)
    assert RunDir(stage).read_summary()["global_step"] == 11
    # Killed after its rung's checkpoint was committed, before its adapter was written: the requeue resumes
    # at step 11. Records made since would let it go on, were it judged again; it is not.
    shutil.rmtree(RunDir(stage).adapter)
    RunDir(stage).summary.unlink()
    record_others(run_root, [100.0] * 5, "high")
    assert run_stage(pruned_job(tiny, stage)) == "pruned"
    assert RunDir(stage).read_summary()["global_step"] <= 12  # the step under way, at most, then stopped
    assert (RunDir(stage).adapter / "adapter_config.json").is_file()
    assert [r.run for r in rung_records(run_root, "sw", 1)].count("t") == 1
    # --force moves the folder aside and submits anew: a new run in a fresh folder, judged afresh.
    stage.rename(tmp_path / "runs" / "t" / "s.old")
    stage.mkdir()
    record_job(stage, "202", "local")
    assert run_stage(pruned_job(tiny, stage)) == "completed"
    mine = [r for r in rung_records(run_root, "sw", 1) if r.run == "t"]
    assert len(mine) == 2 and mine[-1].stop is False and not RunDir(stage).pruned.exists()


EVALUATED = """\
name: {name}
inherits: _tiny-sql.yaml
data: {{eval: {root}/data/demo/sql/dev.jsonl}}
train: {{epochs: 2, batch_size: 16, eval_every_epochs: 1}}
eval: {{metrics: [exact_match], max_new_tokens: 8}}
sweep:
  grid: {{train.learning_rate: [1.0e-9]}}
  prune: {{rungs: [1], keep: 0.5, eval_pruned: {evaluate}}}
"""


@pytest.mark.slow
def test_a_pruned_runs_eval_runs_on_its_best_checkpoint_unless_eval_pruned_is_false(
    repo_root, tmp_path, tiny, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    folder = pruned_sweep_folder(tmp_path, repo_root, 2)
    (folder / "asha.yaml").unlink()
    for name, evaluate in (("kept", "true"), ("skipped", "false")):
        (folder / f"{name}.yaml").write_text(EVALUATED.format(name=name, root=repo_root, evaluate=evaluate))
    for job in plan_for(folder=folder).jobs:  # far better runs of the same sweep definition came first
        if job.kind == "train" and job.spec.prune is not None:
            under = job.spec.prune.measured_under
            record_others(tmp_path / "runs", [0.1, 0.1, 0.1], "low", job.spec.prune.sweep, under)
    assert launch.main(["--all", "--config-dir", str(folder), "--backend", "local"]) == 0
    kept, skipped = (tmp_path / "runs" / f"{name}-lr1e-09" for name in ("kept", "skipped"))
    assert RunDir(kept / "train").read_pruned()["rung"] == 1 and RunDir(skipped / "train").read_pruned()
    assert "exact_match" in RunDir(kept / "eval").read_results()  # scored on the pruned run's adapter
    assert RunDir(skipped / "eval").read_results() == {"skipped": "pruned (prune.eval_pruned: false)"}
    assert not RunDir(skipped / "eval").predictions.exists()  # nothing generated
    capsys.readouterr()
    assert launch.main(["--all", "--config-dir", str(folder), "--backend", "local"]) == 0
    assert "Nothing to submit" in capsys.readouterr().out
