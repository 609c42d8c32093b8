"""Watching and cancelling always work: a broken YAML elsewhere is a warning, a local run is stopped
through its own process, and a failed local job says why. Real local jobs (submitit's LocalExecutor)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from submitit.core.utils import JobPaths

import launch
from core.layout import archive_folder
from tests.conftest import write_cluster_yaml
from tests.helpers import TINY_SQL_EXPERIMENT, alive, configs, record, tiny_sql_base, wait_until

BROKEN = "name: broken\nmodel:\n  name_or_path: [unclosed\n"


def test_watching_goes_on_when_another_yaml_is_broken(repo_root, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(repo_root)
    folder = configs(tmp_path, repo_root, fine={})
    (folder / "broken.yaml").write_text(BROKEN)
    expected = {  # action: (exit code, what it printed about the experiment that loads)
        "--status": (0, "fine/train"),
        "--tail": (1, "fine/train has not been submitted"),
        "--cancel": (0, "Cancelled 0 job(s)"),
    }
    for action, (code, printed) in expected.items():
        capsys.readouterr()
        argv = [action, "fine/train"] if action == "--tail" else [action]
        assert launch.main([*argv, "--config-dir", str(folder)]) == code, action
        out, err = capsys.readouterr()
        assert re.search(r"warning: \S*broken\.yaml:3", err), (action, err)
        assert printed in out, (action, out)
    assert launch.main(["--all", "--config-dir", str(folder), "--dry-run"]) == 2  # submitting still refuses


def test_report_on_a_run_root_that_holds_no_run_says_so_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """Before: an empty runs/report.md and exit 0, when the runs were in another folder's run root (a
    named --config-dir reports its experiments, run or not: not this case)."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "configs" / "experiments"  # the default folder, its cluster.yaml's run root
    folder.mkdir(parents=True)
    write_cluster_yaml(folder, tmp_path)
    assert launch.main(["--report"]) == 1
    said = " ".join(capsys.readouterr().err.split())
    assert f"nothing to report: the run root {tmp_path / 'runs'}/ holds no run" in said
    assert not (tmp_path / "runs" / "report.md").exists()


@pytest.mark.slow
def test_a_failed_local_job_shows_its_exception_and_log(repo_root, tmp_path, tiny, monkeypatch, capsys):
    monkeypatch.chdir(repo_root)
    empty = tmp_path / "empty-model"  # a folder, so validation passes; loading it fails on the node
    # (preflight would refuse it before queueing: skipped, as this test is about a job that fails)
    empty.mkdir()
    folder = configs(tmp_path, repo_root, crash={"model": empty})
    assert launch.main(["--all", "--config-dir", str(folder), "--backend", "local", "--no-preflight"]) == 1
    launched = capsys.readouterr().out
    pid = record(tmp_path, "crash/train")["job_id"]
    log = JobPaths(tmp_path / "logs" / "crash" / "train", pid).stdout
    # One log, as on SLURM: the traceback is there, not in a separate .err file.
    error = [line for line in log.read_text().splitlines() if re.match(r"\w+Error: ", line)][-1].strip()
    assert f"crash/train: FAILED ({error} (log: {log}))" in launched

    assert launch.main(["--status", "--config-dir", str(folder)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"crash/train: FAILED (local pid {pid}) {error}" in lines
    assert f"  log: {log}" in lines


@pytest.mark.slow
def test_cancel_stops_a_local_run(repo_root, tmp_path, tiny, monkeypatch, capsys):
    monkeypatch.chdir(repo_root)
    folder = configs(tmp_path, repo_root, long={"epochs": 500})
    run = subprocess.Popen(
        [sys.executable, "launch.py", "--all", "--config-dir", str(folder), "--backend", "local"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        progress = tmp_path / "runs" / "long" / "train" / "progress.json"
        wait_until(progress.exists, "the local job to train")
        pid = record(tmp_path, "long/train")["job_id"]
        assert launch.main(["--cancel", "--all", "--config-dir", str(folder)]) == 0
        assert "Cancelled 1 job(s): long/train" in capsys.readouterr().out
        wait_until(lambda: not alive(pid), f"local job {pid} to stop")
        assert run.wait(timeout=60) == 1
    finally:
        run.kill()
        job = tmp_path / "runs" / "long" / "train" / "job.json"
        if job.exists() and alive(pid := record(tmp_path, "long/train")["job_id"]):
            os.kill(int(pid), signal.SIGINT)  # a failed test leaves no training behind
    assert "long/train: CANCELLED" in run.stdout.read()  # the launcher sees it cancelled, not failed
    assert launch.main(["--status", "--config-dir", str(folder)]) == 0
    assert "CANCELLED" in capsys.readouterr().out
    assert not (tmp_path / "runs" / "long" / "train" / "DONE").exists()


def test_cancel_naming_an_experiment_that_does_not_exist_fails_instead_of_cancelling_nothing(
    repo_root, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(repo_root)
    folder = configs(tmp_path, repo_root, real={})
    assert launch.main(["--cancel", "--exp", "rael", "--config-dir", str(folder)]) == 2
    shown = capsys.readouterr().err
    assert f"--exp: no experiment named 'rael' in {folder}/ (did you mean 'real'?)" in shown


@pytest.mark.slow
def test_force_keeps_the_old_run_under_a_free_name_when_its_archive_name_is_taken(
    repo_root, tmp_path, tiny, monkeypatch, capsys
):
    monkeypatch.chdir(repo_root)
    argv = ["--all", "--config-dir", str(configs(tmp_path, repo_root, quick={})), "--backend", "local"]
    assert launch.main([*argv, "--no-preflight"]) == 0
    configs(tmp_path, repo_root, quick={"epochs": 2})  # the finished run's config changed
    run_dir = tmp_path / "runs" / "quick" / "train"
    # Every name an archive made in the next two minutes would get is taken already (a --force a second
    # earlier, or someone's copy): none may be overwritten, none may stop the launch.
    now = time.time()
    for second in range(120):
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now + second))
        (run_dir.parent / archive_folder(run_dir.name, stamp) / "theirs").mkdir(parents=True)
    assert launch.main([*argv, "--no-preflight", "--force"]) == 0
    archives = [p for p in run_dir.parent.iterdir() if (p / "config.yaml").exists() and p != run_dir]
    assert len(archives) == 1 and (archives[0] / "DONE").exists()  # the old run, moved aside whole
    assert "epochs: 1" in (archives[0] / "config.yaml").read_text()
    taken = [p for p in run_dir.parent.glob(archive_folder(run_dir.name, "*")) if p not in archives]
    assert len(taken) == 120 and all((p / "theirs").exists() for p in taken)


@pytest.mark.slow
def test_force_archives_the_eval_of_a_rerun_stage_too_its_results_kept(
    repo_root, tmp_path, tiny, monkeypatch
):
    """Issue 31, rule 3. Before: only train.old-* was kept; the eval, whose own spec had not changed, was
    rerun in place and the old results.json and predictions were lost."""
    monkeypatch.chdir(repo_root)

    def with_eval(epochs: int) -> Path:
        folder = configs(tmp_path, repo_root, quick={"epochs": epochs})
        path = folder / "quick.yaml"
        path.write_text(path.read_text() + "eval: {metrics: [exact_match], split: train, limit: 8}\n")
        return folder

    argv = ["--all", "--config-dir", str(with_eval(1)), "--backend", "local"]
    assert launch.main([*argv, "--no-preflight"]) == 0
    experiment = tmp_path / "runs" / "quick"
    old_results = (experiment / "eval" / "results.json").read_text()
    with_eval(2)  # the training changed; the eval's own keys did not
    assert launch.main([*argv, "--no-preflight", "--force"]) == 0
    archived = {p.name.split(".old-")[0]: p for p in experiment.iterdir() if ".old-" in p.name}
    assert sorted(archived) == ["eval", "train"]
    assert (archived["eval"] / "results.json").read_text() == old_results
    assert (archived["eval"] / "predictions.jsonl").exists()
    assert (experiment / "eval" / "results.json").exists()  # and the rerun wrote its own


@pytest.mark.slow
def test_a_local_relaunch_reads_each_experiment_file_once_report_included(
    repo_root, tmp_path, tiny, monkeypatch, capsys
):
    """Issue 42: a relaunch validated its folder, loaded it again for what the run root holds that the folder
    no longer has, and a run ending here loaded it once or twice more for its report (a slow folder of many
    sweeps paid each time, and an edit between the loads could make them disagree)."""
    from slurm.planning import experiments

    monkeypatch.chdir(repo_root)
    folder = configs(tmp_path, repo_root, quick={})
    argv = ["--all", "--config-dir", str(folder), "--backend", "local", "--no-preflight"]
    assert launch.main(argv) == 0
    reads: list[str] = []
    load = experiments.load_with_overrides
    monkeypatch.setattr(
        experiments, "load_with_overrides", lambda path, *a: reads.append(path.name) or load(path, *a)
    )
    capsys.readouterr()
    assert launch.main(argv) == 0  # nothing to run; the report is written again
    assert "Report: " in capsys.readouterr().out
    files = sorted(
        p.name for p in folder.glob("*.yaml") if not p.name.startswith("_") and p.name != "cluster.yaml"
    )
    assert sorted(reads) == files


@pytest.mark.slow
def test_status_calls_a_stage_finished_with_another_config_completed_not_failed(
    repo_root, tmp_path, tiny, monkeypatch, capsys
):
    """Issue 31, rule 8. Before: after an edit, --status called the finished stage FAILED and suggested
    --retry-failed; the relaunch said what it was: finished with another config."""
    monkeypatch.chdir(repo_root)
    folder = configs(tmp_path, repo_root, quick={})
    assert launch.main(["--all", "--config-dir", str(folder), "--backend", "local", "--no-preflight"]) == 0
    configs(tmp_path, repo_root, quick={"epochs": 2})
    capsys.readouterr()
    assert launch.main(["--status", "--config-dir", str(folder)]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "quick/train" in said and "COMPLETED" in said and "FAILED" not in said
    assert "with another config (changed: train.epochs)" in said
    assert "--retry-failed" not in said


def test_pack_on_a_machine_without_slurm_is_refused_before_any_experiment_is_loaded(
    repo_root, tmp_path, capsys
):
    # Before: refused only after loading, planning, preflight and taking the launch lock, so a broken YAML
    # (or minutes of preflight) came first and the run root's lock file was made for nothing.
    folder = configs(tmp_path, repo_root, a={})
    (folder / "broken.yaml").write_text(BROKEN)
    code = launch.main(["--all", "--backend", "local", "--pack", "2", "--config-dir", str(folder)])
    err = capsys.readouterr().err
    assert code == 2 and "--pack: packs a SLURM allocation, and there is no SLURM here" in err, err
    assert "broken.yaml" not in err and "1 problem(s)" in err
    assert not (tmp_path / "runs").exists()  # no lock taken, nothing written
    code = launch.main(
        ["--all", "--backend", "local", "--pack", "2", "--dry-run", "--config-dir", str(folder)]
    )
    assert (
        code == 2 and "broken.yaml" in capsys.readouterr().err
    )  # a dry run still shows what a pack would do


@pytest.mark.slow
def test_a_dry_run_after_the_run_shows_what_a_relaunch_would_do_and_only_what_is_left(
    repo_root, tmp_path, tiny, monkeypatch, capsys
):
    # Before: every job PLANNED after it had completed, and the makespan counted the finished jobs.
    monkeypatch.chdir(repo_root)
    folder = configs(tmp_path, repo_root, a={}, b={})
    assert launch.main(["--exp", "a", "--backend", "local", "--config-dir", str(folder)]) == 0
    capsys.readouterr()
    assert launch.main(["--all", "--dry-run", "--json", "--config-dir", str(folder)]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert {job["id"]: job["state"] for job in plan["jobs"]} == {"a/train": "done", "b/train": "planned"}
    only_b = next(job for job in plan["jobs"] if job["id"] == "b/train")["estimate"]["seconds"]
    assert plan["makespan_s"] == round(only_b)  # what is left: b alone
    assert launch.main(["--exp", "a", "--dry-run", "--config-dir", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "COMPLETED (done)" in out and "Nothing left to run" in out and "PLANNED" not in out
    a_yaml = folder / "a.yaml"  # a changed learning rate
    a_yaml.write_text(a_yaml.read_text().replace("{epochs: 1}", "{epochs: 1, learning_rate: 2.0e-3}"))
    assert launch.main(["--exp", "a", "--dry-run", "--config-dir", str(folder)]) == 0
    out, err = capsys.readouterr()
    assert "REFUSED" in out and "a launch would refuse" in err and "train.learning_rate" in err


@pytest.mark.slow
def test_watching_shows_what_the_run_root_holds_not_only_the_default_config_folder(
    repo_root, tmp_path, tiny, monkeypatch, capsys
):
    # Before: a plain --status listed the default folder's experiments as PLANNED and nothing that had run
    # from another folder, and each folder's --report replaced runs/report.md with its own experiments.
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "configs"
    root.mkdir()
    write_cluster_yaml(root, tmp_path)  # one run root for every folder below (found by inheritance)
    tiny_sql_base(root)  # and one base experiment
    for folder, name in (("experiments", "never-run"), ("demo", "a"), ("other", "b")):
        (root / folder).mkdir()
        fields = {"model": repo_root / "models" / "tiny-llama", "epochs": 1}
        (root / folder / f"{name}.yaml").write_text(TINY_SQL_EXPERIMENT.format(name=name, **fields))
    for folder in ("demo", "other"):
        assert launch.main(["--all", "--config-dir", f"configs/{folder}", "--backend", "local"]) == 0
    report = (tmp_path / "runs" / "report.md").read_text()
    assert "| a |" in report and "| b |" in report  # the second launch's report kept the first's row
    capsys.readouterr()

    assert launch.main(["--status"]) == 0
    shown = capsys.readouterr().out
    assert "a/train" in shown and "b/train" in shown and "never-run" not in shown
    assert "From configs/demo/ (1 experiment(s)), configs/other/ (1 experiment(s))." in shown
    assert launch.main(["--status", "--config-dir", "configs/experiments"]) == 0  # a filter: its own
    shown = capsys.readouterr().out
    assert "never-run/train" in shown and "PLANNED" in shown and "a/train" not in shown
    assert launch.main(["--status", "--exp", "b"]) == 0
    shown = capsys.readouterr().out
    assert "b/train" in shown and "a/train" not in shown
    assert launch.main(["--tail", "a"]) == 0
    assert "a/train: COMPLETED" in capsys.readouterr().out

    assert launch.main(["--report", "--config-dir", "configs/demo"]) == 0
    report = (tmp_path / "runs" / "report.md").read_text()
    assert "| a |" in report and "| b |" in report  # a folder's --report is not a part replacing the whole
    assert "| never-run |" not in report  # nothing of it ran, and --config-dir did not name it

    (root / "other" / "b.yaml").unlink()
    # A run folder from before origins were recorded (no origin.json), of a folder the default one lacks:
    # not called gone, since --cancel --removed would stop its jobs.
    (tmp_path / "runs" / "legacy" / "train").mkdir(parents=True)
    (tmp_path / "runs" / "legacy" / "train" / "job.json").write_text('{"jobs": []}')
    capsys.readouterr()
    assert launch.main(["--status"]) == 0
    shown = capsys.readouterr().out
    assert "runs/ also holds b: no longer in any config folder" in " ".join(shown.split())
    assert "legacy" not in shown
    assert launch.main(["--exp", "b", "--status"]) == 0
    assert "'b' has a run folder in" in " ".join(capsys.readouterr().err.split())
